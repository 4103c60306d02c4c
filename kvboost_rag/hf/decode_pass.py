"""Decode-only packed passes run layer by layer, outside transformers' module stack.

A decode step on a CPU is a few rows through every layer: its products read the weights once
and take most of the time, but each layer also goes through the model's module calls, the
cache's and the attention interface's dispatch and the linear layers' routing, about a
millisecond a layer of Python and small calls. When every segment of a packed pass
(:mod:`kvboost_rag.hf.packed`) is a decode or verify row, :class:`DecodePass` runs the same
operations in the same order without that stack: the embedding and the rotary tables through
the model's own modules, then per layer the model's own norms, its query, key and value
products in one call where they are fused (:mod:`kvboost_rag.decode_weights.int8_siblings`), its own
rotary function, the packed pass's K/V writes and attention (:func:`~kvboost_rag.hf.packed.write_runs`,
:func:`~kvboost_rag.hf.packed.attend_runs`), the output product, the MLP, and the output layer
on the rows whose logits are wanted. Each linear layer runs the product the small-row kernel
gives it for that many rows (:mod:`kvboost_rag.decode_weights.small_rows`), as its routed ``forward`` would.

Measured on a 2-core Intel Xeon, 2 threads, answers of 13-96 tokens to 2.0-2.6k-token chat RAG
prompts without drafts, the same engine with and without this pass interleaved in one process:
Qwen2.5-Coder 0.5B at its int8 default 1.19x faster per token (median of 6 prompts, 1.01-1.24x),
the embedded SmolLM2-135M on its own float32 weights 1.07x (0.93-1.13x: its products take more of
the step), the same tokens on 6 of 6 prompts each.

It serves only the decoder layers of the Llama form (:data:`FAMILIES`: a norm, attention with
query, key, value and output projections, a norm, a gated MLP; Qwen3's norms of the query and
key heads included; Gemma's norms and scaled embedding are its modules'), on a CPU, with no hooks on the model, and only after a check at load
(:meth:`DecodePass.checked`) found bitwise the same logits and K/V as the model's own packed pass
for a one-token row beside a verify row of several tokens; anything else keeps the model's
pass. So a row's tokens do not depend on which of the two ran its step.
"""

from __future__ import annotations

import logging
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.nn.modules import module as torch_module

from kvboost_rag.attention_backends.spec import AttentionSpec
from kvboost_rag.hf.caches import BufferedCache, BufferedLayer, cache_tensors, truncate_cache
from kvboost_rag.decode_weights.int8_siblings import SiblingProduct
from kvboost_rag.hf.packed import (
    Segment,
    SegmentOutput,
    Run,
    attend_runs,
    logits_index,
    packed_ids,
    packed_layout,
    packed_positions,
    split_outputs,
    write_runs,
)
from kvboost_rag.decode_weights.small_rows import MAX_ROWS, SmallRowLinears, kernel_takes



