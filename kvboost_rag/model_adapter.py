"""Everything that knows transformers internals: cache objects, RoPE re-rotation, forward calls.

The rest of the engine sees K/V as ``[layers, kv_heads, tokens, head_dim]`` tensors and calls
three things here: a forward pass over chosen tokens at chosen positions on top of a cache, a
partial pass that stops after one layer (CacheBlend's selection), and key re-rotation.

Position-independent reuse relies on keys being rotated by RoPE with fixed frequencies
(rotate-half convention, full or partial rotary): a key computed at position ``p0`` moves to
``p`` by rotating it by ``p - p0``. Models without that property get prefix-only reuse.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvboost_rag.attention import ATTENTION_NAME, query_positions
from kvboost_rag.errors import UnsupportedModelError
from kvboost_rag.fingerprint import model_fingerprint
from kvboost_rag.kv_codec import KVLayout
from kvboost_rag.ragged import RAGGED_ATTENTION, RaggedCache, attention_calls

logger = logging.getLogger(__name__)

#: Architectures whose RoPE re-rotation is verified by the test suite.
POSITION_INDEPENDENT_TYPES = frozenset(
    {
        "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
        "phi3", "stablelm", "granite", "olmo", "olmo2",
    }
)
#: RoPE variants whose frequencies do not depend on sequence length.
_FIXED_FREQUENCY_ROPE = frozenset({"default", "linear", "llama3", "yarn"})


class _StopForward(Exception):
    """Raised by a hook to end a forward pass after the selection layer."""


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
            self.layers = [
                BufferedLayer(key_buffer[i : i + 1], value_buffer[i : i + 1], length, capacity) for i in range(num_layers)
            ]

    def arm(self, positions: torch.Tensor, first_layer: int = 0) -> None:
        """Arm layers from ``first_layer`` on to scatter the next update into ``positions``."""
        for layer in self.layers[first_layer:]:
            layer.arm(positions)

    def shared_view(self, start: int, end: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``[layers, heads, tokens, dim]`` views of tokens ``[start, end)`` if every layer still
        writes into the buffer the cache was built over (no layer had to grow)."""
        if self._shared is None:
            return None
        keys, values = self._shared
        for i, layer in enumerate(self.layers):
            if layer._key_buffer is None or layer._key_buffer.data_ptr() != keys[i].data_ptr():
                return None
        length = self.layers[0]._length
        stop = length if end is None else min(end, length)
        return keys[:, :, start:stop], values[:, :, start:stop]


