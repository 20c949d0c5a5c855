"""Residency: which files' bytes are in RAM, and getting them back.

Owns the least-recently-used list of files whose bytes are published (the
only ones that may be evicted, C5/C7), eviction, making room for a write, and
loads from the store (restart, evicted files): every load is checked against
the file's record, size and xxh3-128 together (C6); a mismatch, a missing
object or an unreadable record is EIO, logged, never silent.

A reader of a large file in a local store is served in place: its blocks are
verified as a load would, and reads are answered from the few blocks just
verified, held for the reader, or from the store file (no spill file, and
nothing of the file in RAM once read: `fs.loading.Borrowing`). A writer, or a
prefetch, loads the file into RAM as before.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from . import manifest, storeio
from .backend import source_of
from .journal import Exchange, FileGen, Op, Remove, Rename
from .manifest import BLOCK, LEAD, Digest, Record, hasher
from .state import State

if TYPE_CHECKING:
    from .backend import Source
    from .engine import Engine

log = logging.getLogger(__name__)

LOAD_TRIES = 3  # a load that fails for a passing reason (a store call's error or deadline) is tried this often before EIO
LOAD_SPILL_PATIENCE_S = 60.0  # how long a load waits for room in a full spill directory
SPILL_FULL_SAY_S = 30.0  # while writes wait for room in the spill directory, it is logged this often
ROOM_PATIENCE_S = 2.0  # how long a load waits for write-back to free RAM before it loads into the spill directory
IN_PLACE_FROM = 8 << 20  # a reader of a file this large in a local store is served from the store's file (smaller ones load into RAM)
HOLD_WAIT_S = 0.005  # a load served in place that keeps pace with its reader looks again this often
IN_PLACE_MAX = 128  # files served in place at once (each holds a descriptor); past that, the least recently read one ends
PREFETCH_BATCH = 1000  # files a prefetch passes between two turns of the event loop
AHEAD = 64 << 20  # while a block is checked and served, the disk reads this much past it (local stores)


class LoadTarget(Protocol):
    """Where a load puts a file's bytes (fs.loading.Loading), or what it
    verifies for reads in place (fs.loading.Borrowing, `in_place`, which
    `adopt`s the store file's descriptor): `view`, `place` and `close` in
    the worker thread, the rest on the owning thread."""

    size: int
    spilled: bool
    in_place: bool
    cancelled: bool

    def adopt(self, fd: int, opened: os.stat_result | None = None) -> None: ...  # in-place targets only (`in_place`), as are these three:
    def hold(self, off: int, n: int, pressed: bool) -> bool | None: ...
    def let_go_idle(self) -> float | None: ...
    dropped: list[tuple[int, int]]

    def view(self, off: int, n: int) -> memoryview | None: ...
    def place(self, off: int, piece: memoryview | bytes) -> None: ...
    def close(self) -> None: ...
    def covers(self, off: int, end: int | None) -> bool: ...
    def show(self, off: int, end: int) -> bool: ...
    def show_lead(self, n: int) -> bool: ...
    def release(self) -> None: ...


class _Load:
    """A load in progress: the file, where its bytes go, what they must hash
    to, and which block to read next.

    Blocks are read in order, except that a block a reader waits for goes
    first (torch.load reads a zip's directory at the end of the file before
    anything else; an mmap reader faults pages anywhere), and reading then
    goes on from there, wrapping round. That needs every block verifiable
    on its own (`ranged`): a record that only knows the whole file's hash is
    read in order and served at the end. A block is the digests' (`unit`;
    if the two a file may match differ, the larger, and the other is checked
    whole)."""

    def __init__(self, ino: int, path: str, target: LoadTarget, wanted: list[Digest]) -> None:
        self.ino, self.path, self.target, self.wanted = ino, path, target, wanted
        self.error: OSError | None = None
        self.again = False  # the store moved the file while it loaded (a rename's turn): load it from where it is now
        self.disturbed = False  # the publisher changed its path in the store meanwhile (`Residency.disturb`)
        self.from_index = False  # verified against the manifest index's record, not yet against the store's (`Residency._stale`)
        self.finished = False  # the load's task is over: counted, logged, evictable again
        self.source_fd = -1  # the store file to read, opened already (a borrow's descriptor, `kept_in_place`); -1: open `path`
        self.in_hand = False  # read from such a descriptor: `path` names no store file
        self.changed = trio.Event()
        matching = [d for d in wanted if d.size == target.size]
        self.unit = max((d.block_size for d in matching), default=BLOCK)
        self.ranged = all(d.size <= self.unit or (d.block_size == self.unit and len(d.blocks) == -(-d.size // self.unit))
                          for d in matching)
        self._taken = bytearray(max(1, -(-target.size // self.unit)))  # per block: 1 once handed to the worker
        self._asked: collections.deque[int] = collections.deque()  # blocks readers wait for, first asked first
        self._next = 0  # where reading on goes
        self.waiting = 0  # callers waiting for it now

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    @property
    def pressed(self) -> bool:
        """A reader waits for bytes not served yet."""
        return self.waiting > 0

    def ask(self, off: int, end: int | None) -> None:
        """A reader waits for the bytes `off`..`end` (None: all)."""
        if not self.ranged or end is None:
            return
        end = min(end, self.target.size)
        if end > off:
            self._asked.extend(i for i in range(off // self.unit, (end - 1) // self.unit + 1) if not self._taken[i])

    def next(self, done: int | None, verified: bool) -> int | None:
        """Owning thread, called before the worker starts (`done` None) and
        after each block it read: serve block `done` if it is verified; the
        block to read next (None: none left)."""
        if done is not None and verified:
            lo = done * self.unit
            if not self.target.show(lo, min(lo + self.unit, self.target.size)):
                raise storeio.Cancelled()
            self.wake()
        while self._asked:
            i = self._asked.popleft()
            if not self._taken[i]:
                return self._take(i)
        i = self._taken.find(0, self._next)
        if i < 0:
            i = self._taken.find(0)
        return None if i < 0 else self._take(i)

    def step(self, done: int | None, verified: bool, holding: bool) -> tuple[int | None, bool | None]:
        """Owning thread: `next`, and for a load that holds blocks for a
        reader in place (`holding`), the target's `hold` answer for the
        block it gives: one hop to the event loop for both, per block."""
        i = self.next(done, verified)
        if i is None or not holding:
            return i, False
        lo = i * self.unit
        return i, self.target.hold(lo, min(self.unit, self.target.size - lo), self.pressed)

    def _take(self, i: int) -> int:
        self._taken[i] = 1
        self._next = i + 1
        return i


class _Handing:
    """A load served in place: a descriptor of the store file it reads, for
    its target, with the file's status when the load opened it, before it
    read a byte (handed over with the file's lead or its first block,
    whichever is served first; a write in place after that ends the
    borrow)."""

    __slots__ = ("fd", "opened")

    def __init__(self) -> None:
        self.fd = -1  # -1: none (not in place, or handed over already)
        self.opened: os.stat_result | None = None

    def hand_to(self, target: LoadTarget) -> None:
        """The descriptor to `target`, if not handed over yet (then the
        target's, or closed by it if the borrow ended; owning thread)."""
        if self.fd >= 0:
            target.adopt(self.fd, self.opened)
            self.fd = -1


def _close(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


def _narrow(wanted: list[Digest], i: int, unit: int, got: str, path: str) -> list[Digest]:
    """The digests that block `i` (of `unit` bytes) hashing to `got` still allows."""
    left = [d for d in wanted if d.block(i, unit) in (None, got)]
    if wanted and not left:
        raise storeio.IntegrityError(f"checksum mismatch in block {i} ({i * unit}-{(i + 1) * unit} bytes) of {path}")
    return left


def _narrow_lead(wanted: list[Digest], got: str, path: str) -> list[Digest]:
    """The digests that a lead hashing to `got` still allows (each has a lead)."""
    left = [d for d in wanted if d.lead == got]
    if wanted and not left:
        raise storeio.IntegrityError(f"checksum mismatch in the first {LEAD} bytes of {path}")
    return left


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
    staged_while_written: int = 0  # generations staged by their stream (streaming.py)


class Residency:
    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # evictable, oldest first
        self.counters = Counters()
        self.verify_failures: dict[str, str] = {}
        self._expected: dict[int, Record] = {}  # restart: the record each file must match
        self._unverifiable: dict[int, str] = {}  # restart: files whose record could not be read
        self._unfound: set[int] = set()  # files found in no replica of the store, said once each (`_start`)
        self._loads: dict[int, _Load] = {}  # loads in progress
        self._failures: dict[int, int] = {}  # loads of a file that failed in a row, for a passing reason
        self.served_in_place: collections.OrderedDict[int, None] = collections.OrderedDict()  # least recently read first
        self._borrowed_against: dict[int, list[Digest]] = {}  # files served in place: what their load verified them against
        # The expected records came from the manifest index. The index is
        # only a cache of the records: one made stale by a write straight
        # to the store racing this mount's start must cost a lookup, not a
        # false EIO. A load verifies against the index's record first (its
        # first byte waits for no record object); if the store's bytes do
        # not match it, the load reads the record the store holds and, if
        # that is another, loads again against it (`_stale`).
        self.recheck = False
        self._rechecked: set[int] = set()  # files whose record was read again from the store since the scan
        self._spill_full_said = -math.inf  # when `make_spill_room` last logged that it waits

    def published(self, ino: int) -> None:
        self.lru[ino] = None

    def forget(self, ino: int) -> None:
        """A new generation is sealed: the file is not evictable until published."""
        self.lru.pop(ino, None)
        self._expected.pop(ino, None)
        self._unverifiable.pop(ino, None)
        self._unfound.discard(ino)
        self._rechecked.discard(ino)
        self._borrowed_against.pop(ino, None)

    def freed(self, ino: int) -> None:
        """`ino` left the mount for good (`Engine.freed`)."""
        self.forget(ino)
        self._failures.pop(ino, None)
        self.served_in_place.pop(ino, None)

    def expect(self, inos: list[int], records: list[Record | None]) -> None:
        """Each inode's first load is verified against its record (None: it has none): a restart, a directory at a time."""
        self._expected.update((ino, rec) for ino, rec in zip(inos, records, strict=True) if rec is not None)

    def unverifiable(self, ino: int, path: str) -> None:
        self._unverifiable[ino] = path

    def touch(self, ino: int) -> None:
        if ino in self.lru:
            self.lru.move_to_end(ino)

    # -- eviction --------------------------------------------------------------
    def evict(self, nbytes: int) -> int:
        """Drop published files from RAM, least recently used first, until
        `nbytes` are freed; returns what was freed. Unpublished data stays.
        First go the blocks held for readers of files read in place (their
        readers read on from the store files)."""
        freed = 0
        for ino in self.served_in_place:
            if freed >= nbytes:
                break
            freed += self.e.ns.let_go_held(ino)
        for ino in list(self.lru):
            if freed >= nbytes:
                break
            if not self.e.ns.spilled(ino):  # a spilled file holds no RAM
                freed += self.evict_file(ino)
        return freed

    def evict_file(self, ino: int) -> int:
        """Drop one published file from RAM, or its spill file; returns the
        bytes freed; 0 if it is not (all) published."""
        if ino not in self.lru:
            return 0
        if not self.e.ns.paths_of(ino):
            # Deleted or replaced in the mount, open still: the store's copy
            # goes (or went) with its last name, and RAM holds its only one.
            del self.lru[ino]
            return 0
        got = self.e.ns.evict(ino, self.e.published_gen.get(ino, 0))
        if not self.e.ns.resident(ino):
            del self.lru[ino]
        if got:
            self.counters.evictions += 1
            self.counters.evicted_bytes += got
        return got

    async def _spill_room(self, size: int) -> None:
        """Before a load into the spill directory: room there for `size`
        bytes, as far as `make_spill_room` can make it within
        LOAD_SPILL_PATIENCE_S (a reader does not wait out a store outage);
        else the load tries all the same, and fails with ENOSPC if it must."""
        spill_dir = self.e.ns.spill_dir
        with trio.move_on_after(LOAD_SPILL_PATIENCE_S):
            while spill_dir is not None and _free_space(spill_dir) < size and await self.make_spill_room():
                pass

    async def make_spill_room(self) -> bool:
        """The spill directory's disk is full (C7): evict published spilled
        files, or else wait for write-back to change something (a file
        published can then be evicted, a snapshot let go frees its spill
        file). True when the caller should try again; False when nothing
        can free any room."""
        if any([self.evict_file(ino) for ino in list(self.lru) if self.e.ns.spilled(ino)]):
            return True
        releasing = any(g.readers for g in self.e.unsettled.values())  # threads still reading dropped snapshots
        if not any(g.state is not State.PARKED for g in self.e.pending.values()) and not releasing:
            return False
        now = time.monotonic()
        if now - self._spill_full_said >= SPILL_FULL_SAY_S:
            self._spill_full_said = now
            log.warning("the spill directory %s is full: writes that RAM cannot hold wait for write-back to publish spilled files "
                        "and give their room back", self.e.ns.spill_dir)
        await self.e.wait_change()
        return True

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
    async def load(self, ino: int, off: int = 0, end: int | None = None) -> None:
        """Bring an evicted or restored file back from the store, block by
        block, each verified before it is served (C6); returns once the bytes
        `off`..`end` (None: all of them, in RAM) can be read, and their blocks
        are read first. One load per file runs in the background; every
        caller waits on it. A reader (`end` given) of a large file in a
        local store is served in place (`_start`)."""
        ns = self.e.ns
        while True:
            if ns.borrow_covers(ino, off, end):
                self._read_in_place(ino)
                return
            load = self._loads.get(ino)
            if load is None:
                if ns.resident(ino):
                    return
                if self.e.link is not None:
                    await self.e.published_for_load(ino)
                    load = self._loads.get(ino)
            if load is None:
                if ns.resident(ino):
                    return
                load = await self._start(ino, in_place=end is not None)
                if load is None:
                    return
            if end is None and load.target.in_place:  # the whole file, in RAM: after the reads' load
                while not load.finished:
                    await load.changed.wait()
                continue
            load.ask(off, end)
            # a caller of the whole file (a writer, prefetch) also waits for the load to be over
            load.waiting += 1
            try:
                while load.error is None and not load.again and not (load.target.covers(off, end) and (end is not None or load.finished)):
                    await load.changed.wait()
            finally:
                load.waiting -= 1
            if load.again:
                continue
            # Not when a truncate meanwhile dropped the load: the file is in RAM, as it is now.
            # A caller of the whole file needs it in RAM (an empty file's load covers its no bytes).
            if load.error is not None and not ns.resident(ino) and (end is None or not load.target.covers(off, end)):
                raise load.error
            if load.finished and not ns.resident(ino) and not ns.borrow_covers(ino, off, end):
                # Evicted again between the load's end and this caller's turn (an
                # `evict`, a writer making room): the caller reads or changes the
                # file's bytes right after this returns, with no await between.
                continue
            if load.target.in_place:
                self._read_in_place(ino)
            return

    def _read_in_place(self, ino: int) -> None:
        """A file served in place was read: it goes last in line to end its
        borrow (only IN_PLACE_MAX are served at once; one still verifying
        is never ended)."""
        served = self.served_in_place
        served[ino] = None
        served.move_to_end(ino)
        if len(served) <= IN_PLACE_MAX:
            return
        # (A file with no name left keeps its borrow: its store file may be gone, see `kept_in_place`.)
        for oldest in [i for i in served if i not in self._loads and self.e.ns.paths_of(i)][: len(served) - IN_PLACE_MAX]:
            del served[oldest]
            self.e.ns.unborrow(oldest)

    def kept_in_place(self, ino: int) -> bool:
        """Whether every byte of a file is served, verified, from a descriptor
        of its file in a local store, which a load into RAM reads too: the
        store's name for those bytes may go (deleted or replaced in the
        mount while a process reads the file), the descriptor keeps them."""
        return ino in self._borrowed_against and self.e.ns.borrowed_fd(ino) >= 0

    async def _start(self, ino: int, in_place: bool = False) -> _Load | None:
        if not in_place and self.kept_in_place(ino):
            # Into RAM from the store file it is served from: the same bytes, verified again
            paths = self.e.ns.paths_of(ino)
            size = os.fstat(self.e.ns.borrowed_fd(ino)).st_size
            fd = os.dup(self.e.ns.borrowed_fd(ino))  # (the borrow may end while room is made)
            return await self._begin(ino, paths[0] if paths else f"inode {ino} (deleted in the mount)",
                                     self._borrowed_against[ino], size, fd)
        found = self.e.publisher_shown(ino)
        if found is None:
            # A fault of ckptfs itself (the file's bytes are gone from RAM, and the publisher's replica of
            # the store shows it nowhere): said once per file, every read of it answers EIO
            why = "its data is in neither RAM nor the store"
            if ino not in self._unfound:
                self._unfound.add(ino)
                paths = self.e.ns.paths_of(ino)
                log.error("cannot load %s (inode %d): %s", paths[0] if paths else "a file with no name", ino, why)
            raise OSError(errno.EIO, why)
        path, shown = found
        if ino in self._unverifiable:
            self._fail(path, "its record in the store cannot be read")
        expected = self._expected.get(ino)
        from_index = expected is not None and self.recheck and ino not in self._rechecked
        if expected is None and shown.digest is None and self.e.link is not None:
            # Cluster mode: published by another node, or found in the store when the cluster started
            expected = await self.e.calls.run(f"read the record of {path}", manifest.read, self.e.backend, path)
            if expected is None or expected.kind != "file":
                raise self._failed(path, "it has no record in the store")
        elif expected is None and shown.digest is None and self.recheck:
            # Shown with no record by a scan from an index or image: one
            # short of a record (a daemon before 39c688d could leave such an
            # index, and every clean exit after kept it) must not cost the
            # load its checksum.
            try:
                there = await self.e.calls.run(f"read the record of {path}", manifest.read, self.e.backend, path)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("cannot read the record of %s (%s)", path, exc)
                there = None
            if there is not None and there.kind == "file":
                expected = there
        if expected is not None:
            wanted = [d for d in (expected.current, expected.previous) if d is not None]
        elif shown.digest is not None:
            wanted = [shown.digest]
        else:
            wanted = []
            log.warning("loading %s with no checksum to verify it against (not written by ckptfs)", path)
        size = shown.digest.size if shown.digest is not None else 0
        return await self._begin(ino, path, wanted, size, in_place=in_place, from_index=from_index)

    async def _begin(self, ino: int, path: str, wanted: list[Digest], size: int, source_fd: int = -1, in_place: bool = False,
                     from_index: bool = False) -> _Load | None:
        """Start loading `ino` from `path` in the store (or from `source_fd`, a
        descriptor of its store file, the load's from here on), verified
        against `wanted`: read in place, into RAM, or into the spill
        directory."""
        try:
            target = await self._target(ino, path, size, in_place)
        except BaseException:
            _close(source_fd)
            raise
        if target is None or isinstance(target, _Load):  # nothing to load, or another caller's load
            _close(source_fd)
            return target
        if target.spilled:
            log.info("loading %s (%d bytes) into the spill directory: the RAM budget cannot hold it", path, target.size)
        load = self._loads[ino] = _Load(ino, path, target, wanted)
        load.from_index = from_index
        load.source_fd, load.in_hand = source_fd, source_fd >= 0
        if self.e._nursery is not None:
            self.e._nursery.start_soon(self._run, load)
        else:
            await self._run(load)
        return load

    async def _target(self, ino: int, path: str, size: int, in_place: bool) -> LoadTarget | _Load | None:
        """Where a load of `ino` puts its bytes (None: it is resident or being
        loaded already); or the load another caller started meanwhile."""
        if in_place and self.e.backend.reads_in_place and size >= IN_PLACE_FROM:
            if ino in self._loads:  # another caller started it while this one read its record
                return self._loads[ino]
            return self.e.ns.begin_borrow(ino)
        need = self.e.ns.ram_for(size)  # (whole chunks: a file of 7 MiB takes 8)
        spill = self.e.ns.free_bytes() < need and not await self.make_room(need, patience_s=ROOM_PATIENCE_S)
        if spill:
            await self._spill_room(size)
        if ino in self._loads:  # another caller started it while this one made room
            return self._loads[ino]
        try:
            return self.e.ns.begin_load(ino, spill)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or spill:
                raise
        await self._spill_room(size)  # the budget went to others meanwhile
        if ino in self._loads:
            return self._loads[ino]
        return self.e.ns.begin_load(ino, True)

    async def _run(self, load: _Load) -> None:
        try:
            holding = load.target.in_place and load.ranged  # (a block that cannot be checked alone is served at the end)
            first = load.step(None, False, holding)  # here, not in a hop from the worker: its first read starts at once
            await self.e.calls.run(f"load {load.path}", self._stream, load, first, holding, nbytes=load.target.size)
            if not load.target.covers(0, None) and not load.target.show(0, load.target.size):
                raise storeio.Cancelled()
        except BaseException as exc:
            load.target.release()
            if load.in_hand and isinstance(exc, storeio.IntegrityError):
                # The store file it was served from does not verify now: that borrow ends
                self.e.ns.unborrow(load.ino)
            if isinstance(exc, storeio.Cancelled):  # truncated, replaced or deleted meanwhile: nothing to load
                log.info("stopped loading %s: the file changed meanwhile", load.path)
                load.error = OSError(errno.EIO, "the file changed while it was loading")
            elif isinstance(exc, FileNotFoundError | storeio.IntegrityError) and not load.in_hand and await self._moved(load):
                log.info("%s moved in the store while it loaded: loading it from its new name", load.path)
                load.again = True
            elif isinstance(exc, FileNotFoundError | storeio.IntegrityError) and load.from_index and await self._stale(load):
                log.info("%s does not match its record in the manifest index: loading it again against the one in the store", load.path)
                load.again = True
            elif isinstance(exc, FileNotFoundError):
                load.error = self._failed(load.path, "missing from the store")
            elif isinstance(exc, storeio.IntegrityError):
                load.error = self._failed(load.path, str(exc))
            elif isinstance(exc, Exception) and self._failures.get(load.ino, 0) + 1 < LOAD_TRIES:
                tries = self._failures[load.ino] = self._failures.get(load.ino, 0) + 1
                delay = self.e.retry.delay(tries)
                log.warning("cannot load %s from the store (try %d): %s; trying again in %.1fs", load.path, tries, exc, delay)
                await trio.sleep(delay)  # readers keep waiting on this load meanwhile
                load.again = True
            elif isinstance(exc, trio.Cancelled):  # the engine's nursery: the daemon stops
                log.info("stopped loading %s: the daemon is stopping", load.path)
                load.error = OSError(errno.EIO, "the daemon is stopping")
            else:
                log.error("cannot load %s from the store: %s", load.path, exc)
                # Its reader gets EIO, as for any store failure (a deadline's ETIMEDOUT, a store's EACCES
                # reached the reader as is); RAM that ran out is said as such
                load.error = exc if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.ENOMEM) else \
                    OSError(errno.EIO, f"cannot load {load.path} from the store: {exc}")
            if not isinstance(exc, Exception):
                raise
        else:
            if load.target.in_place:
                self._borrowed_against[load.ino] = load.wanted
                if self.e._nursery is not None:
                    self.e._nursery.start_soon(self._let_go, load.target)
            else:
                self.lru[load.ino] = None
            self.counters.loads += 1
            self.counters.loaded_bytes += load.target.size
            log.info("%s %s from the store (%d bytes%s%s)", "read" if load.target.in_place else "loaded", load.path, load.target.size,
                     ", verified" if load.wanted else "",
                     ", into the spill directory" if load.target.spilled else ", served in place" if load.target.in_place else "")
        finally:
            _close(load.source_fd)  # (if the worker never took it)
            load.source_fd = -1
            if not load.again:
                self._failures.pop(load.ino, None)
            del self._loads[load.ino]
            load.finished = True
            load.wake()

    @staticmethod
    async def _let_go(target: LoadTarget) -> None:
        """After a load served in place: its held blocks go once no read
        comes for them."""
        while (again := target.let_go_idle()) is not None:
            await trio.sleep(again)

    def _stream(self, load: _Load, first: tuple[int | None, bool | None], holding: bool) -> None:
        """Worker thread: read the file from the store block by block, in the
        order `load.step` gives (`first`: its answer for the first block),
        place its bytes, and serve each block once its hash matches the
        record's (`holding`: blocks are held for a reader in place)."""
        target, size, unit = load.target, load.target.size, load.unit
        wanted = [d for d in load.wanted if d.size == size]
        if load.wanted and not wanted:
            raise storeio.IntegrityError(f"checksum mismatch: the file has {size} bytes, the manifest says "
                                         + " or ".join(str(d) for d in load.wanted))
        whole = None if load.ranged else hasher()
        handing = _Handing()
        try:
            with self._open(load) as source:
                if source.size != size:
                    raise storeio.IntegrityError(f"the store has {source.size} bytes, the file {size}")
                # Reads are served from this very file, the one verified: a descriptor of it
                # goes to the target with the first block (`_after_block`), before it is shown,
                # with its status now, before a byte is read (a write in place from here on ends
                # the borrow).
                if target.in_place:
                    handing.fd = os.dup(source.fd)
                    handing.opened = os.fstat(handing.fd)
                i, held = first
                while i is not None:
                    pos = lo = i * unit
                    n = min(unit, size - lo)
                    block = hasher()
                    if holding:
                        self._hold(load, source, lo, n, held)
                    # The file's lead (its first LEAD bytes) is read on its own and served once it
                    # verifies, before the rest of its block: a reader's first requests wait for no more
                    lead = LEAD if lo == 0 and size > LEAD and all(d.lead for d in wanted) else 0
                    for at, k in ((0, lead), (lead, n - lead)) if lead else ((lo, n),):
                        for piece in source.read(at, k, target.view):
                            if target.cancelled:
                                raise storeio.Cancelled()
                            target.place(pos, piece)
                            block.update(piece)
                            if whole is not None:
                                whole.update(piece)
                            pos += len(piece)
                        piece = None  # no view of the file's memory outlives its read
                        if at == 0 and lead:
                            wanted = _narrow_lead(wanted, block.hexdigest(), load.path)
                            trio.from_thread.run_sync(self._lead_verified, load, handing)
                    source.ahead(lo + unit, max(unit, AHEAD))  # the disk reads on while this block is checked and served
                    wanted = _narrow(wanted, i, unit, block.hexdigest(), load.path)
                    # a block is served once every digest still allowed vouches for it; in
                    # order, the last block only once the whole file is checked (in _run)
                    verified = all(d.block(i, unit) is not None for d in wanted) and (load.ranged or pos < size)
                    i, held = trio.from_thread.run_sync(self._after_block, load, handing, i, verified, holding)
        finally:
            target.close()
            if handing.fd >= 0:  # never handed (the first block failed, or the daemon stops)
                os.close(handing.fd)
        if whole is not None and wanted and not any(d.xxh3 == whole.hexdigest() for d in wanted):
            raise storeio.IntegrityError(f"checksum mismatch: the store has {size} bytes with xxh3 {whole.hexdigest()}, "
                                         f"the manifest says {' or '.join(str(d) for d in load.wanted)}")

    @staticmethod
    def _lead_verified(load: _Load, handing: _Handing) -> None:
        """Owning thread, once the file's lead is verified: served."""
        handing.hand_to(load.target)
        if not load.target.show_lead(LEAD):
            raise storeio.Cancelled()
        load.wake()

    @staticmethod
    def _after_block(load: _Load, handing: _Handing, done: int, verified: bool, holding: bool) -> tuple[int | None, bool | None]:
        """Owning thread, after each block: the store file's descriptor
        in `handing` to the target the first time, and `load.step`: one
        hop per block."""
        handing.hand_to(load.target)
        return load.step(done, verified, holding)

    def _open(self, load: _Load) -> Source:
        """Worker thread: the store file a load reads."""
        if load.source_fd < 0:
            return self.e.backend.open_source(load.path)
        fd = trio.from_thread.run_sync(self._take_source_fd, load)
        if fd < 0:  # the load was given up meanwhile (past its deadline)
            raise storeio.Cancelled()
        return source_of(fd)

    @staticmethod
    def _take_source_fd(load: _Load) -> int:
        fd, load.source_fd = load.source_fd, -1
        return fd

    def _hold(self, load: _Load, source: Source, lo: int, n: int, held: bool | None) -> None:
        """Worker thread, before a block of a file read in place (`held`:
        the target's first `hold` answer for it): have the block held for
        its reader if it can be (waiting, while the reader is still at the
        blocks held before it), and let the store file's pages the reader
        went past go."""
        target = load.target
        while held is None:
            time.sleep(HOLD_WAIT_S)
            held = trio.from_thread.run_sync(lambda: target.hold(lo, n, load.pressed))  # `pressed` read on the owning thread
        while target.dropped:
            source.forget(*target.dropped.pop())

    def disturb(self, paths: tuple[str, ...]) -> None:
        """The publisher is about to change these store paths: a load
        reading from one of them that fails from now on starts again."""
        for load in self._loads.values():
            if any(load.path == p or load.path.startswith(p + "/") for p in paths):
                load.disturbed = True

    async def _stale(self, load: _Load) -> bool:
        """After a load verified against the manifest index's record failed,
        and not for a change the publisher made (`_moved` asked first):
        whether the store holds another record for the file (a write
        without a daemon raced the mount's start, and the index is stale
        for it): then the file loads again, against that one. Otherwise
        (the same digests, no record there, or none that can be read) the
        failure stands."""
        self._rechecked.add(load.ino)
        try:
            there = await self.e.calls.run(f"read the record of {load.path}", manifest.read, self.e.backend, load.path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("cannot read the record of %s again (%s): verifying against the manifest index", load.path, exc)
            return False
        found = self.e.publisher_shown(load.ino)
        if load.disturbed or found is None or found[0] != load.path:
            # the publisher changed the path meanwhile: what was read there may be another file's record
            self._rechecked.discard(load.ino)
            return True  # loaded again from where the file is now, against the index's record
        was = self._expected.get(load.ino)
        if there is None or there.kind != "file" or was is None or (there.current, there.previous) == (was.current, was.previous):
            return False
        self._expected[load.ino] = there
        return True

    async def _moved(self, load: _Load) -> bool:
        """After the store had no file at `load.path`, or other bytes there:
        whether the publisher changed what the store has there meanwhile
        (its turns do not wait for loads: a rename, an exchange or a
        removal moves the file or puts another in its place, a newer
        generation replaces its bytes, a file deleted at one name comes
        back to it from another), or the file was sealed anew meanwhile. A
        change of that path under way is waited for first; then the load
        starts again from where the store shows the file now."""
        path = load.path
        op = self.e.publisher.current
        if op is not None and any(path == p or path.startswith(p + "/") for p in _paths(op)):
            await op.done.wait()
        found = self.e.publisher_shown(load.ino)
        if found is None:
            return False
        newer = self.e.pending.get(load.ino)
        if newer is not None and newer.generation > found[1].generation:
            # sealed anew (in cluster mode, by another node) while the load waited, for room say: the
            # file's size is the new one; its bytes come once published (`Engine.published_for_load`)
            return True
        return load.disturbed or found[0] != path or (found[1].digest is not None and found[1].digest not in load.wanted)

    def _failed(self, path: str, why: str) -> OSError:
        self.verify_failures[path] = why
        log.error("cannot load %s from the store: %s", path, why)
        return OSError(errno.EIO, why)

    def _fail(self, path: str, why: str) -> None:
        raise self._failed(path, why)

    async def prefetch(self, prefix: str = "") -> tuple[int, list[tuple[str, str]]]:
        """Load every file under `prefix` whose bytes are only in the store
        (ahead of a restart's reads); returns how many were loaded, and the
        files that could not be (path, why): one that fails (corrupt in
        the store, the store down past the load's retries) does not stop
        the others."""
        from .replica import File

        n = 0
        failed: list[tuple[str, str]] = []
        base = prefix.rstrip("/")
        start = self.e.publisher.replica.lookup(base) if base else self.e.publisher.replica.root
        if start is None:
            return 0, failed
        items = [(base, start)] if isinstance(start, File) else [(f"{base}/{rel}" if base else rel, node)
                                                                  for rel, node in self.e.publisher.replica.walk(start)]
        for i, (path, node) in enumerate(items, 1):
            if i % PREFETCH_BATCH == 0:
                await trio.sleep(0)  # files already in RAM are passed without a wait: the mount answers meanwhile
            if not isinstance(node, File) or node.shown is None:
                continue
            live = self.e.ns.inode_at(path)
            if live is not None and live.ino == node.ino and not self.e.ns.resident(node.ino):
                try:
                    await self.load(node.ino)
                except OSError as exc:  # logged by the load
                    failed.append((path, exc.strerror or str(exc)))
                    continue
                n += 1
        return n, failed


def _free_space(directory: str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return sys.maxsize  # unknown: the load tries, and says why if it cannot
    return st.f_bavail * st.f_frsize


def _paths(op: Op) -> tuple[str, ...]:
    """The store paths an op changes."""
    if isinstance(op, Rename):
        return (op.src, op.dst)
    if isinstance(op, Exchange):
        return (op.a, op.b)
    if isinstance(op, FileGen):
        return tuple(op.names)
    return (op.name,) if isinstance(op, Remove) else ()