class CheckedModel(Protocol):
    """What the pass reads of the model boundary (a
    :class:`~kvboost_rag.hf.adapter.ModelAdapter`) to build itself and check it against the
    model's own packed pass."""

    model: torch.nn.Module
    small_rows: SmallRowLinears
    features: Any

    @property
    def vocab_width(self) -> int: ...

    def forward_packed_by_model(self, segments: Sequence[Segment]) -> list[SegmentOutput]: ...

    def buffers(self, capacity: int, layers: int | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def cache_over(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> BufferedCache: ...


logger = logging.getLogger(__name__)

#: ``model_type`` of the models whose decoder layer has the Llama form this pass follows.
FAMILIES = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma"})
Product = Callable[[torch.Tensor], torch.Tensor]


class LinearProduct:
    """One linear layer's product in a decode step: its routed product where the routed
    ``forward`` would run it for the step's rows (:func:`~kvboost_rag.decode_weights.small_rows.kernel_takes`),
    else ``F.linear`` over its own weights.

    Args:
        module: The layer.
        route: Its product and the fewest rows that take it
            (:meth:`~kvboost_rag.decode_weights.small_rows.SmallRowLinears.routes`); ``None``: not routed.
    """

    def __init__(self, module: torch.nn.Linear, route: tuple[Product, int] | None) -> None:
        self.module = module
        self.kernel, self.min_rows = route if route is not None else (None, 1)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the routed product takes ``x``."""
        return self.kernel is not None and kernel_takes(x, x.numel() // self.module.in_features, self.min_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes(x):
            return self.kernel(x)  # type: ignore[misc]
        return F.linear(x, self.module.weight, self.module.bias)


class ProductGroup:
    """Layers that read one input (query, key, value; gate, up): one call of their fused
    product where the kernel takes the rows, else each layer's own product.

    Args:
        members: Each layer's product, in the group's order.
    """

    def __init__(self, members: Sequence[LinearProduct]) -> None:
        self.members = list(members)
        kernels = [member.kernel for member in self.members]
        shared = {id(k.shared) for k in kernels if isinstance(k, SiblingProduct)}
        fused = len(shared) == 1 and all(isinstance(k, SiblingProduct) and k.index == i for i, k in enumerate(kernels))
        self.fused = kernels[0].shared if fused else None  # type: ignore[union-attr]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.fused is not None and self.members[0].takes(x):
            return self.fused.outputs(x)
        return [member(x) for member in self.members]


@dataclass
class DecoderParts:
    """What one decoder layer's decode step calls."""

    input_norm: Product
    query_key_value: ProductGroup
    query_norm: Product | None
    key_norm: Product | None
    rotate: Callable
    output: LinearProduct
    post_norm: Product
    gate_up: ProductGroup
    activation: Product
    down: LinearProduct
    head_dim: int
    attention: AttentionSpec


def _products(small_rows: SmallRowLinears) -> Callable[[torch.nn.Linear], LinearProduct]:
    routes = small_rows.routes()
    return lambda module: LinearProduct(module, routes.get(module))


def _layer_parts(layer: torch.nn.Module, product: Callable[[torch.nn.Linear], LinearProduct]) -> DecoderParts:
    attention, mlp = layer.self_attn, layer.mlp
    rotate = getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb")
    window = getattr(attention, "sliding_window", getattr(attention.config, "sliding_window", None))
    query_norm, key_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    return DecoderParts(
        input_norm=layer.input_layernorm.forward,
        query_key_value=ProductGroup([product(attention.q_proj), product(attention.k_proj), product(attention.v_proj)]),
        query_norm=None if query_norm is None else query_norm.forward,
        key_norm=None if key_norm is None else key_norm.forward,
        rotate=rotate,
        output=product(attention.o_proj),
        post_norm=layer.post_attention_layernorm.forward,
        gate_up=ProductGroup([product(mlp.gate_proj), product(mlp.up_proj)]),
        activation=mlp.act_fn,
        down=product(mlp.down_proj),
        head_dim=int(attention.head_dim),
        attention=AttentionSpec(float(attention.scaling), window or None),
    )


_HOOKS = operator.attrgetter("_forward_hooks", "_forward_pre_hooks")


def hooked(modules: Sequence[torch.nn.Module]) -> bool:
    """Whether a forward hook would run on a call of any of ``modules``: one of their own, or a
    global one (``torch.nn.modules.module.register_module_forward_hook``)."""
    if getattr(torch_module, "_global_forward_hooks", None) or getattr(torch_module, "_global_forward_pre_hooks", None):
        return True
    return any(own or pre for own, pre in map(_HOOKS, modules))


def unsupported_reason(model: torch.nn.Module) -> str:
    """Why :class:`DecodePass` cannot follow ``model``'s layers (``""``: it can, pending the
    check at load)."""
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "model_type", "") not in FAMILIES:
        return f"model type {getattr(config, 'model_type', '')!r} is not of the Llama form"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, name) for name in needed) or not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        return "the model lacks the modules of the Llama form"
    modules = list(model.modules())
    if hooked(modules) or any(hasattr(module, "_hf_hook") for module in modules):
        return "the model has forward hooks"
    if any(getattr(layer.mlp, "act_fn", None) is None or not hasattr(layer.self_attn, "o_proj") for layer in inner.layers):
        return "a decoder layer lacks the modules of the Llama form"
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        return "the model caps its logits"
    if next(model.parameters()).device.type != "cpu":
        return "the model is not on the CPU"
    return ""


