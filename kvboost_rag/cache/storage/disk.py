"""Disk tier: one checksummed safetensors file per entry in a directory.

Writes go to a temporary file in the same directory and are moved into place with
``os.replace``, which is atomic on POSIX and Windows: a reader (this process or another one
sharing the directory) sees either the old complete file, the new complete file, or none.
Every read verifies the checksum (:mod:`kvboost_rag.cache.storage.serialization`); a damaged file is
a miss, is deleted, and is logged.

The tier keeps an in-memory index (key -> file size) for its byte budget. On start it is
rebuilt from the directory with files ordered by modification time (hits refresh it), so a
restart finds every entry written before and evicts the least recently used first. Other
processes may add or remove files at any time: a get always looks at the file itself, and the
index is re-synchronised with the directory on puts (at most every ``RESCAN_SECONDS``) and
before evicting, so processes sharing a directory keep it near one budget.

Files in the directory are untrusted: an entry is read only from a regular file opened without
following links (a symlink, FIFO or device named like an entry is a miss and is removed), no
more than its header declares (and never more than the tier's budget) is read, and warnings
never quote file contents. Repeated warnings are rate-limited
(:class:`~kvboost_rag.log_limits.RateLimitedLogger`).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from kvboost_rag.cache.storage.base import StorageTier, StoredEntry
from kvboost_rag.cache.storage.policy import FrequencyRecencyPolicy
from kvboost_rag.cache.storage.serialization import (
    HEADER_SIZE,
    CorruptPayloadError,
    deserialize_parts,
    payload_length,
    serialize_parts,
)
from kvboost_rag.errors import InvalidInputError
from kvboost_rag.log_limits import RateLimitedLogger

logger = logging.getLogger(__name__)

#: Extension of entry files.
SUFFIX = ".kvb"
#: Prefix of in-flight temporary files (never read as entries).
TEMP_PREFIX = ".tmp-"
#: A put re-reads the directory (to see other processes' files) when the last scan is older
#: than this many seconds, and always when the budget looks exceeded.
RESCAN_SECONDS = 1.0
#: Temporary files older than this (seconds) are leftovers of a crashed writer and removed at start.
STALE_TEMP_SECONDS = 3600.0

_KEY_RE = re.compile(r"^[0-9A-Za-z_-]{1,200}$")
# Open without following a final symlink and without blocking on a FIFO (POSIX; 0 elsewhere).
_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
# errno of opening a symlink with O_NOFOLLOW (Linux: ELOOP; FreeBSD: EMLINK; NetBSD: EFTYPE).
_SYMLINK_ERRNOS = frozenset({errno.ELOOP, errno.EMLINK, getattr(errno, "EFTYPE", errno.ELOOP)})


class _NotRegularFile(Exception):
    """The path of an entry is a link, FIFO, device or folder, not a regular file."""


class _LargerThanBudget(Exception):
    """An entry file (written by a process with a larger budget) exceeds this tier's budget."""


