"""The disk tier reads regular files only: no links, FIFOs or devices; bounded reads; no file
content in logs; a cache folder that is a file is a clear error."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from kvboost_rag.cache.storage import DiskTier, StoredEntry, build_store
from kvboost_rag.cache.storage.disk import SUFFIX
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.errors import InvalidInputError

pytestmark = pytest.mark.skipif(os.name != "posix", reason="FIFOs and symlinks as POSIX has them")


def _entry() -> StoredEntry:
    return StoredEntry(tensors={"keys": torch.ones(2, 2, 4, 8)}, metadata={"tag": "x"})


def _get_with_timeout(tier: DiskTier, key: str, seconds: float = 5.0):
    """``tier.get(key)`` in a daemon thread, so a regression fails instead of hanging."""
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["value"] = tier.get(key)
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"get({key!r}) still blocked after {seconds} s"
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]


def test_fifo_named_like_an_entry_is_a_miss_and_does_not_block(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=10**6)
    os.mkfifo(tmp_path / f"aa{SUFFIX}")
    assert "aa" not in tier
    assert _get_with_timeout(tier, "aa") is None
    assert not (tmp_path / f"aa{SUFFIX}").exists()  # the impostor is removed
    tier.put("aa", _entry())
    assert tier.get("aa") is not None


def test_symlink_to_dev_zero_is_a_miss(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=10**6)
    link = tmp_path / f"aa{SUFFIX}"
    link.symlink_to("/dev/zero")
    assert "aa" not in tier
    assert _get_with_timeout(tier, "aa") is None
    assert not os.path.lexists(link)
    assert os.path.exists("/dev/zero")


def test_symlink_to_a_text_file_is_not_read_nor_logged(tmp_path, caplog):
    secret = tmp_path / "outside.txt"
    secret.write_text("root:x:0:0:SECRET-CONTENT:/root:/bin/bash\n" * 4)
    cache = tmp_path / "cache"
    tier = DiskTier(cache, max_bytes=10**6)
    link = cache / f"aa{SUFFIX}"
    link.symlink_to(secret)
    with caplog.at_level(logging.DEBUG, logger="kvboost_rag"):
        assert "aa" not in tier
        assert _get_with_timeout(tier, "aa") is None
    assert "root" not in caplog.text and "SECRET" not in caplog.text
    assert not os.path.lexists(link)
    assert secret.read_text().startswith("root:")  # the target is untouched
    assert list(tier.keys()) == [] and tier.used_bytes == 0


def test_regular_file_with_garbage_logs_no_content(tmp_path, caplog):
    tier = DiskTier(tmp_path, max_bytes=10**6)
    (tmp_path / f"aa{SUFFIX}").write_bytes(b"root:x:0:0:SECRET-CONTENT" * 10)
    with caplog.at_level(logging.DEBUG, logger="kvboost_rag"):
        assert tier.get("aa") is None
    assert "corrupt" in caplog.text
    assert "root" not in caplog.text and "SECRET" not in caplog.text


def test_file_larger_than_its_header_declares_is_not_read_whole(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=10**6)
    tier.put("aa", _entry())
    path = tmp_path / f"aa{SUFFIX}"
    with open(path, "ab") as handle:
        handle.write(b"\0" * 4096)
    assert tier.get("aa") is None and not path.exists()


def test_file_larger_than_the_budget_is_not_read_but_kept(tmp_path, monkeypatch):
    DiskTier(tmp_path, max_bytes=10**6).put("aa", _entry())  # a process with a larger budget
    small = DiskTier(tmp_path, max_bytes=200)
    reads: list[int] = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    assert small.get("aa") is None
    assert reads == [] and (tmp_path / f"aa{SUFFIX}").exists()
    monkeypatch.undo()
    assert DiskTier(tmp_path, max_bytes=10**6).get("aa") is not None


def test_cache_dir_that_is_a_file_is_an_invalid_input(tmp_path):
    path = tmp_path / "not-a-folder"
    path.write_text("x")
    with pytest.raises(InvalidInputError, match="disk_cache_dir"):
        DiskTier(path, max_bytes=10**6)
    with pytest.raises(InvalidInputError, match="disk_cache_dir"):
        build_store(KVBoostSettings(disk_cache_dir=path))
    with pytest.raises(InvalidInputError, match="disk_cache_dir"):
        DiskTier(path / "child", max_bytes=10**6)
