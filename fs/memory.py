"""The RAM budget and the memory files are made of.

`MemoryPool` owns the RAM budget and a small stock of recycled chunks, made
ahead (faulted in) by a thread of its own and given back to the OS past the
stock's bounds; a `Chunk` is one piece of a file's bytes, counted by its
holders. What a file holds is `filedata.FileData`; how an evicted file's
bytes come back, `loading`. Nothing here knows about FUSE, inodes or paths.

Why chunks: a save must never copy what it already wrote (no realloc of a
growing buffer), holes must cost nothing (`truncate -s 1P` allocates no
memory), and freed memory must go back to the OS so the daemon's RSS tracks
the data it holds. Large chunks are anonymous mmaps (returned to the OS on
close, prefaulted in a few system calls instead of a page fault per 4 KiB,
with the GIL let go meanwhile, ahead of the writes that take them); small
files live in bytearrays sized to their content.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading

from ckptfs.holes import ZEROS

log = logging.getLogger(__name__)

CHUNK = 4 << 20  # big enough to keep mmap counts low (vm.max_map_count)
MADE_AHEAD = 8  # fresh chunks the pool keeps made ahead while writes take them (`MemoryPool._tend`)
TEND_IDLE_S = 1.0  # the pool's thread ends after this long with nothing to do
SMALL_MAX = 256 << 10  # below this a chunk is a bytearray sized to its content
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+ (not in the mmap module of Python 3.11)
_libc = ctypes.CDLL(None, use_errno=True)  # (a CDLL's calls let go of the GIL)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_populate_write = True  # madvise(MADV_POPULATE_WRITE) works here (`new_chunk`)
_POPULATE_STEP = 1 << 20  # faulted in this much per system call (`new_chunk`)
assert len(ZEROS) == CHUNK  # a hole piece covers at most one chunk


class MemoryPool:
    """The RAM budget shared by every file, plus a stock of chunks ready to
    write into.

    `used` counts exactly the bytes held by file contents (chunk capacities).
    The stock (`kept`) holds chunks already faulted in: those freed by
    deletes, truncates and evictions, and fresh ones made ahead while writes
    take them. Together they stay within `reuse` bytes and within what the
    budget leaves free beside the file data. Writing into memory already
    faulted in is several times faster than into fresh memory on VMs that
    hand freed pages back to the host. (MADV_FREE on kept chunks was
    measured: rewriting lazily-freed pages costs twice as much.) Every other
    freed chunk goes back to the OS, so the daemon's RSS follows the data it
    holds.

    The system calls behind both run in a thread of the pool's own (`_tend`),
    the GIL let go, not on the event loop, which answers every request to
    the mount (it makes a chunk itself only when the thread has none ready
    for it): faulting in a fresh chunk costs 1.1-1.5 ms on a VM (0.58 s of a
    2 GiB save, which took 1.12 s made ahead where it took 1.50), unmapping
    one 0.25 ms (a stall of 70 ms per GiB deleted or evicted past the stock).
    A chunk let go but not unmapped yet (`_dying`) is as good as a kept one:
    writes take it before any fresh memory, so the RSS never grows while it
    waits. The thread runs while there is work, and ends after
    `TEND_IDLE_S` without.

    Everything but that thread runs on one thread (the event loop), but for
    `take_made`, which loads' workers call; `_lock` makes the thread's steps,
    those takes and the accounting of the budget one against the other.
    """

    def __init__(self, limit: int, reuse: int | None = None, made_ahead: int = MADE_AHEAD) -> None:
        self.limit = limit
        self.reuse = limit if reuse is None else min(reuse, limit)
        self.made_ahead = made_ahead  # fresh chunks to have ready (0: each is made when a write takes it)
        self.used = 0
        self._freed: list[mmap.mmap] = []  # recycled, taken last in first out
        self._made: collections.deque[mmap.mmap] = collections.deque()  # made ahead
        self._dying: collections.deque[mmap.mmap] = collections.deque()  # let go past the stock's bounds, to unmap
        self._unmapping = False  # the thread is unmapping one, taken off `_dying`
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)  # notified once nothing is left to unmap
        self._wanted = threading.Event()  # work for the thread: chunks to unmap, or to make
        self._thread: threading.Thread | None = None  # (None while it has nothing to do)

    @property
    def available(self) -> int:
        return max(0, self.limit - self.used)

    @property
    def kept(self) -> int:
        return (len(self._freed) + len(self._made)) * CHUNK

    def reserve(self, nbytes: int) -> None:
        """Account `nbytes` more, or raise ENOSPC leaving nothing changed."""
        with self._lock:
            if self.used + nbytes > self.limit:  # the caller evicts, spills or fails, and says so
                raise OSError(errno.ENOSPC, "ckptfs RAM budget exhausted")
            self.used += nbytes
            while self.used + self.kept > self.limit:
                self._dying.append(self._made.pop() if self._made else self._freed.pop())
                self._wake()

    def unreserve(self, nbytes: int) -> None:
        self.used -= nbytes

    def take_chunk(self) -> mmap.mmap:
        chunk = self.take_kept() or new_chunk()
        self._top_up()
        return chunk

    def take_made(self) -> mmap.mmap | None:
        """A fresh chunk made ahead (all zeros), if any; from any thread: a
        load's worker takes them, its bytes reserved already (`Loading`)."""
        with self._lock:
            chunk = self._made.popleft() if self._made else None
        self._top_up()
        return chunk

    def take_kept(self) -> mmap.mmap | None:
        """A chunk of the stock, or one let go and not unmapped yet, if any
        (already faulted in)."""
        if self._freed:
            return self._freed.pop()
        if self._dying:
            with self._lock:
                if self._dying and len(self._dying[-1]) == CHUNK:
                    return self._dying.pop()
        with contextlib.suppress(IndexError):
            return self._made.popleft()
        return None

    def give_chunk(self, chunk: mmap.mmap) -> None:
        with self._lock:
            if len(chunk) != CHUNK:  # (a fitted last chunk) unmapped first: no write could take it
                self._dying.appendleft(chunk)
            elif self._has_room():
                self._freed.append(chunk)
                return
            else:
                self._dying.append(chunk)
            self._wake()

    def wait_returned(self, timeout: float) -> bool:
        """Wait until every chunk let go is unmapped (given back to the OS);
        False if some are not after `timeout` seconds."""
        with self._returned:
            return self._returned.wait_for(lambda: not self._dying and not self._unmapping, timeout)

    def _has_room(self) -> bool:
        """The stock may hold one chunk more."""
        return self.kept + CHUNK <= self.reuse and self.used + self.kept + CHUNK <= self.limit

    def _top_up(self) -> None:
        """A chunk was taken: have the thread make more ahead, if room."""
        with self._lock:
            if len(self._made) < self.made_ahead and self._has_room():
                self._wake()

    def _wake(self) -> None:
        """There is work for the pool's thread: start it if none runs (with
        `_lock` held). One that cannot start (the system's thread limit) is
        tried again at the next wake; meanwhile what waits to be unmapped is
        still what writes take first, and no write or delete fails for it."""
        self._wanted.set()
        if self._thread is None:
            thread = threading.Thread(target=self._tend, name="ckptfs-memory", daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:
                log.warning("the memory pool's thread did not start (%s): freed memory waits to go back to the OS", exc)
                return
            self._thread = thread

    def _tend(self) -> None:
        """The pool's thread: unmap what was let go, then fault in fresh
        chunks for the writes to come (`made_ahead`), the GIL let go in
        both; it ends once woken by nothing for `TEND_IDLE_S`."""
        while True:
            if not self._wanted.wait(TEND_IDLE_S):
                with self._lock:
                    if not self._wanted.is_set():
                        self._thread = None
                        return
                continue
            self._wanted.clear()
            while self._unmap_one():
                pass
            while not self._dying and len(self._made) < self.made_ahead and self._has_room() and self._make_one():
                pass

    def _unmap_one(self) -> bool:
        """Unmap the oldest chunk let go; False when there is none left."""
        with self._lock:
            if not self._dying:
                self._unmapping = False
                self._returned.notify_all()
                return False
            chunk = self._dying.popleft()
            self._unmapping = True
        _unmap(chunk)
        return True

    def _make_one(self) -> bool:
        """Add a fresh chunk to those made ahead; False if it could not be
        made, or is not wanted any more (the budget changed meanwhile)."""
        try:
            chunk = new_chunk()
        except (OSError, MemoryError) as exc:  # the system is short of memory: the writes make their own
            log.debug("no chunk made ahead: %s", exc)
            return False
        with self._lock:
            if not self._dying and len(self._made) < self.made_ahead and self._has_room():
                self._made.append(chunk)
                return True
        _unmap(chunk)
        return False


def new_chunk(size: int = CHUNK) -> mmap.mmap:
    """A chunk of fresh memory, faulted in (any thread: no accounting).

    Python's mmap holds the GIL through the system call, and faulting in
    4 MiB takes 1-1.5 ms on a VM: a worker thread that made a chunk with
    MAP_POPULATE held the event loop, and every FUSE reply, that long. It
    maps the chunk alone and faults it in through madvise, the GIL let go
    (MAP_POPULATE where the kernel is older than 5.14), a step at a time:
    the kernel's lock on the memory map is held through each step, and any
    thread that maps or unmaps memory meanwhile (the event loop making a
    chunk for a write, the allocator growing) waits for it. (Huge pages
    were tried: 0.2 ms a chunk once there are free ones, but a save into a
    mount holding 2 GiB already took 5.4 s where it took 2.0, the kernel
    compacting memory for them.)"""
    global _populate_write
    if not _populate_write:
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    chunk = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    at = ctypes.c_char.from_buffer(chunk)
    try:
        start = ctypes.addressof(at)
        for off in range(0, size, _POPULATE_STEP):
            if _libc.madvise(start + off, min(_POPULATE_STEP, size - off), _MADV_POPULATE_WRITE) != 0:
                _populate_write = ctypes.get_errno() != errno.EINVAL  # EINVAL: a kernel that has no such advice
                break  # (the rest faults in when touched)
    finally:
        del at  # (a buffer export: the chunk could not be closed while it lived)
    return chunk


def _unmap(chunk: mmap.mmap) -> None:
    """Return a chunk to the OS now, or, while a view of it lives on, when
    that view goes (mmap unmaps itself once nothing refers to it). A view
    can outlive its file: the traceback of a failed load or upload keeps the
    memoryviews its frames read through, and a store's client library may
    keep a failed request's body."""
    with contextlib.suppress(BufferError):
        chunk.close()


def _small_capacity(needed: int) -> int:
    cap = 64  # a 100-byte file holds 128 bytes, not a page: what 100,000 small files cost is mostly this
    while cap < needed:
        cap <<= 1
    return cap


class Chunk:
    """One chunk of a file. Bytes at or beyond `hw` (the initialised prefix)
    may hold stale data from a recycled chunk and read as zeros.

    `refs` counts the holders: the live file and any snapshots. A chunk with
    more than one holder is frozen: a write copies it first (copy-on-write).
    """

    __slots__ = ("buf", "hw", "refs")

    def __init__(self, buf: mmap.mmap | bytearray, hw: int = 0) -> None:
        self.buf = buf
        self.hw = hw
        self.refs = 1


def unref(chunk: Chunk, pool: MemoryPool) -> None:
    chunk.refs -= 1
    if chunk.refs == 0:
        pool.unreserve(len(chunk.buf))
        if isinstance(chunk.buf, mmap.mmap):
            pool.give_chunk(chunk.buf)


def ram_for(size: int) -> int:
    """What a file of `size` bytes takes of the RAM budget loaded whole (a
    load reserves that much up front): the capacity of each chunk."""
    return sum(fitted(min(CHUNK, size - i * CHUNK)) for i in range(-(-size // CHUNK)))


def fitted(length: int) -> int:
    """The capacity of a chunk whose length is known and final (a load's):
    a chunk of its own size, in pages, up to half a CHUNK (a file of 5 MiB
    takes 5 MiB, not 8); a CHUNK beyond, to be recycled."""
    if length <= SMALL_MAX:
        return _small_capacity(length)
    return CHUNK if length > CHUNK // 2 else -(-length // mmap.PAGESIZE) * mmap.PAGESIZE


def capacity(needed: int) -> int:
    return CHUNK if needed > SMALL_MAX else _small_capacity(needed)


def total_ram(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The memory this process may use: the machine's, or less where a
    cgroup caps it (a container's limit: Kubernetes, Docker, systemd). Past
    that, the kernel kills the daemon for memory, with every file it has
    not published yet."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min([physical, *_cgroup_limits(proc_cgroup, cgroup_root)])


def _cgroup_limits(proc_cgroup: str, cgroup_root: str) -> list[int]:
    """The memory limits of this process's cgroup and of each cgroup above
    it, those this process can see (cgroup v2's memory.max, v1's
    memory.limit_in_bytes; in a container the cgroup's own path is often not
    visible, and its limit is at the root of what is)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            base, name = cgroup_root, "memory.max"  # v2
        elif "memory" in controllers.split(","):
            base, name = os.path.join(cgroup_root, "memory"), "memory.limit_in_bytes"  # v1
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            try:
                with open(os.path.join(base, *parts[:depth], name)) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit():  # v2 writes "max" for none; v1 a number near 2^63
                limits.append(int(text))
    return limits