class ModelAdapter:
    """Wraps a causal LM and its tokenizer for the engine.

    Args:
        model: A transformers causal LM (eval mode is set here).
        tokenizer: Its fast tokenizer.
    """

    def __init__(self, model: torch.nn.Module, tokenizer) -> None:
        if tokenizer is None:
            raise UnsupportedModelError("a tokenizer is required: pass the model's tokenizer")
        if not getattr(tokenizer, "is_fast", False):
            raise UnsupportedModelError(
                "a fast tokenizer is required (character offsets locate documents in prompts): "
                "load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config.get_text_config(decoder=True)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.layout = self._probe_layout()
        self._decoder_layers_owner, self._decoder_layers = self._find_decoder_layers()
        self._inv_freq, self.position_independent_reason = self._find_rope()
        #: Whether one forward pass decodes several sequences (else one pass per sequence).
        self.batched_decoding = self._probe_batched_decoding()
        self.sliding_window: int | None = getattr(self.config, "sliding_window", None) or None
        if getattr(self.config, "use_sliding_window", True) is False:
            self.sliding_window = None
        if "full_attention" in (getattr(self.config, "layer_types", None) or []):
            # Interleaved local/global layers (Gemma 2/3): the local layers' attention applies
            # their window itself; no window bounds the prompt as a whole.
            self.sliding_window = None

    # ----------------------------------------------------------------- properties
    @property
    def position_independent(self) -> bool:
        """Whether cached keys can move to new positions by re-rotation."""
        return self._inv_freq is not None

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return self.layout.layers

    @property
    def context_window(self) -> int:
        """Largest number of positions the model accepts."""
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(self.config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return int(getattr(self.tokenizer, "model_max_length", 2048))

    def fingerprint(self, extra: list[str]) -> str:
        """Fingerprint of the model (config, every weight and buffer), dtype, tokenizer and
        ``extra`` settings; see :func:`kvboost_rag.fingerprint.model_fingerprint`."""
        return model_fingerprint(self.model, self.tokenizer, self.dtype, extra)

    # ----------------------------------------------------------------- forward passes
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
        sparse_queries: bool = False,
    ) -> torch.Tensor:
        """Run ``input_ids`` ``[n]`` at ``position_ids`` ``[n]`` on top of ``cache``.

        Args:
            input_ids: Tokens to run.
            position_ids: Their positions (sorted).
            cache: The cache to attend to and extend.
            sparse_queries: The tokens sit at scattered positions of an armed
                :class:`BufferedCache` that holds every prompt position; attention is made
                causal by position (:mod:`kvboost_rag.attention`).

        Returns:
            Logits of the last input token, ``[vocab]`` float32.
        """
        call = dict(
            input_ids=input_ids.view(1, -1).to(self.device),
            position_ids=position_ids.view(1, -1).to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        if not sparse_queries:
            return self.model(**call).logits[0, -1].float()
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTENTION_NAME
        try:
            with query_positions(position_ids):
                out = self.model(**call)
        finally:
            config._attn_implementation = previous
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def forward_ragged(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, caches: Sequence[DynamicCache]
    ) -> torch.Tensor:
        """One decode step of several sequences in one forward pass.

        Row ``b`` runs token ``input_ids[b]`` at ``position_ids[b]`` over ``caches[b]``, which
        must hold exactly positions ``0..position_ids[b] - 1``; its K/V is appended there.
        Attention runs per row over the row's own cache (:mod:`kvboost_rag.ragged`), so
        sequences of any lengths share the step without padding.

        Args:
            input_ids: ``[batch]`` tokens.
            position_ids: ``[batch]`` their positions.
            caches: One cache per row.

        Returns:
            ``[batch, vocab]`` float32 logits.
        """
        if not self.batched_decoding:
            rows = [self.forward(input_ids[b : b + 1], position_ids[b : b + 1], cache) for b, cache in enumerate(caches)]
            return torch.stack(rows)
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = RAGGED_ATTENTION
        try:
            out = self.model(
                input_ids=input_ids.view(-1, 1).to(self.device),
                position_ids=position_ids.view(-1, 1).to(self.device),
                past_key_values=RaggedCache(caches),
                use_cache=True,
                logits_to_keep=1,
            )
        finally:
            config._attn_implementation = previous
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def forward_until_layer(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache, last_layer: int
    ) -> torch.Tensor:
        """Run the first ``last_layer + 1`` decoder layers only, filling ``cache`` for them.

        Returns:
            ``[1, tokens, hidden]`` hidden states after layer ``last_layer``.
        """
        captured: list[torch.Tensor] = []

        def stop(_module, _args, output) -> None:
            captured.append(output[0] if isinstance(output, tuple) else output)
            raise _StopForward

        handle = self._decoder_layers[last_layer].register_forward_hook(stop)
        base = getattr(self.model, self.model.base_model_prefix, self.model)
        try:
            base(
                input_ids=input_ids.view(1, -1).to(self.device),
                position_ids=position_ids.view(1, -1).to(self.device),
                past_key_values=cache,
                use_cache=True,
            )
        except _StopForward:
            pass
        finally:
            handle.remove()
        return captured[0]

    @torch.inference_mode()
    def forward_from_layer(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: BufferedCache,
        first_layer: int,
        hidden: torch.Tensor | None,
    ) -> torch.Tensor:
        """Like :meth:`forward` with sparse queries, but starting at decoder layer
        ``first_layer`` from ``hidden`` (``[1, tokens, hidden]``, the output of the layer
        before; ``None`` with ``first_layer=0``): the layers below are skipped, and their
        cache layers left as they are.

        Returns:
            Logits of the last input token, ``[vocab]`` float32.
        """
        with self._only_layers(first_layer, self.num_layers - 1, hidden):
            return self.forward(input_ids, position_ids, cache, sparse_queries=True)

    @torch.inference_mode()
    def hidden_through_layers(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: BufferedCache,
        first_layer: int,
        last_layer: int,
        hidden: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run decoder layers ``first_layer..last_layer`` only, from ``hidden`` (the output of
        the layer before; ``None`` with ``first_layer=0``), with sparse queries over an armed
        cache.

        Returns:
            ``[1, tokens, hidden]`` hidden states after layer ``last_layer``.
        """
        if last_layer >= self.num_layers - 1:
            raise ValueError("hidden_through_layers stops below the last layer; use forward_from_layer")
        captured: list[torch.Tensor] = []

        def stop(_module, _args, output) -> None:
            captured.append(output[0] if isinstance(output, tuple) else output)
            raise _StopForward

        handle = self._decoder_layers[last_layer].register_forward_hook(stop)
        try:
            with self._only_layers(first_layer, last_layer, hidden):
                self.forward(input_ids, position_ids, cache, sparse_queries=True)
        except _StopForward:
            pass
        finally:
            handle.remove()
        return captured[0]

    @contextmanager
    def _only_layers(self, first_layer: int, last_layer: int, hidden: torch.Tensor | None) -> Iterator[None]:
        """Within the block the model runs decoder layers ``first_layer..last_layer`` only,
        the first of them fed ``hidden`` instead of the embeddings' way up."""
        parent, name = self._decoder_layers_owner
        layers = self._decoder_layers

        def inject(_module, args, kwargs):
            if args:
                return (hidden.to(args[0].dtype), *args[1:]), kwargs
            kwargs["hidden_states"] = hidden.to(kwargs["hidden_states"].dtype)
            return args, kwargs

        # Models that look up each layer's type by its index in the loop (Gemma 3's RoPE per
        # layer type, Qwen's masks) see the types of the layers that actually run.
        config = getattr(parent, "config", None)
        layer_types = getattr(config, "layer_types", None)
        handle = layers[first_layer].register_forward_pre_hook(inject, with_kwargs=True) if hidden is not None else None
        setattr(parent, name, torch.nn.ModuleList(list(layers)[first_layer : last_layer + 1]))
        if layer_types:
            config.layer_types = list(layer_types)[first_layer : last_layer + 1]
        try:
            yield
        finally:
            setattr(parent, name, layers)
            if layer_types:
                config.layer_types = layer_types
            if handle is not None:
                handle.remove()

    # ----------------------------------------------------------------- caches
    def new_cache(self, capacity: int) -> BufferedCache:
        """An empty cache reserving ``capacity`` tokens per layer.

        Every layer keeps all its tokens, sliding-window layers included: the model's masks
        still apply the window, and stored K/V stays complete.
        """
        return BufferedCache(self.num_layers, capacity)

    def buffers(self, capacity: int, layers: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialized ``[layers, heads, capacity, dim]`` K and V buffers."""
        shape = (layers or self.num_layers, self.layout.kv_heads, capacity, self.layout.head_dim)
        keys = torch.empty(shape, dtype=self.dtype, device=self.device)
        return keys, torch.empty_like(keys)

    @staticmethod
    def cache_over(keys: torch.Tensor, values: torch.Tensor, length: int) -> BufferedCache:
        """A cache over ``[layers, heads, capacity, dim]`` buffers holding ``length`` tokens."""
        return BufferedCache(keys.shape[0], keys.shape[2], keys, values, length)

    @staticmethod
    def cache_tensors(cache: DynamicCache, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A cache's K/V for tokens ``[start, end)`` as ``[layers, heads, tokens, dim]``.

        A view (no copy) when the cache still lives in the one buffer it was built over;
        callers that keep the result must clone it.
        """
        if isinstance(cache, BufferedCache):
            shared = cache.shared_view(start, end)
            if shared is not None:
                return shared
        keys = torch.stack([layer.keys[0, :, start:end] for layer in cache.layers])
        values = torch.stack([layer.values[0, :, start:end] for layer in cache.layers])
        return keys, values

    # ----------------------------------------------------------------- RoPE
    def rotate_keys(
        self, keys: torch.Tensor, delta: torch.Tensor | int, out: torch.Tensor | None = None, first_layer: int = 0
    ) -> torch.Tensor:
        """Move keys by ``delta`` positions by RoPE re-rotation, with each layer's frequencies.

        Args:
            keys: ``[layers, heads, tokens, head_dim]``: layers ``first_layer`` on.
            delta: New position minus the position the keys were computed at: one int for all
                tokens, or ``[tokens]``.
            out: Tensor to write the result into (same shape; may be a view of a larger
                tensor). A new tensor when omitted.
            first_layer: Model layer of ``keys[0]``.

        Returns:
            The rotated keys (``out`` when given).
        """
        if self._inv_freq is None:
            raise UnsupportedModelError(f"keys cannot be re-rotated: {self.position_independent_reason}")
        dst = out if out is not None else torch.empty_like(keys)
        half = self._inv_freq.shape[1]
        delta_t = torch.as_tensor(delta, dtype=torch.float64).view(-1, 1)
        if bool((delta_t == 0).all()):
            if dst is not keys:
                dst.copy_(keys)
            return dst
        # Angles in float64 (positions times frequencies lose precision in float32), the
        # rotation itself in float32.
        frequencies = self._inv_freq[first_layer : first_layer + keys.shape[0]]  # [layers, half]
        angles = delta_t.view(1, 1, -1, 1) * frequencies.view(-1, 1, 1, half)  # [layers, 1, tokens or 1, half]
        if bool((frequencies == frequencies[:1]).all()):
            angles = angles[:1]  # one table for all layers
        cos = angles.cos().float().to(keys.device)
        sin = angles.sin().float().to(keys.device)
        x1, x2 = keys[..., :half].float(), keys[..., half : 2 * half].float()
        first = x1 * cos - x2 * sin
        second = x2 * cos + x1 * sin
        dst[..., :half] = first
        dst[..., half : 2 * half] = second
        if 2 * half < keys.shape[-1] and dst is not keys:
            dst[..., 2 * half :] = keys[..., 2 * half :]
        return dst

    # ----------------------------------------------------------------- discovery
    @torch.inference_mode()
    def _probe_layout(self) -> KVLayout:
        cache = DynamicCache()
        token = torch.tensor([[self.tokenizer.pad_token_id or self.tokenizer.eos_token_id or 0]], device=self.device)
        self.model(input_ids=token, past_key_values=cache, use_cache=True)
        shapes = {tuple(layer.keys.shape) for layer in cache.layers}
        if len(shapes) != 1:
            raise UnsupportedModelError(f"layers with different K/V shapes are not supported: {sorted(shapes)}")
        _, heads, _, dim = shapes.pop()
        return KVLayout(layers=len(cache.layers), kv_heads=heads, head_dim=dim)

    def _probe_batched_decoding(self) -> bool:
        """Run one ragged decode step of one token and check that every layer's attention
        went through :mod:`kvboost_rag.ragged` (models with their own attention code do not)."""
        token = torch.tensor([self.tokenizer.pad_token_id or self.tokenizer.eos_token_id or 0])
        cache = self.new_cache(2)
        self.forward(token, torch.tensor([0]), cache)
        self.batched_decoding = True
        before = attention_calls()
        self.forward_ragged(token, torch.tensor([1]), [cache])
        calls = attention_calls() - before
        if calls != self.num_layers:
            logger.warning(
                "this model's attention does not go through transformers' attention interface "
                "(%d of %d layers); concurrent requests decode one sequence per forward pass",
                calls,
                self.num_layers,
            )
            return False
        return True

    def _find_decoder_layers(self) -> tuple[tuple[torch.nn.Module, str], torch.nn.ModuleList]:
        """The decoder layers' ``ModuleList`` and ``(owner module, attribute name)``."""
        modules = dict(self.model.named_modules())
        for name, module in modules.items():
            if isinstance(module, torch.nn.ModuleList) and len(module) == self.layout.layers:
                owner_name, _, attribute = name.rpartition(".")
                return (modules[owner_name], attribute), module
        raise UnsupportedModelError("cannot find the decoder layers of this model")

    def _find_rope(self) -> tuple[torch.Tensor | None, str]:
        """RoPE frequencies of every layer, ``[layers, rotary_dim / 2]`` float64.

        Models with one RoPE for all layers repeat one row; models whose layer types carry
        their own RoPE base (Gemma 3: ``sliding_attention`` / ``full_attention``) get each
        layer's own row, from the rotary module's ``{layer_type}_inv_freq`` buffers.
        """
        model_type = getattr(self.config, "model_type", "?")
        if model_type not in POSITION_INDEPENDENT_TYPES:
            return None, f"model type {model_type!r} has no verified RoPE re-rotation"
        rotary = [module for name, module in self.model.named_modules() if name.endswith("rotary_emb")]
        if len(rotary) != 1:
            return None, f"expected one rotary embedding, found {len(rotary)}"
        module = rotary[0]
        layer_types = list(getattr(self.config, "layer_types", None) or [])
        shared = getattr(module, "inv_freq", None)
        if isinstance(shared, torch.Tensor):
            rows = [shared] * self.layout.layers
            rope_types = [getattr(module, "rope_type", "default")]
        elif len(layer_types) == self.layout.layers and all(
            isinstance(getattr(module, f"{t}_inv_freq", None), torch.Tensor) for t in layer_types
        ):
            rows = [getattr(module, f"{t}_inv_freq") for t in layer_types]
            per_type = getattr(module, "rope_type", {})
            rope_types = [per_type.get(t, "default") for t in layer_types] if isinstance(per_type, dict) else [per_type]
        else:
            return None, "the rotary embedding exposes no frequencies for every layer"
        changing = sorted({str(t) for t in rope_types if t not in _FIXED_FREQUENCY_ROPE})
        if changing:
            return None, f"RoPE type {changing[0]!r} changes frequencies with length"
        if len({row.shape for row in rows}) != 1:
            return None, "layers rotate different numbers of dimensions"
        inv_freq = torch.stack([row.detach().to("cpu", torch.float64) for row in rows])
        if 2 * inv_freq.shape[1] > self.layout.head_dim:
            return None, "rotary dimension exceeds head dimension"
        return inv_freq, ""
