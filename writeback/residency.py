"""Residency: which files' bytes are in RAM, and getting them back.

Owns the least-recently-used list of files whose bytes are published (the
only ones that may be evicted, C5/C7), eviction, making room for a write, and
loads from the store (restart, evicted files): every load is checked against
the file's record, size and xxh3-128 together (C6); a mismatch, a missing
object or an unreadable record is EIO, logged, never silent.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from . import storeio
from .manifest import Record
from .state import State

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)


@dataclass
class Counters:
    """Running totals since the daemon started (for status and metrics)."""

    uploaded_bytes: int = 0
    published_files: int = 0
    retries: int = 0
    failures: int = 0  # tries that reached `Retry.failed_after`
    evictions: int = 0
    evicted_bytes: int = 0
    loads: int = 0  # read-through: files loaded back from the store
    loaded_bytes: int = 0


class Residency:
    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # evictable, oldest first
        self.counters = Counters()
        self.verify_failures: dict[str, str] = {}
        self._expected: dict[int, Record] = {}  # restart: the record each file must match
        self._unverifiable: dict[int, str] = {}  # restart: files whose record could not be read

    def published(self, ino: int) -> None:
        self.lru[ino] = None

    def forget(self, ino: int) -> None:
        """A new generation is sealed: the file is not evictable until published."""
        self.lru.pop(ino, None)
        self._expected.pop(ino, None)
        self._unverifiable.pop(ino, None)

    def expect(self, ino: int, record: Record) -> None:
        self._expected[ino] = record

    def unverifiable(self, ino: int, path: str) -> None:
        self._unverifiable[ino] = path

    def touch(self, ino: int) -> None:
        if ino in self.lru:
            self.lru.move_to_end(ino)

    # -- eviction --------------------------------------------------------------
    def evict(self, nbytes: int) -> int:
        """Drop published files from RAM, least recently used first, until
        `nbytes` are freed; returns what was freed. Unpublished data stays."""
        freed = 0
        for ino in list(self.lru):
            if freed >= nbytes:
                break
            freed += self.evict_file(ino)
        return freed

    def evict_file(self, ino: int) -> int:
        """Drop one published file from RAM; 0 if it is not (all) published."""
        if ino not in self.lru:
            return 0
        got = self.e.ns.evict(ino, self.e.published_gen.get(ino, 0))
        if got or not self.e.ns.paths_of(ino):
            del self.lru[ino]
        if got:
            self.counters.evictions += 1
            self.counters.evicted_bytes += got
        return got

    async def make_room(self, nbytes: int, patience_s: float = math.inf) -> bool:
        """Free `nbytes` of the RAM budget: evict published files, and if that
        is not enough, wait (up to `patience_s`) for write-back to publish,
        and so free, more. False when that did not free enough."""
        with trio.move_on_after(patience_s):
            return await self._make_room(nbytes)
        return False

    async def _make_room(self, nbytes: int) -> bool:
        ns = self.e.ns
        while ns.free_bytes() < nbytes:
            self.evict(nbytes - ns.free_bytes())
            if ns.free_bytes() >= nbytes:
                break
            releasing = any(g.readers for g in self.e.unsettled.values())  # threads still reading dropped snapshots
            if not any(g.state is not State.PARKED for g in self.e.pending.values()) and not releasing:
                return False
            await self.e.wait_change()
        return True

    # -- loads -----------------------------------------------------------------
    async def load(self, ino: int) -> None:
        """Bring an evicted or restored file back from the store, verified."""
        found = self.e.publisher_shown(ino)
        if found is None:
            raise OSError(errno.EIO, "the file's data is in neither RAM nor the store")
        path, shown = found
        if ino in self._unverifiable:
            self._fail(path, "its record in the store cannot be read")
        try:
            blocks, digest = await self.e.calls.run(f"load {path}", storeio.fetch, self.e.backend, path, nbytes=shown.digest.size if shown.digest else 0)
        except FileNotFoundError:
            self._fail(path, "missing from the store")
        expected = self._expected.get(ino)
        if expected is not None:
            ok = expected.matches(digest.size, digest.xxh3) is not None
            want = f"{expected.current}" + (f" or {expected.previous}" if expected.previous else "")
        elif shown.digest is not None:
            ok = (digest.size, digest.xxh3) == (shown.digest.size, shown.digest.xxh3)
            want = f"{shown.digest}"
        else:
            ok, want = True, ""
            log.warning("loading %s with no checksum to verify it against (not written by ckptfs)", path)
        if not ok:
            self._fail(path, f"checksum mismatch: the store has {digest}, the manifest says {want}")
        if self.e.ns.free_bytes() < digest.size and not await self.make_room(digest.size):
            raise OSError(errno.ENOSPC, "no RAM to load the file into")
        if self.e.ns.resident(ino):
            return  # another load of the same file won
        self.e.ns.fill(ino, blocks)
        self.lru[ino] = None
        self.counters.loads += 1
        self.counters.loaded_bytes += digest.size
        log.info("loaded %s from the store (%d bytes%s)", path, digest.size, ", verified" if want else "")

    def _fail(self, path: str, why: str) -> None:
        self.verify_failures[path] = why
        log.error("cannot load %s from the store: %s", path, why)
        raise OSError(errno.EIO, why)

    async def prefetch(self, prefix: str = "") -> int:
        """Load every file under `prefix` whose bytes are only in the store
        (ahead of a restart's reads); returns how many were loaded."""
        from .replica import File

        n = 0
        base = prefix.rstrip("/")
        start = self.e.publisher.replica.lookup(base) if base else self.e.publisher.replica.root
        if start is None:
            return 0
        items = [(base, start)] if isinstance(start, File) else [(f"{base}/{rel}" if base else rel, node)
                                                                  for rel, node in self.e.publisher.replica.walk(start)]
        for path, node in items:
            if not isinstance(node, File) or node.shown is None:
                continue
            live = self.e.ns.inode_at(path)
            if live is not None and live.ino == node.ino and not self.e.ns.resident(node.ino):
                await self.load(node.ino)
                n += 1
        return n
