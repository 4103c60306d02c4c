"""The model adapter: the engine's one handle on a transformers model.

The rest of the engine sees K/V as ``[layers, kv_heads, tokens, head_dim]`` tensors and calls
a few things here: one packed pass over several sequences' tokens, each over its own cache
(the engine loop's step: decode rows and slices of prompt work), a forward pass over chosen
tokens at chosen positions on top of a cache, a pass through a range of layers (CacheBlend's
selection, gradual filtering), and key re-rotation. What the model supports is
probed once, at construction (:mod:`kvboost_rag.hf.probes`), and every fallback is named by
:attr:`ModelAdapter.features`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import torch

from kvboost_rag.cache.codec import KVLayout
from kvboost_rag.cache.quant import unquantized_kv_bytes_per_token
from kvboost_rag.errors import UnsupportedModelError
from kvboost_rag.hf.attention_switch import AttentionSwitch
from kvboost_rag.hf.decode_pass import DecodePass
from kvboost_rag.hf.caches import (
    BufferedCache,
    ModelCache,
    cache_keyword,
    cache_tensors,
)
from kvboost_rag.hf.fingerprint import model_fingerprint
from kvboost_rag.hf.layers import DecoderLayers, StopForward
from kvboost_rag.hf.packed import (
    PACKED_ATTENTION,
    PackedCache,
    Segment,
    SegmentOutput,
    logits_index,
    packed_ids,
    packed_layout,
    packed_positions,
    split_outputs,
)
from kvboost_rag.hf.probes import ModelFeatures, probe_features, probe_layout
from kvboost_rag.hf.rope import find_rope
from kvboost_rag.decode_weights.small_rows import SmallRowLinears, choose_kernel
from kvboost_rag.attention_backends.sparse import ATTENTION_NAME, last_query_attention, query_positions
from kvboost_rag.transfer import host_to_device
from kvboost_rag.hf.windows import LayerWindows

logger = logging.getLogger(__name__)

#: Bytes of float32 keys :meth:`ModelAdapter.apply_rotation` rotates at once: its temporaries (a
#: float32 copy of a slice of layers and its rotate-half partner) stay near twice this whatever
#: the prompt length (the keys of a 32k-token prompt of an 8B model are 4 GiB in float32).
ROTATION_SLICE_BYTES = 128 * 2**20


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
        self._cache_keyword = cache_keyword(model)
        self.layout: KVLayout = probe_layout(model, tokenizer, self.device)
        self.windows = LayerWindows.of(self.config)
        self._attention = AttentionSwitch(model)
        self._layers = DecoderLayers(model, self.layout.layers)
        self._inv_freq, self.position_independent_reason = find_rope(model, self.config, self.layout.layers, self.layout.head_dim)
        # Whether every layer rotates with the same frequencies (one angle table serves all).
        self._one_rope = self._inv_freq is not None and bool((self._inv_freq == self._inv_freq[:1]).all())
        #: What this model supports, probed once; each fallback is named there.
        #: The linear layers' kernel in decode and verify steps (:meth:`choose_small_row_kernel`).
        self.small_rows = SmallRowLinears()
        #: Decode-only packed passes outside the model's module stack, where checked equal
        #: (:meth:`choose_small_row_kernel`; ``None``: the model's own pass).
        self.decode_pass: DecodePass | None = None
        self.features: ModelFeatures = probe_features(self)
        if not self.features.batched_decoding:
            logger.warning("%s; concurrent requests decode one sequence per forward pass", self.features.batched_decoding_reason)

    def choose_small_row_kernel(self, setting: str, packed_bytes: int, decode_weights: str = "model") -> None:
        """Choose, and install, the kernel of the linear layers in decode and verify steps
        (:func:`kvboost_rag.decode_weights.small_rows.choose_kernel`; once, at load), and with it the direct
        pass of decode steps (:meth:`~kvboost_rag.hf.decode_pass.DecodePass.checked`). The bytes
        of the weight copy it holds: ``self.small_rows.copy_bytes``."""
        self.decode_pass = None
        self.small_rows.restore()
        self.small_rows = choose_kernel(self.model, setting, packed_bytes, decode_weights)  # type: ignore[arg-type]
        self.decode_pass = DecodePass.checked(self)

    # ----------------------------------------------------------------- properties
    @property
    def position_independent(self) -> bool:
        """Whether cached keys can move to new positions by re-rotation."""
        return self._inv_freq is not None

    @property
    def model_name(self) -> str:
        """The model's name: its folder's name, or the id it was loaded by, or its type."""
        source = str(getattr(self.model.config, "_name_or_path", "") or self.model.config.model_type)
        return Path(source).name if Path(source).is_dir() else source

    @property
    def vocab_width(self) -> int:
        """Width of the model's logits (the output embedding's rows, else the vocabulary size)."""
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        weight = getattr(head, "weight", None)
        if weight is not None:
            return int(weight.shape[0])
        return int(getattr(self.config, "vocab_size", None) or len(self.tokenizer))

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return self.layout.layers

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's K and V over every layer, in the model's dtype."""
        return unquantized_kv_bytes_per_token(self.layout, self.dtype)

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
        ``extra`` settings; see :func:`kvboost_rag.hf.fingerprint.model_fingerprint`."""
        return model_fingerprint(self.model, self.tokenizer, self.dtype, extra)

    # ----------------------------------------------------------------- forward passes
    def decoding_model(self, decode: bool = True) -> torch.nn.Module:
        """What a pass runs: for decode and verify rows (``decode``) the small-row kernels' view
        of the model where one is installed (:attr:`SmallRowLinears.view`), else the model."""
        view = self.small_rows.view if decode else None
        return self.model if view is None else view

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: ModelCache,
        sparse_queries: bool = False,
        logits_to_keep: int = 1,
        decode: bool = False,
    ) -> torch.Tensor:
        """Run ``input_ids`` ``[n]`` at ``position_ids`` ``[n]`` on top of ``cache``.

        Args:
            input_ids: Tokens to run.
            position_ids: Their positions (sorted).
            cache: The cache to attend to and extend.
            sparse_queries: The tokens sit at scattered positions of an armed
                :class:`BufferedCache` that holds every prompt position; attention is made
                causal by position (:mod:`kvboost_rag.attention_backends.sparse`).
            logits_to_keep: Logits of this many last tokens are returned.
            decode: The tokens are a decode or verify row: they run through the small-row
                kernels' view of the model (:meth:`decoding_model`).

        Returns:
            Logits of the last input token, ``[vocab]`` float32; with ``logits_to_keep > 1``,
            ``[logits_to_keep, vocab]``.
        """
        model = self.decoding_model(decode)
        call = dict(
            input_ids=host_to_device(input_ids.view(1, -1), self.device),
            position_ids=host_to_device(position_ids.view(1, -1), self.device),
            **{self._cache_keyword: cache},
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        if not sparse_queries:
            with self._attention.own():
                logits = model(**call).logits
        else:
            with self._attention.use(ATTENTION_NAME), query_positions(position_ids, self.device):
                logits = model(**call).logits
        return logits[0, -1].float() if logits_to_keep == 1 else logits[0, -logits_to_keep:].float()

    @torch.inference_mode()
    def forward_segments(self, segments: Sequence[Segment]) -> list[SegmentOutput]:
        """One forward pass over several segments, each over its own cache
        (:mod:`kvboost_rag.hf.packed`): the running answers' next tokens and slices of prompt
        work in one pass that reads the weights once. A model whose attention the packed pass
        cannot replace (:attr:`ModelFeatures.batched_decoding` false) runs one pass per
        segment instead.

        Args:
            segments: The runs of tokens, in any order.

        Returns:
            Per segment, the logits of its last tokens it asked for and the attention it
            recorded.
        """
        if not self.features.batched_decoding:
            return [self._segment_alone(segment) for segment in segments]
        return self.forward_packed(segments)

    @torch.inference_mode()
    def forward_packed(self, segments: Sequence[Segment]) -> list[SegmentOutput]:
        """:meth:`forward_segments` as one packed pass, whatever the probe found (the probe
        itself calls it): a pass of decode and verify rows only through :attr:`decode_pass`
        where there is one (bitwise the same logits), else :meth:`forward_packed_by_model`."""
        if self.decode_pass is not None and self.decode_pass.takes(segments):
            return self.decode_pass.run(segments)
        return self.forward_packed_by_model(segments)

    @torch.inference_mode()
    def forward_packed_by_model(self, segments: Sequence[Segment]) -> list[SegmentOutput]:
        """The packed pass through the model's own modules. The decode segments go first, so
        their rows lead every layer's input (and the output layer's, all their tokens' logits
        being kept): the small-row kernel
        takes those rows, the prompt work after them reads the model's own weights."""
        order = sorted(range(len(segments)), key=lambda i: not segments[i].decode)
        runs = packed_layout([segments[i] for i in order], self.device)
        index = logits_index(runs)
        decode_rows = sum(len(run.segment) for run in runs if run.segment.decode)
        with self._attention.use(PACKED_ATTENTION), self.small_rows.active(decode_rows):
            out = self.decoding_model(decode_rows > 0)(
                input_ids=host_to_device(packed_ids(runs), self.device),
                position_ids=host_to_device(packed_positions(runs), self.device),
                **{self._cache_keyword: PackedCache(runs)},
                use_cache=True,
                logits_to_keep=index if isinstance(index, int) else host_to_device(index, self.device),
            )
        placed = dict(zip(order, split_outputs(runs, out.logits[0])))
        return [placed[i] for i in range(len(segments))]

    def _segment_alone(self, segment: Segment) -> SegmentOutput:
        """One segment in a pass of its own, through the model's own attention (a segment
        that starts a cache) or the sparse attention (scattered tokens, or tokens after what
        the cache holds)."""
        cache, positions = segment.cache, segment.positions
        held = cache.get_seq_length()
        first, last = int(positions[0]), int(positions[-1])
        appended = first == held and last - first + 1 == len(segment)
        if not appended:
            cache.arm(host_to_device(positions, self.device))
        recording = last_query_attention(segment.record) if segment.record else nullcontext([])
        small_rows = self.small_rows.active() if segment.decode else nullcontext()
        with recording as recorded, small_rows:
            logits = self.forward(
                segment.ids, positions, cache, sparse_queries=not appended or held > 0,
                logits_to_keep=max(1, segment.logits), decode=segment.decode,
            )
        rows = None if not segment.logits else logits.view(-1, logits.shape[-1])
        depth = segment.record_layers
        return SegmentOutput(rows, list(recorded if depth is None else recorded[:depth]))

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
        with self._layers.only(first_layer, self.num_layers - 1, hidden):
            return self.forward(input_ids, position_ids, cache, sparse_queries=True)

    @torch.inference_mode()
    def hidden_through_layers(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: ModelCache,
        first_layer: int,
        last_layer: int,
        hidden: torch.Tensor | None,
        sparse_queries: bool = True,
    ) -> torch.Tensor:
        """Run decoder layers ``first_layer..last_layer`` only, from ``hidden`` (the output of
        the layer before; ``None`` with ``first_layer=0``), filling ``cache`` for them; the
        final norm and the logits are not computed. From the first layer the model's layers
        stay as they are (the pass stops after ``last_layer``).

        Args:
            sparse_queries: As in :meth:`forward`: attention causal by position over a cache
                that holds every position up to the queries' (an armed cache, or one holding
                exactly the positions before them); ``False``: the model's own causal
                attention over whatever the cache holds.

        Returns:
            ``[1, tokens, hidden]`` hidden states after layer ``last_layer``.
        """
        from_the_start = first_layer == 0 and hidden is None  # stopping after ``last_layer`` is enough
        layers = nullcontext() if from_the_start else self._layers.only(first_layer, last_layer, hidden)
        with self._layers.stop_after(last_layer) as captured, layers:
            try:
                self.forward(input_ids, position_ids, cache, sparse_queries=sparse_queries)
            except StopForward:
                pass
        return captured[0]

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
    def cache_tensors(cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]:
        """A cache's K/V as ``[layers, heads, tokens, dim]`` (a view when it still lives in the
        buffers it was built over; callers that keep it must clone it)."""
        return cache_tensors(cache)

    # ----------------------------------------------------------------- RoPE
    def rotation(
        self, delta: torch.Tensor | Sequence[int] | int, first_layer: int = 0, layers: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosines and sines that move keys by ``delta`` positions, on the model's device.

        Angles are computed on the host in float64 (positions times frequencies lose
        precision in float32) for each distinct delta only; the tables go to the device in one
        asynchronous copy each.

        Args:
            delta: ``[deltas]`` position shifts (new position minus the position the keys were
                computed at), or one int.
            first_layer: Model layer of the first row of keys these tables rotate.
            layers: Layers rotated (default: all from ``first_layer``).

        Returns:
            ``(cos, sin)``, each ``[1 or layers, deltas, rotary_dim / 2]`` float32: one row for
            all layers when every layer rotates with the same frequencies.

        Raises:
            UnsupportedModelError: The model's keys cannot be re-rotated.
        """
        if self._inv_freq is None:
            raise UnsupportedModelError(f"keys cannot be re-rotated: {self.position_independent_reason}")
        delta_t = torch.as_tensor(delta, dtype=torch.float64).view(-1)
        if self._one_rope:
            frequencies = self._inv_freq[:1]  # [1, half]: one table for all layers
        else:
            count = layers if layers is not None else self.num_layers - first_layer
            frequencies = self._inv_freq[first_layer : first_layer + count]  # [layers, half]
        angles = delta_t.view(1, -1, 1) * frequencies.unsqueeze(1)  # [1 or layers, deltas, half]
        return host_to_device(angles.cos().float(), self.device), host_to_device(angles.sin().float(), self.device)

    @staticmethod
    def apply_rotation(
        keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rotate ``keys`` ``[layers, heads, tokens, head_dim]`` by per-token tables
        ``[1 or layers, tokens or 1, half]`` (from :meth:`rotation`): the rotation in float32
        (multiply, then add: no fused multiply-add), 16-bit keys rounded once, dimensions past
        the rotary ones copied as they are. A slice of layers at a time
        (:data:`ROTATION_SLICE_BYTES`), so the float32 temporaries stay bounded on long prompts.

        Args:
            keys: The keys.
            cos: Cosines.
            sin: Sines.
            out: Where to write (same shape; may be ``keys`` itself, rotated in place, or a view
                of a larger tensor); a new tensor when omitted.
        """
        half = cos.shape[-1]
        dst = out if out is not None else torch.empty_like(keys)
        if 2 * half < keys.shape[-1] and dst is not keys:
            dst[..., 2 * half :] = keys[..., 2 * half :]
        # The rotate-half form x cos + rotate_half(x) sin, [x1, x2] -> [x1 cos + (-x2) sin,
        # x2 cos + x1 sin], one half at a time: x1 cos - x2 sin rounds exactly as x1 cos + (-x2) sin.
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1 or layers, 1, tokens or 1, half]
        layers, heads, tokens, _ = keys.shape
        step = max(1, ROTATION_SLICE_BYTES // (heads * tokens * 2 * half * 4))
        for first in range(0, layers, step):
            rows = slice(first, first + step)
            source, target = keys[rows, ..., : 2 * half], dst[rows, ..., : 2 * half]  # [step, H, tokens, 2 half]
            c, s = (cos, sin) if cos.shape[0] == 1 else (cos[rows], sin[rows])
            x = source.float()  # float32 keys: ``source`` itself
            in_place = x is source and dst is keys
            if x is source and not in_place:
                x = x.clone()  # float32 keys rotated into another tensor: the source stays as it was
            x1, x2 = x[..., :half], x[..., half:]  # [step, H, tokens, half] views
            x2_sin, x1_sin = x2 * s, x1 * s
            x1.mul_(c).sub_(x2_sin)
            x2.mul_(c).add_(x1_sin)
            if not in_place:
                target.copy_(x)
        return dst

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
        if isinstance(delta, int) and delta == 0:  # checked on the host: no device read
            dst = out if out is not None else torch.empty_like(keys)
            if dst is not keys:
                dst.copy_(keys)
            return dst
        cos, sin = self.rotation(delta, first_layer, keys.shape[0])
        return self.apply_rotation(keys, cos, sin, out)
