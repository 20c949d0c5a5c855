"""An evicted file's bytes coming back from the store, verified block by
block: `Loading` puts them into chunks of the file (or a spill file) again;
`Borrowing` reads the file in place from its file in a local store, with
nothing of it in RAM for good but the few verified blocks held for its
reader. Nothing here knows about FUSE, inodes or paths.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time
from collections.abc import Callable

from ckptfs.holes import is_hole

from .filedata import FileData, SpillFile, pwrite_all
from .memory import CHUNK, SMALL_MAX, Chunk, fitted, new_chunk, ram_for

log = logging.getLogger(__name__)

HELD_BYTES = 192 << 20  # a file read in place holds at most this much of its verified blocks in RAM, for its reader (`Borrowing`)
HELD_IDLE_S = 0.2  # a held block that no read came for this long is let go
HELD_MAX_S = 1.0  # a load waits for its reader this long at most per block (a slower reader's blocks go through the page cache)
SCRATCH = 128 << 10  # a block verified through the scratch is read this much at a time (`Borrowing.view`)


class Loading:
    """An evicted file's bytes on their way back from the store.

    `view` and `place` run in the load's worker thread: they put bytes, at
    any offset and in any order, into chunks of their own (not yet the
    file's) or into a spill file, and keep holes as holes. `show` runs on
    the owning thread once a range is verified: the file serves reads there
    (`covers`); once every chunk is shown it is resident. `show_lead` serves
    the file's first bytes before the rest of their chunk: reads there are
    copies of them (`read_lead`), the worker writing on past them. Nothing else
    touches the file meanwhile (the caller fences writers); a truncate or
    delete of the file drops the load (`data.loading` no longer names it)
    and `release` returns what it held.

    In RAM, the budget for the whole file is reserved up front and what
    holes did not use is returned at the end; a file the budget cannot take
    is loaded into a spill file instead.
    """

    in_place = False

    def __init__(self, data: FileData, spill_dir: str | None) -> None:
        assert not data.resident and data.loading is None
        self.size = data.size
        self.cancelled = False  # the worker thread stops at its next piece
        self._data = data
        self._pending: dict[int, Chunk] = {}
        self._shown = bytearray(-(-self.size // CHUNK))  # per chunk: 1 once served
        self._unshown = len(self._shown)
        self.lead = 0  # the first bytes served before the rest of their chunk (`show_lead`)
        self._reserved = 0
        self.spilled = spill_dir is not None
        self._fd = -1  # the worker's own descriptor of the spill file: closed by the worker (`close`), never reused under it
        if spill_dir is not None:
            fd = os.open(spill_dir, os.O_TMPFILE | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, self.size)
                self._fd = os.dup(fd)
            except BaseException:
                os.close(fd)
                raise
            data._spill, data._spill_dir = SpillFile(fd), spill_dir
        else:
            self._reserved = ram_for(self.size)
            data._pool.reserve(self._reserved)  # ENOSPC: the caller spills instead
        data.loading = self

    def close(self) -> None:
        """The worker is done with the file (worker thread)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _chunk(self, idx: int) -> Chunk:
        chunk = self._pending.get(idx)
        if chunk is None:
            length = min(CHUNK, self.size - idx * CHUNK)
            cap = fitted(length)
            if cap == CHUNK:  # (made ahead by the pool's thread while this one reads, if it keeps up)
                buf: mmap.mmap | bytearray = self._data._pool.take_made() or new_chunk()
            else:
                buf = new_chunk(cap) if cap > SMALL_MAX else bytearray(cap)
            chunk = self._pending[idx] = Chunk(buf, length)  # fresh memory: what no piece writes reads as zeros
        return chunk

    def view(self, off: int, n: int) -> memoryview | None:
        """Where a reader may put up to `n` of the file's bytes at `off`
        itself (worker thread); None in a spill file (`place` writes it)."""
        if self._fd >= 0 or self.cancelled or not 0 <= off < self.size:
            return None
        idx, lo = divmod(off, CHUNK)
        chunk = self._chunk(idx)
        return memoryview(chunk.buf)[lo : min(lo + n, chunk.hw)]

    def place(self, off: int, piece: memoryview | bytes) -> None:
        """The file's bytes at `off` (worker thread); a piece that `view`
        gave is in place already."""
        view = memoryview(piece).cast("B")
        if off + len(view) > self.size:
            raise OSError(errno.EIO, f"the store holds more than the file's {self.size} bytes")
        if is_hole(piece):
            return
        if self._fd >= 0:
            pwrite_all(self._fd, view, off)
            return
        while view:
            idx, lo = divmod(off, CHUNK)
            k = min(len(view), CHUNK - lo)
            chunk = self._chunk(idx)
            if view.obj is not chunk.buf:
                chunk.buf[lo : lo + k] = view[:k]
            off += k
            view = view[k:]

    def covers(self, off: int, end: int | None) -> bool:
        """Whether the bytes `off`..`end` (None: all) are served."""
        if end is None or not self._unshown:
            return not self._unshown
        end = min(end, self.size)
        return off >= end or end <= self.lead or all(self._shown[off // CHUNK : -(-end // CHUNK)])

    def show_lead(self, n: int) -> bool:
        """Serve the file's first `n` bytes, verified, before the rest of
        their chunk (owning thread). False if the load was dropped meanwhile."""
        if self.cancelled or self._data.loading is not self:
            return False
        self.lead = min(n, self.size)
        return True

    def read_lead(self, off: int, end: int) -> bytes | None:
        """A copy of the bytes `off`..`end` if they are in the lead and their
        chunk is not shown yet (None: read the file's chunks), from RAM
        (owning thread): the worker may be writing the rest of the chunk,
        which goes to the file only once shown, never to be recycled under
        the worker."""
        if end > self.lead or self._shown[0]:
            return None
        chunk = self._pending.get(0)
        return bytes(end - off) if chunk is None else bytes(memoryview(chunk.buf)[off:end])  # (no chunk: the lead is a hole)

    def show(self, off: int, end: int) -> bool:
        """Serve the bytes `off`..`end`, verified (owning thread): whole
        chunks, or up to the end of the file. False if the load was dropped
        meanwhile."""
        data = self._data
        if self.cancelled or data.loading is not self:
            return False
        end = min(end, self.size)
        assert off % CHUNK == 0 and (end % CHUNK == 0 or end == self.size)
        for idx in range(off // CHUNK, -(-end // CHUNK)):
            if self._shown[idx]:
                continue
            self._shown[idx] = 1
            self._unshown -= 1
            chunk = self._pending.pop(idx, None)
            if chunk is not None:
                data._chunks[idx] = chunk
                data.allocated += len(chunk.buf)
                self._reserved -= len(chunk.buf)
        if not self._unshown:
            data.resident = True
            data.loading = None
            data.unborrow()  # what it served is in RAM now
            self.release()
        return True

    def release(self) -> None:
        """Stop and give back what the load holds (owning thread; idempotent)."""
        self.cancelled = True
        if self._reserved:
            self._data._pool.unreserve(self._reserved)
            self._reserved = 0
        self._pending.clear()  # unmapped as they go (fresh chunks, never the pool's)
        if self._data.loading is self:  # dropped before the end: evicted again, nothing half-loaded stays
            self._data.loading = None
            self._data.evict(keep_borrow=True)  # (reads served in place go on: the file may have no other copy)


class Borrowing:
    """An evicted file read in place: from its file in a local store, which
    ckptfs never writes in place (a new generation is a new file renamed over
    the old one), through a descriptor of that very file (the name may move
    on, the bytes stay).

    A load verifies it block by block, as it would into RAM, and `show`
    serves each verified range (`show_lead` the file's first bytes, before
    the rest of their block). Nothing of the file goes into RAM for good,
    and a file larger than the RAM budget needs no spill file. If the store
    file's size or mtime change (someone wrote it in place), the borrow ends
    (`covers` says no): the next read loads and verifies it again.

    Where a block is verified, reads of it are served: the last few blocks
    verified are *held* (`hold`: read into chunks of the RAM budget, up to
    HELD_BYTES at a time) and reads of a held block are answered from those
    chunks without a copy; other blocks go through one small scratch buffer
    (`view`) and their reads come from the store file's page cache. A held block is
    let go once reads went past it (its pages in the store file's page cache
    go too: what the mount serves is in the mount's own page cache by then),
    or once no read came for HELD_IDLE_S; a load that would hold one more
    block waits for that (`hold` says None), so it keeps pace with its
    reader instead of running ahead of it through the page cache. It waits
    HELD_MAX_S at most per block: a load's deadline allows for a store's
    slowest rate, and waiting on a slow reader must not use that up.
    """

    spilled = False
    in_place = True

    def __init__(self, data: FileData) -> None:
        assert not data.resident and data.borrowed is None
        self.size = data.size
        self.cancelled = False  # the worker thread stops at its next piece
        self._data = data
        self._pool = data._pool
        self._fd = -1  # the store file, once the load opened it (`adopt`)
        self._stamp: tuple[int, int] | None = None
        self._nowait = True  # reads try the page cache alone first (RWF_NOWAIT)
        self._scratch: bytearray | None = None  # the worker's: what it verifies goes through here
        self._shown = bytearray(-(-self.size // CHUNK))  # per chunk: 1 once served
        self._unshown = len(self._shown)
        self.lead = 0  # the first bytes served before the rest of their chunk (`show_lead`)
        self._filling: _Held | None = None  # the block the worker reads into chunks now
        self._held: list[_Held] = []  # verified blocks whose reads are answered from their chunks, oldest first
        self._read_at = time.monotonic()  # when the file was last read (or the borrow began)
        self.dropped: list[tuple[int, int]] = []  # ranges of the store file read past: the worker lets their pages go
        data.borrowed = self

    def adopt(self, fd: int, opened: os.stat_result | None = None) -> None:
        """The load opened the store file: this descriptor (a copy, ours
        from now on) serves the reads (owning thread, before any `show`).
        `opened`: the file's status when the load opened it, before it read
        a byte (None: now); a write in place after that ends the borrow."""
        if self.cancelled or self._data.borrowed is not self:
            os.close(fd)
            return
        stamp = _stamp(os.fstat(fd) if opened is None else opened)  # if this fails, the descriptor is still the caller's
        self._fd, self._stamp = fd, stamp

    def close(self) -> None:
        """The worker is done with the file (worker thread)."""
        self._scratch = None

    def hold(self, off: int, n: int, pressed: bool) -> bool | None:
        """Owning thread, before the worker reads the block `off`..`off + n`:
        True if it goes into chunks of its own (then held once shown); False
        if through the scratch buffer (RAM is short, or the borrow ended);
        None: wait a moment and ask again (HELD_BYTES are held, and their
        reader is still at them). `pressed`: a reader waits for bytes not
        served yet, and the oldest held block goes now."""
        self._put_back(self._filling)  # a block that failed its check is never shown
        self._filling = None
        if self.cancelled or self._unshown == len(self._shown):
            # The first block a reader waits for goes through the scratch buffer: no fresh
            # memory before its first byte is served, and small reads (`view`).
            return False
        while self._held and sum(held.end - held.start for held in self._held) + n > HELD_BYTES:
            oldest, now = self._held[0], time.monotonic()
            if not (pressed or now - self._read_at > HELD_IDLE_S or now - oldest.since > HELD_MAX_S):
                return None
            self._let_go(oldest)
        need = -(-n // CHUNK)
        try:
            self._pool.reserve(need * CHUNK)
        except OSError:  # the budget is the files': this block goes through the page cache
            return False
        self._filling = _Held(off, off + n, [self._pool.take_kept() for _ in range(need)])  # the rest: fresh, made by the worker
        return True

    def view(self, off: int, n: int) -> memoryview | None:
        """Where the worker reads the next piece to verify (worker thread):
        the block's own chunks if it is held, else the same small scratch
        buffer every time; `place` keeps nothing.

        The scratch takes SCRATCH bytes at a time. The first block a reader
        waits for goes through it, and small reads bring a block's bytes
        sooner than large ones: the kernel's read-ahead starts small and
        grows while they are hashed, where one large read waits for all of
        its bytes (16 MiB of a cold file: 8-9 ms in reads of 64-256 KiB,
        13-14 ms in reads of 4-8 MiB; the first 4 KiB from a fresh mount:
        11.8 ms against 17.6 ms through a 4 MiB scratch)."""
        if self.cancelled:
            return None
        filling = self._filling
        if filling is not None and filling.start <= off < filling.end:
            idx, lo = divmod(off - filling.start, CHUNK)
            if filling.chunks[idx] is None:  # made ahead by the pool's thread, or faulted in here: off the event loop
                filling.chunks[idx] = self._pool.take_made() or new_chunk()
            return memoryview(filling.chunks[idx])[lo : lo + min(n, CHUNK - lo, filling.end - off)]
        if self._scratch is None:
            self._scratch = bytearray(SCRATCH)
        return memoryview(self._scratch)[: min(n, SCRATCH)]

    def place(self, off: int, piece: memoryview | bytes) -> None:
        if off + len(piece) > self.size:
            raise OSError(errno.EIO, f"the store holds more than the file's {self.size} bytes")
        filling = self._filling
        if filling is not None and filling.start <= off < filling.end and is_hole(piece):
            filling.whole = False  # a hole was not read into the chunks: its reads go to the store file

    def covers(self, off: int, end: int | None) -> bool:
        """Whether the bytes `off`..`end` (None: all) are served, from a store
        file unchanged since it was verified (if it changed, the borrow ends)."""
        if end is not None and off >= min(end, self.size):
            return True
        if self._fd < 0:
            return False
        if self._stamp != _stamp(os.fstat(self._fd)):
            log.warning("a file in the store changed in place while reads were served from it: verifying it again")
            self.release()
            return False
        if end is None or not self._unshown:
            return not self._unshown
        end = min(end, self.size)
        return end <= self.lead or all(self._shown[off // CHUNK : -(-end // CHUNK)])

    def show_lead(self, n: int) -> bool:
        """Serve the file's first `n` bytes, verified, before the rest of
        their block (owning thread, once `adopt`ed). False if the borrow
        ended meanwhile."""
        if self.cancelled or self._data.borrowed is not self or self._fd < 0:
            return False
        self.lead = min(n, self.size)
        return True

    def show(self, off: int, end: int) -> bool:
        """Serve the bytes `off`..`end`, verified (owning thread). False if
        the borrow ended meanwhile."""
        if self.cancelled or self._data.borrowed is not self or self._fd < 0:
            return False
        end = min(end, self.size)
        filling, self._filling = self._filling, None
        if filling is not None and filling.start == off and filling.end == end and filling.whole:
            filling.since = time.monotonic()
            self._held.append(filling)
        else:
            self._put_back(filling)
        for idx in range(off // CHUNK, -(-end // CHUNK)):
            if not self._shown[idx]:
                self._shown[idx] = 1
                self._unshown -= 1
        return True

    def let_go_held(self) -> int:
        """Let go of every block held (RAM is wanted for files: the reader
        reads on from the store file); returns the bytes freed."""
        freed = sum(len(held.chunks) for held in self._held) * CHUNK
        for held in list(self._held):
            self._let_go(held)
        return freed

    def let_go_idle(self) -> float | None:
        """Let go of the held blocks if no read came for them lately
        (owning thread); None if none is held now, else when to look again
        (seconds)."""
        idle = time.monotonic() - self._read_at
        if idle >= HELD_IDLE_S:
            for held in list(self._held):
                self._let_go(held)
        return HELD_IDLE_S - idle if self._held else None

    def read(self, off: int, end: int) -> bytes | bytearray | memoryview:
        """The bytes `off`..`end`: a view of a held block's chunks (valid
        until the owning thread's next step), or from the store file if
        its page cache has them all (just verified, they mostly are); else
        `WouldBlock`: the caller reads them off its thread (a store on a
        network file system could hold the event loop, and every other
        request, for as long)."""
        self._read_at = time.monotonic()
        for held in [h for h in self._held if h.end <= off]:  # read past: not read again (the mount's page cache has it)
            self._let_go(held, True)
        for held in self._held:
            if held.start <= off and end <= held.end:
                return held.read(off, end)
        if self._nowait:
            buf = bytearray(end - off)
            try:
                if os.preadv(self._fd, [buf], off, os.RWF_NOWAIT) == len(buf):
                    return buf
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self._nowait = False  # this file system cannot say: every read goes off the thread
        raise WouldBlock(self, off, end)

    @property
    def fd(self) -> int:
        return self._fd

    def release(self) -> None:
        """End the borrow (owning thread; idempotent)."""
        self.cancelled = True
        for held in list(self._held):
            self._let_go(held)
        self._put_back(self._filling, reuse=False)  # the worker may be reading into it still
        self._filling = None
        if self._data.borrowed is self:
            self._data.borrowed = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _let_go(self, held: _Held, read_past: bool = False) -> None:
        self._held.remove(held)
        self._put_back(held)
        if read_past:
            self.dropped.append((held.start, held.end - held.start))

    def _put_back(self, held: _Held | None, reuse: bool = True) -> None:
        """A block's chunks go back to the budget, and to its stock of chunks
        to reuse. A view of them handed to a FUSE reply is gone by then: the
        reply is sent in the same step of the owning thread as the read that
        made it. `reuse` False: the worker may still be writing into them;
        each is unmapped once nothing refers to it any more."""
        if held is None:
            return
        self._pool.unreserve(len(held.chunks) * CHUNK)
        if reuse:
            for chunk in held.chunks:
                if chunk is not None:
                    self._pool.give_chunk(chunk)


class _Held:
    """A block of a borrowed file read into chunks: the bytes `start`..`end`."""

    __slots__ = ("chunks", "end", "since", "start", "whole")

    def __init__(self, start: int, end: int, chunks: list[mmap.mmap | None]) -> None:
        self.start, self.end, self.chunks = start, end, chunks
        self.whole = True  # every byte was read into the chunks (no hole left out)
        self.since = 0.0  # when it was shown

    def read(self, off: int, end: int) -> memoryview | bytes:
        idx, lo = divmod(off - self.start, CHUNK)
        if lo + end - off <= CHUNK:  # within one chunk: a view, no copy
            return memoryview(self.chunks[idx])[lo : lo + end - off]
        parts, pos = [], off
        while pos < end:
            idx, lo = divmod(pos - self.start, CHUNK)
            hi = min(CHUNK, lo + end - pos)
            parts.append(memoryview(self.chunks[idx])[lo:hi])
            pos += hi - lo
        return b"".join(parts)


class WouldBlock(Exception):
    """A read of a borrowed file would wait for the store's disk: run what
    `reader()` gives in a worker thread (it reads from a descriptor of its
    own), then ask `still_served` on the owning thread before using the bytes."""

    def __init__(self, borrowing: Borrowing, off: int, end: int) -> None:
        super().__init__("a read that waits for the store's disk")
        self.borrowing, self.off, self.end = borrowing, off, end

    def reader(self) -> Callable[[], bytes]:
        """The blocking read (owning thread: the descriptor is copied now, so
        the borrow may end meanwhile)."""
        fd, off, n = os.dup(self.borrowing.fd), self.off, self.end - self.off

        def read() -> bytes:
            try:
                data = os.pread(fd, n, off)
            finally:
                os.close(fd)
            return data + bytes(n - len(data))

        return read

    def still_served(self) -> bool:
        """Whether the borrow still serves these bytes from the same, unchanged
        store file (else the read starts again)."""
        return self.borrowing.covers(self.off, self.end)


def _stamp(st: os.stat_result) -> tuple[int, int]:
    """What a write in place changes (not the ctime: the publisher's chmod
    and rename of the file change that)."""
    return st.st_size, st.st_mtime_ns