class DecodePass:
    """A decode-only packed pass without transformers' module stack (see the module's doc).

    Args:
        model: A model of the Llama form (:func:`unsupported_reason` empty).
        small_rows: The small-row kernel chosen for it.
    """

    def __init__(self, model: torch.nn.Module, small_rows: SmallRowLinears) -> None:
        inner = model.model
        product = _products(small_rows)
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.layers = [_layer_parts(layer, product) for layer in inner.layers]
        self.final_norm = inner.norm.forward
        self.head = product(model.lm_head)
        #: Every module of the model, whose forward hooks would be skipped (:meth:`takes`).
        self.modules = list(model.modules())

    def takes(self, segments: Sequence[Segment]) -> bool:
        """Whether this pass runs ``segments``: decode and verify rows only, at most
        :data:`~kvboost_rag.decode_weights.small_rows.MAX_ROWS` tokens, while no forward hook would run on
        the model (one registered after load sends the steps back through its modules, which
        call it; the check took 61 us a step over Qwen2.5 0.5B's 319 modules)."""
        if not all(segment.decode for segment in segments) or sum(len(segment) for segment in segments) > MAX_ROWS:
            return False
        return not hooked(self.modules)

    @torch.inference_mode()
    def run(self, segments: Sequence[Segment]) -> list[SegmentOutput]:
        """The packed pass over ``segments`` (:meth:`takes`), as
        :meth:`~kvboost_rag.hf.adapter.ModelAdapter.forward_packed` returns it."""
        device = self.embed.weight.device
        runs = packed_layout(segments, device)
        index = logits_index(runs)
        hidden = self.embed(packed_ids(runs).to(device))
        cos, sin = self.rotary(hidden, packed_positions(runs).to(device))
        cache_layers = [[run.segment.cache.layers[i] for run in runs] for i in range(len(self.layers))]
        for i, parts in enumerate(self.layers):
            hidden = hidden + self._attention(i, parts, hidden, cos, sin, runs, cache_layers[i])
            gate, up = parts.gate_up(parts.post_norm(hidden))
            hidden = hidden + parts.down(parts.activation(gate) * up)
        hidden = self.final_norm(hidden)
        logits = self.head(hidden[:, -index:] if isinstance(index, int) else hidden[:, index.to(device)])
        return split_outputs(runs, logits[0])

    @staticmethod
    def _attention(
        i: int,
        parts: DecoderParts,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        runs: Sequence[Run],
        cache_layers: Sequence[BufferedLayer],
    ) -> torch.Tensor:
        """Layer ``i``'s attention block: norm, projections, rotation, K/V writes, attention
        of each run over its own K/V, output product."""
        tokens = hidden.shape[1]
        shape = (1, tokens, -1, parts.head_dim)
        query, key, value = (part.view(shape) for part in parts.query_key_value(parts.input_norm(hidden)))
        if parts.query_norm is not None:
            query, key = parts.query_norm(query), parts.key_norm(key)  # type: ignore[misc]
        query, key = parts.rotate(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        keys, values = write_runs(runs, cache_layers, key, value.transpose(1, 2))
        out = attend_runs(i, query, keys, values, runs, parts.attention)
        return parts.output(out.transpose(1, 2).reshape(1, tokens, -1))

    @classmethod
    def checked(cls, adapter: CheckedModel) -> DecodePass | None:
        """A pass for ``adapter``'s model, if it applies and gives bitwise the logits of the
        model's own packed pass (:func:`_same_logits`); else ``None`` (logged)."""
        reason = unsupported_reason(adapter.model) or ("" if adapter.features.batched_decoding else "no batched decoding")
        if reason:
            logger.info("decode steps run through the model's modules: %s", reason)
            return None
        try:
            decode_pass = cls(adapter.model, adapter.small_rows)
            same = _same_logits(adapter, decode_pass)
        except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
            logger.info("decode steps run through the model's modules: the direct pass failed (%s)", exc)
            return None
        if not same:
            logger.info("decode steps run through the model's modules: the direct pass's logits differ from the model's")
            return None
        return decode_pass


#: Tokens the check's two caches hold: a one-token row's and a verify row's. Both passes call the
#: same attention (:func:`~kvboost_rag.hf.packed.attend_runs`) over the same K/V, so what the
#: check compares is everything around it, which neither the cache's length nor its values
#: change: random K/V stand for a prompt, and the check costs two one-row passes at load, not a
#: prefill (on Qwen2.5 0.5B's float32 weights 12 tokens' prefill took 270 ms, a step 80-100 ms).
CHECK_CACHE_TOKENS = (5, 12)


@torch.inference_mode()
def _same_logits(adapter: CheckedModel, decode_pass: DecodePass) -> bool:
    """Whether ``decode_pass`` gives bitwise the model's packed pass's logits and K/V for a step
    of a one-token row over a short cache beside a 3-token verify row over a longer one."""
    generator = torch.Generator().manual_seed(0)
    vocab = min(adapter.vocab_width, int(adapter.model.get_input_embeddings().weight.shape[0]))
    short_length, long_length = CHECK_CACHE_TOKENS
    ids = torch.randint(vocab, (4,), generator=generator)
    short, long = (_random_cache(adapter, length, generator) for length in CHECK_CACHE_TOKENS)
    row = Segment(ids[:1], torch.tensor([short_length]), short, logits=1, decode=True)
    verify = Segment(ids[1:], torch.arange(long_length, long_length + 3), long, logits=3, decode=True)
    expected = _logits_and_kv(adapter.forward_packed_by_model, [row, verify])
    got = _logits_and_kv(decode_pass.run, [row, verify])
    return all(torch.equal(a, b) for a, b in zip(expected, got))


def _random_cache(adapter: CheckedModel, length: int, generator: torch.Generator) -> BufferedCache:
    """A cache of ``length`` tokens of random K/V, with room for 3 more."""
    keys, values = adapter.buffers(length + 3)
    keys.copy_(torch.randn(keys.shape, generator=generator))
    values.copy_(torch.randn(values.shape, generator=generator))
    return adapter.cache_over(keys, values, length)


def _logits_and_kv(run: Callable[[Sequence[Segment]], list[SegmentOutput]], segments: Sequence[Segment]) -> list[torch.Tensor]:
    """The logits ``run`` gives ``segments`` and the K/V it writes, the caches truncated back after."""
    lengths = [segment.cache.get_seq_length() for segment in segments]
    outputs = run(segments)
    written = []
    for segment, length in zip(segments, lengths):
        keys, values = cache_tensors(segment.cache)
        written += [keys[:, :, length:].clone(), values[:, :, length:].clone()]
        truncate_cache(segment.cache, length)
    return [output.logits for output in outputs] + written
