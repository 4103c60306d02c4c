"""Module paths of earlier releases, still importable.

The engine's modules moved into one package per stage (``kvboost_rag/README.md`` maps them).
Code written against an earlier path (``from kvboost_rag.attention import use_backend``,
``import kvboost_rag.storage``) keeps working: a finder on ``sys.meta_path`` answers each old
name with the module at its new path (the same module object) and warns once per name with a
``DeprecationWarning`` naming the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import warnings
from types import ModuleType

#: Old module path (under ``kvboost_rag.``) -> where it lives now.
MOVED: dict[str, str] = {
    "hf.sparse_attention": "attention_backends.sparse",
    "hf.ragged_attention": "attention_backends.ragged",
    "hf.row_rounding": "attention_backends.row_rounding",
    "hf.transfer": "transfer",
    "cache.arena": "host_memory.arena",
    "cache.held_views": "host_memory.held_views",
    "hf.small_rows": "decode_weights.small_rows",
    "hf.int8_rows": "decode_weights.int8_rows",
    "hf.four_bit_groups": "decode_weights.four_bit_groups",
    "hf.int8_siblings": "decode_weights.int8_siblings",
    "hf.stored_int8": "decode_weights.stored_int8",
    "hf.resident": "decode_weights.resident",
    "async_stream": "integration.async_stream",
    "attention": "attention_backends.sparse",
    "background_warmer": "warming.background",
    "batch_decode": "decode.step",
    "blend": "repair.selection",
    "cache_manager": "cache.manager",
    "chat": "request.chat",
    "closing": "decode.closing",
    "constrained": "decode.constrained",
    "corpus_fit": "warming.fit",
    "correctness": "diagnosis.correctness",
    "document_shelf": "cache.document_records",
    "dropin": "integration.dropin",
    "engine_registry": "integration.engine_registry",
    "environment": "dev.environment",
    "fingerprint": "hf.fingerprint",
    "hashing": "request.hashing",
    "inputs": "request.inputs",
    "kv_codec": "cache.codec",
    "lifecycle": "generation.lifecycle",
    "missed_documents": "generation.missed_documents",
    "options": "request.options",
    "outcome": "prefill.outcome",
    "parts": "generation.parts",
    "plan": "request.plan",
    "prefix_index": "cache.prefix_index",
    "pytest_ci": "dev.pytest_ci",
    "pytest_isolation": "dev.pytest_isolation",
    "pytest_uninitialized": "dev.pytest_uninitialized",
    "quant": "cache.quant",
    "ragged": "attention_backends.ragged",
    "react": "decode.react",
    "redis_local": "dev.redis_local",
    "sampling": "decode.sampling",
    "scheduler": "engine_loop.loop",
    "segments": "request.documents",
    "stage_times": "diagnosis.stage_times",
    "stitch": "prefill.stitch",
    "storage": "cache.storage",
    "storage.base": "cache.storage.base",
    "storage.device": "cache.storage.device",
    "storage.disk": "cache.storage.disk",
    "storage.memory": "cache.storage.memory",
    "storage.policy": "cache.storage.policy",
    "storage.redis_connect": "cache.storage.redis_connect",
    "storage.redis_layout": "cache.storage.redis_layout",
    "storage.redis_tier": "cache.storage.redis_tier",
    "storage.serialization": "cache.storage.serialization",
    "storage.tiered": "cache.storage.tiered",
    "testing": "dev.testing",
    "text": "request.text",
    "tool_calls": "decode.tool_calls",
    "warming.job": "warm_job",
    "warming.job.report": "warm_job.report",
    "warming.job.runner": "warm_job.runner",
    "warming.job.sources": "warm_job.sources",
    "warming.job.worker": "warm_job.worker",
}

_warned: set[str] = set()
_own_specs: dict[str, importlib.machinery.ModuleSpec] = {}
_lock = threading.Lock()


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``kvboost_rag.<old path>`` with the module at its new path."""

    def find_spec(self, fullname: str, path=None, target=None):  # noqa: ANN001 - finder protocol
        old = fullname.removeprefix("kvboost_rag.")
        if old == fullname or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> ModuleType:  # noqa: ANN001 - loader protocol
        new = "kvboost_rag." + MOVED[spec.name.removeprefix("kvboost_rag.")]
        with _lock:
            first = spec.name not in _warned
            _warned.add(spec.name)
        if first:
            warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=3)
        module = importlib.import_module(new)
        with _lock:
            _own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is the one at the new path, already imported. The import
        system has just set its ``__spec__`` to the old name's: its own is put back."""
        with _lock:
            own = _own_specs.pop(module.__spec__.name, None)
        if own is not None:
            module.__spec__ = own


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())  # before the path finder: an old folder left behind loses