class DiskTier(StorageTier):
    """Entries stored as files under ``directory``.

    Args:
        directory: Folder for the entry files (created if missing). Several processes may
            share it.
        max_bytes: Byte budget for the files. Unpinned entries are evicted (lowest decayed
            frequency first) to stay within it; an entry larger than the budget is not stored.
        policy: Eviction policy (a fresh :class:`FrequencyRecencyPolicy` by default).
        fsync: Flush each file to stable storage before it is moved into place. Without it a
            power loss can leave an empty or partial file, which the checksum then turns into a
            miss.
        secret_key: Authenticate entries with HMAC-SHA256 under this key; entries without a
            valid MAC under it are misses and are deleted
            (:mod:`kvboost_rag.cache.storage.serialization`).
        spill_only: An overflow tier: a :class:`~kvboost_rag.cache.storage.TieredStore` writes to it
            only what the memory tier evicts (see :attr:`StorageTier.spill_only`).

    Pinned entries are pinned for this process only; pins are not stored on disk.

    Raises:
        ValueError: ``max_bytes`` is not positive.
        InvalidInputError: ``directory`` (or a folder on its path) is an existing file.
    """

    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        policy: FrequencyRecencyPolicy | None = None,
        *,
        fsync: bool = False,
        secret_key: bytes | None = None,
        spill_only: bool = False,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.directory = Path(directory)
        self._make_directory()
        self.max_bytes = max_bytes
        self.policy = policy or FrequencyRecencyPolicy()
        self.fsync = fsync
        self.spill_only = spill_only
        self._secret_key = secret_key
        self._warnings = RateLimitedLogger(logger)
        self._sizes: dict[str, int] = {}
        self._used = 0
        self._last_scan = 0.0
        self._lock = threading.RLock()
        self._remove_stale_temp_files()
        self._rescan()
        logger.debug("disk tier %s: %d entries, %d bytes", self.directory, len(self._sizes), self._used)

    # -- StorageTier -------------------------------------------------------------------------

    def get(self, key: str) -> StoredEntry | None:
        path = self._path(key)
        try:
            entry = self._read(path, key)
        except FileNotFoundError:
            self._forget(key)
            return None
        except _LargerThanBudget:
            self._warnings.warning(
                "larger-than-budget",
                "disk tier: %s is larger than this tier's budget (%d bytes); not read",
                path.name,
                self.max_bytes,
            )
            return None
        except _NotRegularFile:
            self._warnings.warning("not-regular", "disk tier: %s is not a regular file; removing it", path.name)
            self._remove_if_not_regular(path)
            self._forget(key)
            return None
        except CorruptPayloadError as exc:
            self._warnings.warning("corrupt", "disk tier: corrupt entry %s (%s); deleting it", path.name, exc)
            self._forget(key)
            return None
        except OSError as exc:
            self._warnings.warning("read", "disk tier: cannot read %s: %s", path.name, exc.strerror or type(exc).__name__)
            return None
        with self._lock:
            if key in self._sizes:
                self.policy.touch(key)
            else:  # written by another process; index it unless it was evicted meanwhile
                try:
                    self._track(key, path.stat(follow_symlinks=False).st_size)
                except FileNotFoundError:
                    pass
        return entry

    def put(self, key: str, entry: StoredEntry) -> list[str]:
        header, payload = serialize_parts(entry, key=key, secret_key=self._secret_key)
        size = len(header) + len(payload)
        if size > self.max_bytes:
            self._warnings.warning(
                "too-large", "disk tier: entry %s (%d bytes) exceeds the budget (%d); not stored", key[:12], size, self.max_bytes
            )
            return []
        path = self._path(key)
        with self._lock:
            evicted = self._make_room(key, size)
            if evicted is None:
                self._warnings.warning("full", "disk tier full of pinned entries; entry %s not stored", key[:12])
                return []
            try:
                self._write_atomically(path, header, payload)
            except OSError as exc:
                self._warnings.warning("write", "disk tier: cannot write %s: %s", path, exc)
                return evicted
            self._track(key, size)
        return evicted

    def pin(self, key: str) -> bool:
        with self._lock:
            return key in self._sizes and self.policy.pin(key)

    def unpin(self, key: str) -> None:
        self.policy.unpin(key)

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._lock:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            self._forget(key)

    def __contains__(self, key: object) -> bool:
        """Whether a file exists for ``key`` (cheap: its checksum is verified by :meth:`get`)."""
        if not isinstance(key, str) or not _KEY_RE.match(key):
            return False
        try:
            return stat.S_ISREG(self._path(key).stat(follow_symlinks=False).st_mode)
        except OSError:
            return False

    def keys(self) -> Iterator[str]:
        return iter([key for key, _, _ in self._list_files()])

    def clear(self) -> None:
        with self._lock:
            for key, _, _ in self._list_files():
                try:
                    self._path(key).unlink()
                except FileNotFoundError:
                    pass
            for key in list(self._sizes):
                self._forget(key)

    @property
    def used_bytes(self) -> int:
        """Bytes of the entry files this tier knows of (refreshed from the directory on eviction)."""
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    def refresh(self) -> None:
        """Re-synchronise the index with the directory (files added or removed by others)."""
        with self._lock:
            self._rescan()

    # -- internals ---------------------------------------------------------------------------

    def _make_directory(self) -> None:
        fix = "point disk_cache_dir at a folder, or at a path where one can be created"
        if self.directory.exists() and not self.directory.is_dir():
            raise InvalidInputError(f"disk_cache_dir {self.directory} is a file, not a folder: {fix}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise InvalidInputError(f"disk_cache_dir {self.directory} cannot be created ({exc.strerror}): {fix}") from exc

    def _read(self, path: Path, key: str) -> StoredEntry:
        """Read and verify the entry file at ``path``.

        Raises:
            FileNotFoundError: No such file.
            _NotRegularFile: A link, FIFO, device or folder sits at ``path``.
            _LargerThanBudget: The file is larger than ``max_bytes`` (left in place).
            CorruptPayloadError: The file is damaged (and has been deleted).
            OSError: Any other read error.
        """
        if not stat.S_ISREG(os.lstat(path).st_mode):  # do not even open devices or FIFOs
            raise _NotRegularFile
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno in _SYMLINK_ERRNOS:  # replaced by a link since the lstat
                raise _NotRegularFile from exc
            raise
        try:
            identity = os.fstat(fd)
            if not stat.S_ISREG(identity.st_mode):
                raise _NotRegularFile
            if identity.st_size > self.max_bytes:
                raise _LargerThanBudget
            try:
                header = _read_exact(fd, HEADER_SIZE)
                length = payload_length(header)
                if HEADER_SIZE + length != identity.st_size:
                    raise CorruptPayloadError(
                        f"file has {identity.st_size} bytes, its header declares {HEADER_SIZE + length} (truncated or padded)"
                    )
                payload = _read_exact(fd, length)
                entry = deserialize_parts(header, payload, expected_key=key, secret_key=self._secret_key)
            except CorruptPayloadError:
                self._remove_if_same(path, identity)
                raise
            if os.utime in os.supports_fd:
                try:
                    os.utime(fd)  # recency survives a restart
                except OSError:
                    pass
            return entry
        finally:
            os.close(fd)

    def _remove_if_not_regular(self, path: Path) -> None:
        """Delete the link, FIFO or device at ``path`` (never what a link points to)."""
        try:
            mode = os.lstat(path).st_mode
            if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._warnings.warning("delete", "disk tier: cannot delete %s: %s", path.name, exc.strerror)

    def _path(self, key: str) -> Path:
        if not _KEY_RE.match(key):
            raise ValueError(f"cache key must be 1-200 characters of [0-9A-Za-z_-], got {key[:40]!r}")
        return self.directory / f"{key}{SUFFIX}"

    def _make_room(self, key: str, size: int) -> list[str] | None:
        """Evict until ``size`` more bytes fit (``key``'s old file counts as freed).

        Returns:
            Evicted keys, or ``None`` if pinned entries leave no room.
        """
        if time.monotonic() - self._last_scan >= RESCAN_SECONDS:
            self._rescan()  # other processes may have added or removed files
        old = self._sizes.get(key, 0)
        if self._used - old + size <= self.max_bytes:
            return []
        self._rescan()
        old = self._sizes.get(key, 0)
        evicted: list[str] = []
        candidates = [k for k in self._sizes if k != key]
        for victim in self.policy.victims(candidates):
            if self._used - old + size <= self.max_bytes:
                break
            try:
                self._path(victim).unlink()
            except FileNotFoundError:
                pass
            self._forget(victim)
            evicted.append(victim)
        if self._used - old + size > self.max_bytes:
            return None
        return evicted

    def _write_atomically(self, path: Path, *parts: bytes) -> None:
        fd, tmp_name = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.stem[:40]}-", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                for part in parts:
                    handle.write(part)
                if self.fsync:
                    handle.flush()
                    os.fsync(handle.fileno())
            os.replace(tmp_name, path)
        except BaseException:
            try:
                os.unlink(tmp_name)
            except FileNotFoundError:
                pass
            raise

    def _track(self, key: str, size: int) -> None:
        """Index ``key`` (new or rewritten) and count one use of it."""
        self._used += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        self.policy.insert(key)

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._used -= size
                self.policy.remove(key)

    def _rescan(self) -> None:
        """Rebuild the index from the directory; keys new to this process enter oldest first."""
        self._last_scan = time.monotonic()
        files = self._list_files()
        on_disk = {key: size for key, size, _ in files}
        for key in [k for k in self._sizes if k not in on_disk]:
            self._forget(key)
        for key, size, _ in sorted(files, key=lambda item: item[2]):
            if key in self._sizes:
                self._used += size - self._sizes[key]
                self._sizes[key] = size
            else:
                self._track(key, size)

    def _list_files(self) -> list[tuple[str, int, float]]:
        """``(key, size, mtime)`` of every entry file present now."""
        found: list[tuple[str, int, float]] = []
        try:
            scan = os.scandir(self.directory)
        except FileNotFoundError:
            return found
        with scan:
            for item in scan:
                if not item.name.endswith(SUFFIX) or item.name.startswith(TEMP_PREFIX):
                    continue
                key = item.name[: -len(SUFFIX)]
                if not _KEY_RE.match(key):
                    continue
                try:
                    info = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):  # links, FIFOs and devices are never entries
                    found.append((key, info.st_size, info.st_mtime))
        return found

    def _remove_if_same(self, path: Path, identity: os.stat_result) -> None:
        """Delete ``path`` unless another writer replaced it since it was read."""
        try:
            current = os.lstat(path)
            if (current.st_ino, current.st_dev) == (identity.st_ino, identity.st_dev):
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._warnings.warning("delete", "disk tier: cannot delete corrupt %s: %s", path.name, exc.strerror)

    def _remove_stale_temp_files(self) -> None:
        cutoff = time.time() - STALE_TEMP_SECONDS
        for item in self.directory.glob(f"{TEMP_PREFIX}*"):
            try:
                if item.stat().st_mtime < cutoff:
                    item.unlink()
            except OSError:
                continue


def _read_exact(fd: int, size: int) -> bytes:
    """Read exactly ``size`` bytes from ``fd``.

    Raises:
        CorruptPayloadError: The file ends first.
    """
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        chunk = os.read(fd, min(remaining, 1 << 24))
        if not chunk:
            raise CorruptPayloadError(f"file ends {remaining} bytes early")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
