"""Entries are untrusted input: every malformed entry decodes to CorruptEntryError (a miss that
deletes it), never to another exception or to K/V that poisons generation."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from kvboost_rag.cache.codec import (
    MAX_ABS_KV,
    CorruptEntryError,
    KVBlock,
    decode_block,
    encode_block,
)
from kvboost_rag.cache.storage import (
    DiskTier,
    StoredEntry,
    deserialize_entry,
    serialize_entry,
)
from kvboost_rag.cache.storage.disk import SUFFIX

LAYOUT = (2, 2, 8)


def _entry(bits: int | None = None, tokens: int = 6) -> StoredEntry:
    gen = torch.Generator().manual_seed(tokens)
    shape = (*LAYOUT[:2], tokens, LAYOUT[2])
    block = KVBlock(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), torch.arange(tokens), 3)
    return encode_block(block, fingerprint="fp", bits=bits, group_size=8)


def _decode(entry: StoredEntry) -> KVBlock:
    return decode_block(entry, fingerprint="fp", expected_layout=LAYOUT)


def _with_meta(entry: StoredEntry, **changes: str | None) -> StoredEntry:
    meta = dict(entry.metadata)
    for name, value in changes.items():
        if value is None:
            meta.pop(name, None)
        else:
            meta[name] = value
    return StoredEntry(dict(entry.tensors), meta)


def _with_tensor(entry: StoredEntry, name: str, tensor: torch.Tensor | None) -> StoredEntry:
    tensors = dict(entry.tensors)
    if tensor is None:
        tensors.pop(name)
    else:
        tensors[name] = tensor
    return StoredEntry(tensors, dict(entry.metadata))


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_well_formed_entries_still_decode(bits):
    block = _decode(_entry(bits))
    assert block.keys.shape == (2, 2, 6, 8) and block.start_position == 3


BAD_METADATA = [
    {"dtype": "load"},
    {"dtype": "Tensor"},
    {"dtype": "float64"},
    {"dtype": "int8"},
    {"dtype": "__class__"},
    {"dtype": None},
    {"format": "2"},
    {"format": None},
    {"bits": "3"},
    {"bits": "-8"},
    {"bits": "8"},  # raw tensors, but claims quantized
    {"bits": "x"},
    {"shape": "2,2,6"},
    {"shape": "2,2,-6,8"},
    {"shape": "2,2,6,8,1"},
    {"shape": "2, 2, 6, 8"},
    {"shape": "2,2,٦,8"},  # a non-ASCII digit int() would accept
    {"shape": "2,2,99999999999999999999,8"},
    {"shape": ""},
    {"start_position": "-1"},
    {"start_position": "1e3"},
    {"start_position": "+3"},
    {"start_position": "99999999999999999999"},
    {"start_position": None},
    {"group_size": "8"},  # group size on an unquantized entry
    {"unexpected": "field"},
]


@pytest.mark.parametrize("changes", BAD_METADATA, ids=lambda c: repr(c))
def test_crafted_metadata_is_a_corrupt_entry(changes):
    with pytest.raises(CorruptEntryError):
        _decode(_with_meta(_entry(), **changes))


@pytest.mark.parametrize(
    "changes",
    [
        {"group_size": "0"},
        {"group_size": "-8"},
        {"group_size": "99999999"},
        {"group_size": None},
        {"bits": "4"},
        {"dtype": "bool"},
    ],
    ids=lambda c: repr(c),
)
def test_crafted_quantized_metadata_is_a_corrupt_entry(changes):
    with pytest.raises(CorruptEntryError):
        _decode(_with_meta(_entry(bits=8), **changes))


def _raw_tensor_cases():
    good = _entry()
    keys = good.tensors["keys"]
    return {
        "keys-nan": ("keys", keys.clone().index_fill_(2, torch.tensor([1]), float("nan"))),
        "values-inf": ("values", good.tensors["values"].clone().fill_(float("inf"))),
        "keys-huge": ("keys", keys.clone().mul_(1e30)),
        "values-just-over-limit": ("values", torch.full_like(keys, MAX_ABS_KV * 1.01)),
        "keys-int": ("keys", keys.to(torch.int64)),
        "keys-float64": ("keys", keys.double()),
        "keys-bf16-not-header-dtype": ("keys", keys.bfloat16()),
        "keys-wrong-shape": ("keys", keys[:, :, :5]),
        "keys-transposed": ("keys", keys.transpose(2, 3).contiguous()),
        "values-missing": ("values", None),
        "token-ids-float": ("token_ids", torch.arange(6).float()),
        "token-ids-2d": ("token_ids", torch.arange(6).view(2, 3)),
        "token-ids-short": ("token_ids", torch.arange(5)),
        "token-ids-negative": ("token_ids", torch.tensor([0, 1, -2, 3, 4, 5])),
        "extra-tensor": ("extra", torch.zeros(3)),
    }


@pytest.mark.parametrize("case", list(_raw_tensor_cases()))
def test_crafted_tensors_are_a_corrupt_entry(case):
    name, tensor = _raw_tensor_cases()[case]
    with pytest.raises(CorruptEntryError):
        _decode(_with_tensor(_entry(), name, tensor))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("case", ["scale-nan", "scale-huge", "zero-inf", "codes-int64", "codes-short", "scale-int", "missing"])
def test_crafted_quantized_tensors_are_a_corrupt_entry(bits, case):
    entry = _entry(bits=bits)
    t = entry.tensors
    name, tensor = {
        "scale-nan": ("key_scale", torch.full_like(t["key_scale"], float("nan"))),
        "scale-huge": ("value_scale", torch.full_like(t["value_scale"].float(), 1e30)),
        "zero-inf": ("key_zero", torch.full_like(t["key_zero"].float(), float("inf"))),
        "codes-int64": ("key_codes", t["key_codes"].to(torch.int64)),
        "codes-short": ("value_codes", t["value_codes"][:-1]),
        "scale-int": ("key_scale", t["key_scale"].to(torch.int32)),
        "missing": ("value_zero", None),
    }[case]
    with pytest.raises(CorruptEntryError):
        _decode(_with_tensor(entry, name, tensor))


def test_random_metadata_mutations_raise_only_corrupt_entry_errors():
    rng = random.Random(0)
    alphabet = ["", "0", "1", "-1", "8", "4", "2,2,6,8", "float32", "bfloat16", "nan", "1e9", ",", "x" * 50, "\x00"]
    for bits in (None, 8, 4):
        good = _entry(bits)
        for _ in range(150):
            changes = {name: rng.choice(alphabet) for name in rng.sample(sorted(good.metadata), rng.randint(1, 3))}
            changes.pop("fingerprint", None)
            try:
                _decode(_with_meta(good, **changes))
            except CorruptEntryError:
                pass


def test_a_corrupt_entry_error_is_a_value_error():
    assert issubclass(CorruptEntryError, ValueError)


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_entries_are_dequantized_on_the_target_device(monkeypatch, bits):
    from kvboost_rag.cache import quant

    seen: list[torch.device] = []
    dequantize = quant.dequantize_kv

    def spy(tensors, *args, **kwargs):
        seen.extend(t.device for t in tensors.values())
        return dequantize(tensors, *args, **kwargs)

    monkeypatch.setattr(quant, "dequantize_kv", spy)
    block = decode_block(_entry(bits), fingerprint="fp", expected_layout=LAYOUT, device="cuda")
    assert block.keys.is_cuda and seen and all(d.type == "cuda" for d in seen)


# -- through the engine ----------------------------------------------------------------------


def _prompt(docs: list[str]) -> str:
    return "You are a careful assistant.\n\n" + "\n\n".join(docs) + "\n\nQuestion: What does it say?\nAnswer:"


def _craft_bad_dtype(entry: StoredEntry) -> StoredEntry:
    return _with_meta(entry, dtype="load")


def _craft_nan(entry: StoredEntry) -> StoredEntry:
    return _with_tensor(entry, "values", torch.full_like(entry.tensors["values"], float("nan")))


def _craft_huge(entry: StoredEntry) -> StoredEntry:
    return _with_tensor(entry, "keys", entry.tensors["keys"] * 1e30)


def _craft_wrong_shape(entry: StoredEntry) -> StoredEntry:
    return _with_tensor(entry, "keys", entry.tensors["keys"][:, :, 1:])


@pytest.mark.parametrize("craft", [_craft_bad_dtype, _craft_nan, _craft_huge, _craft_wrong_shape], ids=lambda f: f.__name__[7:])
def test_engine_drops_crafted_entries_and_answers_like_full_prefill(make_engine, docs, tmp_path, craft, caplog):
    warm = make_engine(disk_cache_dir=tmp_path)
    warm.warm_documents(docs[:3])
    prompt = _prompt(docs[:3])
    warm.generate(prompt, max_new_tokens=4)  # prefix chunks too
    assert warm.flush(timeout=60)  # its files written before they are read below
    crafted: dict[str, bytes] = {}
    for path in tmp_path.glob(f"*{SUFFIX}"):
        key = path.name[: -len(SUFFIX)]
        entry = deserialize_entry(path.read_bytes(), expected_key=key)
        if entry.metadata.get("kind") == "document":
            continue  # document records: tests/test_document_persistence.py
        crafted[key] = serialize_entry(craft(entry), key=key)  # valid checksum, crafted contents
        path.write_bytes(crafted[key])
    assert len(crafted) > 3

    fresh = make_engine(disk_cache_dir=tmp_path)
    fresh.warm_documents(docs[:3])
    with caplog.at_level(logging.WARNING):
        result = fresh.generate(prompt, max_new_tokens=6)
    baseline = fresh.generate(prompt, max_new_tokens=6, reuse=False)
    assert result.token_ids == baseline.token_ids
    assert result.content_hit_tokens == 0 and result.prefix_hit_tokens == 0
    assert fresh.cache_stats().counters.get("corrupt_entries", 0) > 0
    # The crafted entries the prompt read are gone, replaced by what this engine computed.
    replaced = [key for key, data in crafted.items() if (tmp_path / f"{key}{SUFFIX}").read_bytes() != data]
    assert len(replaced) >= fresh.cache_stats().counters["corrupt_entries"]
    disk = DiskTier(tmp_path, max_bytes=10**9)
    for key in replaced:
        decode_block(disk.get(key), fingerprint=fresh.fingerprint, expected_layout=(3, 2, 16))
    again = fresh.generate(prompt, max_new_tokens=6)
    assert again.token_ids == baseline.token_ids and again.content_hit_tokens > 0
