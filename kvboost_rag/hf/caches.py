"""The cache objects handed to transformers models.

The engine sees K/V as ``[layers, kv_heads, tokens, head_dim]`` buffers. The classes here
present such buffers to a model as a transformers ``Cache``: :class:`BufferedCache` (one
sequence; appends in place, writes at chosen positions, and scatters into armed positions).
The engine loop's packed pass hands the model a cache over several of them
(:class:`~kvboost_rag.hf.packed.PackedCache`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


#: The cache type every forward call of the engine receives and returns.
ModelCache = DynamicCache


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a model's ``forward`` takes its cache by: ``cache`` in newer transformers
    (``past_key_values`` is deprecated there), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class BufferedLayer(DynamicLayer):
    """A cache layer whose K/V live in a buffer with room to grow.

    Appending writes only the new tokens (``DynamicLayer`` concatenates, copying the whole
    cache on every decoded token). After :meth:`arm`, the next update instead scatters the
    new tokens' K/V into the armed positions of the tokens already held and returns all of
    them, so attention sees every prompt token while only the chosen tokens were computed.
    """

    def __init__(self, key_buffer: torch.Tensor | None, value_buffer: torch.Tensor | None, length: int, capacity: int) -> None:
        super().__init__()
        self._key_buffer, self._value_buffer = key_buffer, value_buffer
        self._length = length
        self._capacity_hint = capacity
        self._scatter_index: torch.Tensor | None = None
        if key_buffer is not None:
            self.dtype, self.device = key_buffer.dtype, key_buffer.device
            self.is_initialized = True

    # DynamicLayer reads and assigns ``keys``/``values``; they are views of the buffers.
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._key_buffer is None else self._key_buffer[:, :, : self._length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._key_buffer = value
        self._length = 0 if value is None else value.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._value_buffer is None else self._value_buffer[:, :, : self._length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._value_buffer = value

    def arm(self, positions: torch.Tensor) -> None:
        """Make the next update scatter into ``positions`` instead of appending."""
        self._scatter_index = positions

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._scatter_index is not None:
            index, self._scatter_index = self._scatter_index, None
            self._key_buffer[:, :, index] = key_states
            self._value_buffer[:, :, index] = value_states
            return self.keys, self.values
        new = key_states.shape[-2]
        end = self._length + new
        if self._key_buffer is None:
            shape = (*key_states.shape[:2], max(self._capacity_hint, end), key_states.shape[-1])
            self._key_buffer = key_states.new_empty(shape)
            self._value_buffer = value_states.new_empty((*shape[:3], value_states.shape[-1]))
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
        elif end > self._key_buffer.shape[-2]:
            self._grow(max(end, 2 * self._key_buffer.shape[-2]))
        self._key_buffer[:, :, self._length : end] = key_states
        self._value_buffer[:, :, self._length : end] = value_states
        self._length = end
        return self.keys, self.values

    def put(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        first: int,
        last: int,
        index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the K/V of new tokens at their positions: ``first..last`` (``index`` ``None``),
        or the ascending positions ``index`` holds on the buffers' device (``first`` and
        ``last`` its first and last, read on the host). The layer then holds every position
        up to ``last``, at least. Returns every token held, as :meth:`update` does.

        Tokens right after those held are appended (:meth:`update`); positions among them
        overwrite their rows (the blend pass, the probe).
        """
        if index is None and first == self._length or self._key_buffer is None:
            if first != self._length or last - first + 1 != key_states.shape[-2]:
                raise ValueError(f"a layer of {self._length} tokens cannot take tokens at {first}..{last} first")
            return self.update(key_states, value_states)
        if last >= self._key_buffer.shape[-2]:
            self._grow(max(last + 1, 2 * self._key_buffer.shape[-2]))
        if index is None:
            self._key_buffer[:, :, first : last + 1] = key_states
            self._value_buffer[:, :, first : last + 1] = value_states
        else:
            self._key_buffer[:, :, index] = key_states
            self._value_buffer[:, :, index] = value_states
        self._length = max(self._length, last + 1)
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` tokens (the rows past them are never read again and
        are overwritten by the next append)."""
        if length > self._length:
            raise ValueError(f"cannot truncate a layer of {self._length} tokens to {length}")
        self._length = length

    def _grow(self, capacity: int) -> None:
        length = self._length
        keys = self._key_buffer.new_empty((*self._key_buffer.shape[:2], capacity, self._key_buffer.shape[-1]))
        values = self._value_buffer.new_empty((*self._value_buffer.shape[:2], capacity, self._value_buffer.shape[-1]))
        keys[:, :, :length] = self._key_buffer[:, :, :length]
        values[:, :, :length] = self._value_buffer[:, :, :length]
        self._key_buffer, self._value_buffer, self._length = keys, values, length


class BufferedCache(DynamicCache):
    """A :class:`DynamicCache` of :class:`BufferedLayer`, one per model layer.

    Args:
        num_layers: Layers of the model.
        capacity: Tokens to reserve per layer (prompt plus new tokens).
        key_buffer: Optional ``[layers, heads, >=capacity, dim]`` buffer already holding the
            first ``length`` tokens; each layer uses a view of it.
        value_buffer: Same for V.
        length: Tokens already in the buffers.
    """

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        key_buffer: torch.Tensor | None = None,
        value_buffer: torch.Tensor | None = None,
        length: int = 0,
    ) -> None:
        super().__init__()
        self.layer_class_to_replicate = None
        self._shared = (key_buffer, value_buffer) if key_buffer is not None and value_buffer is not None else None
        if self._shared is None:
            self.layers = [BufferedLayer(None, None, 0, capacity) for _ in range(num_layers)]
        else:
            keys, values = key_buffer.unsqueeze(1), value_buffer.unsqueeze(1)  # [layers, 1, heads, capacity, dim]
            self.layers = [BufferedLayer(keys[i], values[i], length, capacity) for i in range(num_layers)]

    def arm(self, positions: torch.Tensor, first_layer: int = 0) -> None:
        """Arm layers from ``first_layer`` on to scatter the next update into ``positions``."""
        for layer in self.layers[first_layer:]:
            layer.arm(positions)

    def truncate(self, length: int) -> None:
        """Keep only each layer's first ``length`` tokens (a verify step's rejected drafts)."""
        for layer in self.layers:
            layer.truncate(length)

    def shared_view(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``[layers, heads, tokens, dim]`` views of the tokens held, if the cache was built over
        one sequence's buffers and every layer still writes into them (no layer had to grow)."""
        if self._shared is None:
            return None
        keys, values = self._shared
        for i, layer in enumerate(self.layers):
            if layer._key_buffer is None or layer._key_buffer.data_ptr() != keys[i].data_ptr():
                return None
        length = self.layers[0]._length
        return keys[:, :, :length], values[:, :, :length]


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Keep only the first ``length`` tokens of every layer of ``cache``."""
    if isinstance(cache, BufferedCache):
        cache.truncate(length)
        return
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]


def cache_tensors(cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache's K/V (its first row) as ``[layers, heads, tokens, dim]``.

    A view (no copy) when the cache is a :class:`BufferedCache` still living in the one buffer
    it was built over; callers that keep the result must clone it.
    """
    if isinstance(cache, BufferedCache):
        shared = cache.shared_view()
        if shared is not None:
            return shared
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return keys, values
