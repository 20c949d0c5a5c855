"""FileData and MemoryPool: sparse chunked contents and exact accounting."""

import ctypes
import errno
import mmap
import os
import resource
import signal
import threading
import time

import pytest
from ckptfs.fs import loading, memory
from ckptfs.fs.filedata import FileData
from ckptfs.fs.loading import Borrowing, Loading
from ckptfs.fs.memory import CHUNK, MemoryPool, total_ram
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfs.holes import read_sparse, zeros


def test_write_read_across_chunks():
    f = FileData(MemoryPool(1 << 30))
    payload = bytes(range(256)) * (3 * CHUNK // 256 + 7)
    f.write(CHUNK - 100, payload)
    assert f.size == CHUNK - 100 + len(payload)
    assert f.read(CHUNK - 100, len(payload)) == payload
    assert f.read(0, CHUNK - 100) == bytes(CHUNK - 100)  # the hole reads as zeros


def test_huge_truncate_allocates_nothing():
    pool = MemoryPool(1 << 20)
    f = FileData(pool)
    f.truncate(999_999_999_999_999)
    assert f.size == 999_999_999_999_999 and pool.used == 0
    assert f.read(10**14, 4096) == bytes(4096)


def test_shrink_then_grow_reads_zeros():
    f = FileData(MemoryPool(1 << 30))
    f.write(0, b"x" * 10000)
    f.truncate(10)
    f.truncate(5000)
    assert f.read(0, 5000) == b"x" * 10 + bytes(4990)


def test_recycled_chunk_never_leaks_old_bytes():
    pool = MemoryPool(1 << 30, made_ahead=0)
    a = FileData(pool)
    a.write(0, b"\xff" * (2 * CHUNK))
    a.clear()
    assert pool.kept == 2 * CHUNK
    b = FileData(pool)
    b.write(CHUNK // 2, b"y" * SMALLISH)  # lands in a recycled chunk, past a gap
    assert pool.kept == CHUNK
    assert b.read(0, CHUNK // 2) == bytes(CHUNK // 2)
    b.truncate(CHUNK)
    assert b.read(CHUNK // 2 + SMALLISH, 100) == bytes(100)


SMALLISH = 300 << 10


def test_accounting_is_exact_and_freed():
    pool = MemoryPool(64 << 20)
    f = FileData(pool)
    f.write(0, b"a" * 5000)
    assert pool.used == f.allocated == 8192  # small files take what they need
    f.write(0, b"a" * (1 << 20))
    assert pool.used == f.allocated == CHUNK
    f.clear()
    assert pool.used == 0 and f.allocated == 0


def test_budget_enforced_atomically():
    pool = MemoryPool(CHUNK)
    f = FileData(pool)
    f.write(0, b"a" * CHUNK)
    with pytest.raises(OSError) as exc:
        f.write(CHUNK, b"b")
    assert exc.value.errno == errno.ENOSPC
    assert f.size == CHUNK and f.read(CHUNK - 1, 10) == b"a"


def test_kept_chunks_never_exceed_budget():
    pool = MemoryPool(3 * CHUNK, made_ahead=0)
    f = FileData(pool)
    f.write(0, b"a" * 3 * CHUNK)
    f.clear()
    assert pool.kept == 3 * CHUNK
    g = FileData(pool)
    g.write(0, b"b" * 10)  # small: reserves a little, must drop a kept chunk
    assert pool.used + pool.kept <= pool.limit


def test_a_kept_chunk_that_something_still_views_is_let_go_not_closed_under_a_writer():
    """A view of a file's bytes can outlive the file: a failed load's or
    upload's traceback holds the memoryviews its frames read through, and a
    library may keep a request body after it failed. Its chunk, kept for
    reuse once the file went, cannot be unmapped while that view lives
    (mmap.close raises BufferError): a write that needed the room failed
    with EIO ("unexpected error in write") during a store outage."""
    pool = MemoryPool(3 * CHUNK, made_ahead=0)
    f = FileData(pool)
    f.write(0, b"a" * 3 * CHUNK)
    lingering = [memoryview(f.read(i * CHUNK, CHUNK)) for i in range(3)]  # as a traceback keeps them
    f.clear()
    assert pool.kept == 3 * CHUNK
    g = FileData(pool)
    g.write(0, b"b" * 10)  # needs room a kept chunk takes: it must go, viewed or not
    assert g.read(0, 10) == b"b" * 10
    assert pool.used + pool.kept <= pool.limit
    assert all(bytes(v[:1]) == b"a" for v in lingering)  # the views stay valid: unmapped when they go
    for v in lingering:
        v.release()


_libc = ctypes.CDLL(None, use_errno=True)


def _resident(chunk: mmap.mmap) -> int:
    """How many bytes of `chunk` are in RAM (mincore): the process's RSS
    would count whatever else it maps or frees meanwhile, such as an
    earlier test's pools, collected or still tending their stock."""
    at = ctypes.c_char.from_buffer(chunk)
    try:
        pages = (ctypes.c_ubyte * (len(chunk) // mmap.PAGESIZE))()
        if _libc.mincore(ctypes.c_void_p(ctypes.addressof(at)), ctypes.c_size_t(len(chunk)), pages) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(p & 1 for p in pages) * mmap.PAGESIZE
    finally:
        del at  # (a buffer export: the chunk could not be closed while it lived)


def test_fresh_memory_is_faulted_in_without_holding_the_gil_or_the_memory_map():
    """A load's worker thread makes fresh chunks for the bytes it reads.
    Python's mmap holds the GIL through mmap(MAP_POPULATE): the event loop
    (every FUSE reply) stood still 1-1.5 ms per 4 MiB chunk, the first byte
    after a restart among them; and the kernel holds the process's memory
    map through a populate: the event loop making a chunk of its own (a
    write) waited for all of it. Here the main thread must run Python, and
    map memory, while another thread's chunk is being faulted in, and the
    chunk must come back faulted in."""
    size = 256 << 20
    started, took, made = [], [], []

    def make() -> None:
        started.append(time.monotonic())
        chunk = memory.new_chunk(size)
        took.append(time.monotonic() - started[0])
        made.append(_resident(chunk))
        chunk.close()

    worker = threading.Thread(target=make)
    worker.start()
    last, gap = None, 0.0  # when this thread last ran while the chunk was being made; the longest it did not
    while worker.is_alive():
        if started and not took:
            mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS).close()  # as the event loop does for a write
            now = time.monotonic()
            gap = max(gap, now - (started[0] if last is None else last))
            last = now
    worker.join()
    assert made[0] == size  # faulted in, not merely mapped
    if not memory._populate_write:
        pytest.skip("a kernel older than 5.14 (no MADV_POPULATE_WRITE): chunks are made with MAP_POPULATE, the GIL held")
    # Held, the GIL (or the memory map) lets this thread in only before the
    # system call and right after it: one gap as long as the call itself.
    gap = max(gap, started[0] + took[0] - (started[0] if last is None else last))
    assert gap < took[0] / 2, (gap, took[0])


def _settled(pool: MemoryPool) -> None:
    """Wait for the pool's thread to have nothing left to do: what was let
    go is unmapped, and the stock is full or the bounds leave no room for a
    chunk more."""
    assert pool.wait_returned(10), "chunks let go were never unmapped"
    deadline = time.monotonic() + 10
    while len(pool._made) < pool.made_ahead and pool._has_room():
        assert time.monotonic() < deadline, "no chunks made ahead"
        time.sleep(0.01)


def test_fresh_chunks_are_made_ahead_of_the_writes_that_take_them():
    """A save into fresh memory had each chunk faulted in on the event loop
    as a write reached it (1-1.5 ms per 4 MiB, every request to the mount
    held meanwhile: 0.58 s of a 2 GiB save). A thread of the pool's own now
    has chunks made, faulted in, before the writes come for them."""
    pool = MemoryPool(1 << 30, reuse=256 << 20)
    f = FileData(pool)
    f.write(0, b"a" * CHUNK)  # the first chunk: made on the spot, and the pool's thread starts
    _settled(pool)
    assert len(pool._made) == memory.MADE_AHEAD and pool.kept == memory.MADE_AHEAD * CHUNK
    assert [_resident(c) for c in pool._made] == [CHUNK] * memory.MADE_AHEAD  # faulted in, not merely mapped
    made = set(map(id, pool._made))
    f.write(CHUNK, b"b" * (3 * CHUNK))  # written into chunks made ahead, which are made again behind them
    assert {id(f._chunks[i].buf) for i in (1, 2, 3)} <= made
    _settled(pool)
    assert len(pool._made) == memory.MADE_AHEAD
    assert f.read(0, 4 * CHUNK) == b"a" * CHUNK + b"b" * (3 * CHUNK) and pool.used == 4 * CHUNK


def test_chunks_made_ahead_stay_within_the_reuse_bound_and_the_budget():
    """Made ahead, chunks are RAM the data does not hold: like recycled ones,
    at most `reuse` of them, never past the budget beside the data, and they
    give way to the data the moment it needs the room."""
    pool = MemoryPool(1 << 30, reuse=2 * CHUNK)
    FileData(pool).write(0, b"a" * CHUNK)
    _settled(pool)
    assert pool.kept == 2 * CHUNK
    pool = MemoryPool(4 * CHUNK)  # reuse: the whole budget
    f = FileData(pool)
    f.write(0, b"a" * (2 * CHUNK))
    _settled(pool)
    assert pool.used == 2 * CHUNK and pool.kept == 2 * CHUNK
    f.write(2 * CHUNK, b"b" * (2 * CHUNK))  # the data takes the room: the stock goes first
    _settled(pool)
    assert pool.used == 4 * CHUNK and pool.kept == 0
    assert f.read(0, 4 * CHUNK) == b"a" * (2 * CHUNK) + b"b" * (2 * CHUNK)
    pool = MemoryPool(1 << 30, reuse=0)  # none kept: none made ahead, no thread either
    FileData(pool).write(0, b"a" * (2 * CHUNK))
    assert pool.kept == 0 and pool._thread is None


def test_the_pools_thread_ends_when_idle_and_starts_again_with_work(monkeypatch):
    monkeypatch.setattr(memory, "TEND_IDLE_S", 0.05)
    pool = MemoryPool(1 << 30, reuse=64 << 20)
    f = FileData(pool)
    for round_ in range(2):
        f.write(round_ * 8 * CHUNK, b"x" * (8 * CHUNK))  # takes every chunk made ahead, and one more
        assert pool._thread is not None
        thread = pool._thread
        deadline = time.monotonic() + 10
        while thread.is_alive():
            assert time.monotonic() < deadline, "the pool's thread never ends"
            time.sleep(0.01)
        assert pool._thread is None and len(pool._made) == memory.MADE_AHEAD  # its stock stays for the next save


def _unmaps_seen(monkeypatch, hold: threading.Event | None = None) -> list[tuple[str, int]]:
    """Record each chunk unmapped, by thread name and size; with `hold`, the
    pool's thread waits for it before its first unmap."""
    seen: list[tuple[str, int]] = []
    unmap = memory._unmap

    def recorded(chunk):
        if hold is not None and threading.current_thread().name == "ckptfs-memory":
            assert hold.wait(10)
        seen.append((threading.current_thread().name, len(chunk)))
        unmap(chunk)

    monkeypatch.setattr(memory, "_unmap", recorded)
    return seen


def test_memory_let_go_past_the_stock_goes_back_to_the_os_off_the_event_loop(monkeypatch):
    """Unmapping a chunk costs 0.25 ms: deleting or evicting a file past what
    the stock keeps held every request to the mount for 70 ms per GiB (a
    stat waited 139-288 ms while a 4 GiB file went). The pool's thread
    unmaps them now, and an evict can wait for it (`wait_returned`)."""
    seen = _unmaps_seen(monkeypatch)
    pool = MemoryPool(1 << 30, reuse=2 * CHUNK, made_ahead=0)
    f = FileData(pool)
    f.write(0, os.urandom(1 << 20) * 40)  # 10 chunks
    chunks = [c.buf for c in f._chunks.values()]
    f.clear()  # 2 kept, 8 let go
    assert pool.wait_returned(10) and pool.used == 0 and pool.kept == 2 * CHUNK
    assert sorted(seen) == [("ckptfs-memory", CHUNK)] * 8, seen
    assert sum(c.closed for c in chunks) == 8  # unmapped: given back to the OS
    seen.clear()
    pool.reserve(pool.limit - CHUNK)  # the data needs room the stock holds: one kept chunk is let go too
    assert pool.kept == CHUNK and pool.wait_returned(10)
    assert seen == [("ckptfs-memory", CHUNK)], seen


def test_a_pool_thread_that_cannot_start_fails_no_delete_and_is_started_again(monkeypatch):
    """At the system's thread limit `Thread.start` raises: a delete (or a
    write making room) that woke the pool's thread then failed with EIO, and
    the thread was never started again, so what was let go stayed mapped."""
    pool = MemoryPool(1 << 30, reuse=0, made_ahead=0)
    f = FileData(pool)
    f.write(0, b"a" * (2 * CHUNK))
    start = threading.Thread.start

    def refused(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refused)
    f.clear()  # let go, and nothing to unmap it yet
    assert pool._thread is None and len(pool._dying) == 2 and pool.used == 0
    monkeypatch.setattr(threading.Thread, "start", start)
    g = FileData(pool)
    g.write(0, b"b" * CHUNK)  # takes one of them
    g.clear()  # the next wake starts the thread
    assert pool.wait_returned(10) and not pool._dying


def test_a_chunk_let_go_and_not_unmapped_yet_is_the_next_writes_memory(monkeypatch):
    """A chunk waiting for the pool's thread to unmap it is as good as a kept
    one: a write takes it before making fresh memory, so the RSS does not
    grow while memory is on its way back, and it shows none of its old
    bytes."""
    hold = threading.Event()
    seen = _unmaps_seen(monkeypatch, hold)
    pool = MemoryPool(1 << 30, reuse=0, made_ahead=0)
    f = FileData(pool)
    f.write(0, b"\xff" * (4 * CHUNK))
    let_go = {id(c.buf) for c in f._chunks.values()}
    f.clear()  # the thread takes one and waits at `hold`: three wait in `_dying`
    deadline = time.monotonic() + 10
    while len(pool._dying) != 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    pool.give_chunk(memory.new_chunk(1 << 20))  # (a fitted last chunk: no write can take it, nor is it in the way)
    g = FileData(pool)
    g.write(CHUNK // 2, b"y" * 100)  # past a gap, into a chunk let go
    g.write(CHUNK + (1 << 20), b"z")
    assert {id(g._chunks[0].buf), id(g._chunks[1].buf)} <= let_go and len(pool._dying) == 2
    assert g.read(0, 2 * CHUNK) == bytes(CHUNK // 2) + b"y" * 100 + bytes(CHUNK // 2 - 100 + (1 << 20)) + b"z"  # (and no old byte)
    assert not pool.wait_returned(0.05)  # one still being unmapped, one waiting
    hold.set()
    assert pool.wait_returned(10) and not pool._dying and sorted(n for _, n in seen) == [1 << 20, CHUNK, CHUNK]


def test_kept_chunks_never_exceed_the_reuse_bound():
    pool = MemoryPool(8 * CHUNK, reuse=2 * CHUNK, made_ahead=0)
    f = FileData(pool)
    f.write(0, b"a" * 6 * CHUNK)
    f.clear()  # the rest is unmapped: returned to the OS
    assert pool.used == 0 and pool.kept == 2 * CHUNK
    assert MemoryPool(CHUNK, reuse=8 * CHUNK).reuse == CHUNK  # never more than the budget


ops = st.lists(
    st.one_of(
        st.tuples(st.just("w"), st.integers(0, 3 * CHUNK), st.integers(1, CHUNK + 10), st.integers(0, 255)),
        st.tuples(st.just("t"), st.integers(0, 3 * CHUNK)),
        st.tuples(st.just("f")),
    ),
    max_size=12,
)


@settings(deadline=None)
@given(ops)
def test_matches_a_bytearray_model(sequence):
    pool = MemoryPool(1 << 30)
    f = FileData(pool)
    model = bytearray()
    for op in sequence:
        if op[0] == "w":
            _, off, n, val = op
            data = bytes([val]) * n
            f.write(off, data)
            if off > len(model):
                model.extend(bytes(off - len(model)))
            model[off : off + n] = data
        elif op[0] == "t":
            size = op[1]
            f.truncate(size)
            model = model[:size] + bytearray(max(0, size - len(model)))
        else:
            f.fit()
        assert f.size == len(model) and pool.used == f.allocated
    assert f.read(0, len(model) + 10) == bytes(model)
    f.clear()
    assert pool.used == 0


def test_snapshot_is_copy_on_write():
    pool = MemoryPool(1 << 30)
    f = FileData(pool)
    f.write(0, b"a" * (CHUNK + 10))
    used = pool.used
    snap = f.snapshot()
    assert pool.used == used  # a snapshot costs nothing until the file changes
    f.write(5, b"b")  # touches chunk 0 only: it is copied
    assert pool.used == used + CHUNK
    assert b"".join(bytes(p) for p in snap.pieces()) == b"a" * (CHUNK + 10)
    assert f.read(0, 7) == b"aaaaaba"
    f.truncate(0)
    assert b"".join(bytes(p) for p in snap.pieces()) == b"a" * (CHUNK + 10)
    snap.release()
    assert pool.used == 0


def test_snapshot_pieces_include_holes():
    f = FileData(MemoryPool(1 << 30))
    f.write(CHUNK + 3, b"xyz")
    snap = f.snapshot()
    data = b"".join(bytes(p) for p in snap.pieces())
    assert data == bytes(CHUNK + 3) + b"xyz"
    snap.release()


def _evicted(*writes: tuple[int, bytes]) -> tuple[MemoryPool, FileData]:
    """A file with these writes, then evicted (its bytes only in the store)."""
    pool = MemoryPool(1 << 30)
    f = FileData(pool)
    for off, data in writes:
        f.write(off, data)
    f.evict()
    return pool, f


def test_a_load_reads_into_chunks_the_pools_thread_made_ahead():
    """A load's worker faulted in each chunk it reads into (1.1-1.5 ms per
    4 MiB, on the thread that reads and verifies the file): it takes those
    the pool's thread made ahead, all zeros, and the thread makes more."""
    pool = MemoryPool(1 << 30, reuse=64 << 20)
    f = FileData(pool)
    data = os.urandom(1 << 20) * 12  # 3 chunks
    f.write(0, data)
    _settled(pool)
    made = {id(c) for c in pool._made}
    f.evict()
    load = Loading(f, None)
    for off in range(0, len(data), 1 << 20):
        load.place(off, data[off : off + (1 << 20)])
    assert {id(load._pending[i].buf) for i in (0, 1, 2)} <= made
    assert load.show(0, len(data)) and f.read(0, len(data) + 1) == data
    _settled(pool)
    assert len(pool._made) == memory.MADE_AHEAD


def test_a_load_serves_what_it_shows_and_keeps_holes_free():
    pool, f = _evicted((0, b"q" * 10000), (3 * CHUNK, b"tail"))
    assert not f.resident and pool.used == 0
    load = Loading(f, None)
    assert pool.used == 3 * CHUNK + 64  # the whole file reserved up front (its last chunk is small)
    load.place(0, b"q" * 4000)
    load.place(4000, b"q" * 6000)
    pos = 10000
    for piece in zeros(3 * CHUNK - 10000):
        load.place(pos, piece)
        pos += len(piece)
    assert load.show(0, CHUNK) and not f.resident and f.read(0, 10001) == b"q" * 10000 + b"\0"
    assert load.covers(0, CHUNK) and not load.covers(0, CHUNK + 1) and not load.covers(0, None)
    load.place(3 * CHUNK, b"tail")
    assert load.show(CHUNK, f.size) and f.resident and f.loading is None
    assert f.read(3 * CHUNK - 2, 10) == b"\0\0tail"
    assert pool.used == f.allocated == CHUNK + 64  # the two holes' chunks given back


@pytest.mark.parametrize("tail", [28, memory.SMALL_MAX + 1, (1 << 20) + 28, CHUNK // 2, CHUNK // 2 + 1, CHUNK - 1])
def test_a_load_takes_for_the_last_chunk_what_it_holds(tail):
    """A loaded file's last chunk has the length it will keep: it takes that
    much of the budget (in pages), not a whole CHUNK (a file of 5 MiB took
    8). Past half a CHUNK it is a CHUNK still, to be recycled. A write past
    its end later grows it as any chunk grows, the budget exact."""
    size = CHUNK + tail
    data = os.urandom(size)
    pool, f = _evicted((0, data))
    load = Loading(f, None)
    if tail <= memory.SMALL_MAX:
        last = 64
    elif tail <= CHUNK // 2:
        last = -(-tail // mmap.PAGESIZE) * mmap.PAGESIZE
    else:
        last = CHUNK
    assert memory.ram_for(size) == pool.used == CHUNK + last
    for off in range(0, size, 1 << 20):
        load.place(off, data[off : off + (1 << 20)])
    assert load.show(0, size) and f.resident and pool.used == f.allocated == CHUNK + last
    assert f.read(0, size + 10) == data
    more = os.urandom(min(4000, CHUNK - tail))  # (within the chunk)
    f.write(size, more)
    assert f.read(0, size + 4010) == data + more
    grown = last if tail + len(more) <= last else memory.capacity(tail + len(more))
    assert pool.used == f.allocated == CHUNK + grown
    f.clear()
    assert pool.used == 0 and all(len(c) == CHUNK for c in pool._freed)


@pytest.mark.parametrize("tail", [28, memory.SMALL_MAX + 1, (1 << 20) + 28, CHUNK // 2, CHUNK // 2 + 1, CHUNK - 1])
def test_a_written_file_s_last_chunk_takes_what_it_holds_once_sealed(tail):
    """A writer's last chunk is a whole CHUNK; `fit` (at a seal) gives it the
    length a load would (a file of 300 KiB written took 4 MiB of the budget
    for as long as it stayed in RAM). The bytes stay; a write past the end
    grows it again, the budget exact."""
    pool = MemoryPool(1 << 30)
    f = FileData(pool)
    size = CHUNK + tail
    data = os.urandom(size)
    for off in range(0, size, 1 << 20):  # a writer's pieces
        f.write(off, data[off : off + (1 << 20)])
    if tail > memory.SMALL_MAX:
        assert pool.used == f.allocated == 2 * CHUNK
    f.fit()
    assert pool.used == f.allocated == memory.ram_for(size)
    assert f.read(0, size + 10) == data
    fitted = f._chunks[1].buf
    more = os.urandom(CHUNK - tail + 100)  # past the chunk's end, into the next
    f.write(size, more)
    if memory.SMALL_MAX < len(fitted) < CHUNK:  # grown where it is (mremap), not copied into a new chunk
        assert f._chunks[1].buf is fitted and len(fitted) == CHUNK
    assert f.read(0, size + len(more)) == data + more
    assert pool.used == f.allocated == 2 * CHUNK + memory.capacity(100)
    f.clear()
    assert pool.used == 0 and all(len(c) == CHUNK for c in pool._freed)


def test_fit_after_a_truncate_copies_a_small_tail_out_of_its_chunk():
    pool = MemoryPool(1 << 30, made_ahead=0)
    f = FileData(pool)
    f.write(0, b"t" * (3 << 20))
    f.truncate(100 << 10)
    assert pool.used == CHUNK
    f.fit()
    assert pool.used == f.allocated == 128 << 10 and pool.kept == CHUNK  # the CHUNK kept for reuse
    assert f.read(0, 1 << 20) == b"t" * (100 << 10)


def test_fit_leaves_a_chunk_that_a_snapshot_or_a_view_shares():
    pool = MemoryPool(1 << 30)
    f = FileData(pool)
    f.write(0, b"s" * (300 << 10))
    snap = f.snapshot()
    f.fit()  # the snapshot's chunk: not touched
    assert pool.used == CHUNK and b"".join(bytes(p) for p in snap.pieces()) == b"s" * (300 << 10)
    snap.release()
    view = f.read(0, 10)  # a view of the chunk, as a read's reply is
    f.fit()
    assert pool.used == CHUNK and bytes(view) == b"s" * 10
    del view
    f.fit()
    assert pool.used == f.allocated == 300 << 10 and f.read(0, 300 << 10) == b"s" * (300 << 10)


def test_a_load_places_and_shows_in_any_order_and_reads_land_in_place():
    _, f = _evicted((0, b"a" * (3 * CHUNK)))
    load = Loading(f, None)
    view = load.view(2 * CHUNK + 5, 1 << 30)
    assert len(view) == CHUNK - 5  # bounded by its chunk
    view[:] = b"c" * len(view)
    load.place(2 * CHUNK + 5, view)  # in place already: nothing copied
    load.place(2 * CHUNK, b"c" * 5)
    del view
    assert load.show(2 * CHUNK, 3 * CHUNK) and load.covers(2 * CHUNK, 3 * CHUNK) and not load.covers(0, 1)
    assert f.read(3 * CHUNK - 3, 10) == b"ccc" and not f.resident
    load.place(0, b"a" * (2 * CHUNK))
    assert load.show(0, 2 * CHUNK) and f.resident and f.read(0, 3 * CHUNK) == b"a" * (2 * CHUNK) + b"c" * CHUNK


def _borrowed(tmp_path, content: bytes, pool: MemoryPool | None = None) -> tuple[MemoryPool, FileData, Borrowing]:
    """A file evicted with `content`, borrowed from a store file holding it
    (zeros as holes where a whole chunk is zero)."""
    pool = pool or MemoryPool(1 << 30)
    f = FileData(pool)
    f.truncate(len(content))
    f.evict()
    path = tmp_path / "store-file"
    with open(path, "wb") as out:
        for off in range(0, len(content), CHUNK):
            piece = content[off : off + CHUNK]
            if piece.count(0) != len(piece):
                out.seek(off)
                out.write(piece)
        out.truncate(len(content))
    borrowing = Borrowing(f)
    borrowing.adopt(os.open(path, os.O_RDONLY))
    return pool, f, borrowing


def test_reads_of_a_block_held_for_its_reader_are_views_of_ram(tmp_path, monkeypatch):
    """A block verified for reads in place is held in chunks of the RAM
    budget: reads of it are answered from them without a copy, at most
    HELD_BYTES are held, and one goes once reads went past it (its store
    pages with it) or when a reader waits for another block; till then the
    load waits (`hold` says None) instead of running ahead of its reader.
    The first block a load verifies is not held (its reader waits for it:
    no fresh RAM to fault in first)."""
    monkeypatch.setattr(loading, "HELD_IDLE_S", 3600.0)  # no block goes for lack of reads here
    monkeypatch.setattr(loading, "HELD_MAX_S", 3600.0)  # nor for a slow machine's sake
    monkeypatch.setattr(loading, "HELD_BYTES", 3 * CHUNK)  # three blocks of a chunk each
    content = os.urandom(6 * CHUNK)
    pool, f, b = _borrowed(tmp_path, content)
    blocks = [(i * CHUNK, (i + 1) * CHUNK) for i in range(6)]
    assert b.hold(*_span(blocks[0]), False) is False
    _load_block(b, *blocks[0])
    assert pool.used == 0 and isinstance(f.read(5, 10), bytearray)  # from the store file
    for block in blocks[1:4]:
        assert b.hold(*_span(block), False) is True
        _load_block(b, *block)
    assert pool.used == 3 * CHUNK == loading.HELD_BYTES
    assert b.hold(*_span(blocks[4]), False) is None  # the reader is still at the first block held
    piece = f.read(2 * CHUNK + 5, 100)
    assert isinstance(piece, memoryview) and isinstance(piece.obj, mmap.mmap) and piece == content[2 * CHUNK + 5 : 2 * CHUNK + 105]
    assert b.dropped == [(CHUNK, CHUNK)] and pool.used == 2 * CHUNK  # read past the first held block: let go
    assert f.read(CHUNK + 10, 20) == content[CHUNK + 10 : CHUNK + 30]  # from the store file now
    assert b.hold(*_span(blocks[4]), False) is True
    _load_block(b, *blocks[4])
    assert b.hold(*_span(blocks[5]), False) is None
    assert b.hold(*_span(blocks[5]), True) is True  # a reader waits for it: the oldest goes
    _load_block(b, *blocks[5])
    assert pool.used == 3 * CHUNK
    assert f.read(5 * CHUNK - 50, 100) == content[5 * CHUNK - 50 : 5 * CHUNK + 50]  # across two held blocks
    b.release()
    assert pool.used == 0


def test_a_load_in_place_waits_for_a_slow_reader_a_bounded_time_per_block(tmp_path, monkeypatch):
    """Waiting for a reader that keeps reading, slowly, must not use up the
    load's deadline: after HELD_MAX_S a block held that long goes."""
    monkeypatch.setattr(loading, "HELD_IDLE_S", 3600.0)
    monkeypatch.setattr(loading, "HELD_MAX_S", 3600.0)
    monkeypatch.setattr(loading, "HELD_BYTES", 3 * CHUNK)  # three blocks of a chunk each
    pool, f, b = _borrowed(tmp_path, os.urandom(5 * CHUNK))
    _load_block(b, 0, CHUNK)
    for lo in range(CHUNK, 4 * CHUNK, CHUNK):
        assert b.hold(lo, CHUNK, False) is True
        _load_block(b, lo, lo + CHUNK)
    assert b.hold(4 * CHUNK, CHUNK, False) is None
    monkeypatch.setattr(loading, "HELD_MAX_S", 0.2)
    time.sleep(0.3)
    f.read(CHUNK, 100)  # the reader is still there
    assert b.hold(4 * CHUNK, CHUNK, False) is True and pool.used == 3 * CHUNK
    b.release()


def test_a_block_with_a_hole_is_never_answered_from_recycled_chunks(tmp_path, monkeypatch):
    """A hole is not read into a held block's chunks, and recycled chunks
    hold an earlier file's bytes: such a block is answered from the store
    file instead."""
    monkeypatch.setattr(loading, "HELD_IDLE_S", 3600.0)
    pool = MemoryPool(1 << 30)
    for _ in range(2):  # chunks an earlier file filled, kept for reuse
        chunk = pool.take_chunk()
        chunk[:] = b"j" * CHUNK
        pool.give_chunk(chunk)
    content = b"d" * (2 * CHUNK) + bytes(CHUNK)
    _, f, b = _borrowed(tmp_path, content, pool)
    assert b.hold(0, CHUNK, False) is False  # the first block
    _load_block(b, 0, CHUNK)
    assert b.hold(CHUNK, 2 * CHUNK, False) is True
    _load_block(b, CHUNK, 3 * CHUNK)
    assert f.read(2 * CHUNK - 2, 4) == b"dd\0\0" and f.read(2 * CHUNK, CHUNK) == bytes(CHUNK)
    assert pool.used == 0  # not held
    b.release()


def test_a_block_read_in_place_without_room_in_ram_goes_through_the_page_cache(tmp_path):
    pool, f, b = _borrowed(tmp_path, os.urandom(3 * CHUNK), MemoryPool(CHUNK))
    content = open(tmp_path / "store-file", "rb").read()
    _load_block(b, 0, CHUNK)
    assert b.hold(CHUNK, 2 * CHUNK, False) is False
    _load_block(b, CHUNK, 3 * CHUNK)
    assert pool.used == 0 and bytes(f.read(3, 3 * CHUNK)) == content[3:]
    b.release()


def _span(block: tuple[int, int]) -> tuple[int, int]:
    return block[0], block[1] - block[0]


def _load_block(b: Borrowing, lo: int, hi: int) -> None:
    """What a load's worker does with one block, its check passed."""
    pos = lo
    for piece in read_sparse(b.fd, hi, start=lo, into=b.view):
        b.place(pos, piece)
        pos += len(piece)
    assert b.show(lo, hi)


def test_a_load_into_a_spill_file(tmp_path):
    pool, f = _evicted((0, b"s" * (5 << 20)))
    load = Loading(f, str(tmp_path))
    assert pool.used == 0 and f.spilled
    assert load.view(0, 100) is None  # the worker writes a spill file itself
    load.place(0, b"s" * (5 << 20))
    load.close()
    assert load.show(0, f.size) and f.resident and f.read((5 << 20) - 2, 10) == b"ss"


def test_a_truncate_drops_a_load_in_progress():
    pool, f = _evicted((0, b"x" * (2 * CHUNK)))
    load = Loading(f, None)
    load.place(0, b"x" * CHUNK)
    assert load.show(0, CHUNK)
    f.clear()  # open(O_TRUNC) meanwhile
    assert not load.show(CHUNK, 2 * CHUNK)
    load.release()
    assert f.resident and f.size == 0 and pool.used == 0


def test_spill_moves_bytes_out_of_ram_and_keeps_working(tmp_path):
    pool = MemoryPool(64 << 20)
    f = FileData(pool)
    f.write(0, b"a" * (5 << 20))
    f.spill(str(tmp_path))
    assert f.spilled and pool.used == 0 and os.listdir(tmp_path) == []  # unlinked
    f.write(5 << 20, b"b" * 10)
    assert f.read((5 << 20) - 2, 20) == b"aabbbbbbbbbb"
    snap = f.snapshot()
    f.write(0, b"Z")  # a snapshot shares the spill file: this copies it first
    f.truncate(3)
    assert f.read(0, 10) == b"Zaa"
    data = b"".join(snap.pieces())
    assert data == b"a" * (5 << 20) + b"b" * 10
    snap.release()
    f.clear()
    assert not f.spilled


def test_a_spilled_write_that_fails_part_way_leaves_nothing_past_the_end(tmp_path):
    """The spill file's disk fills in the middle of a write past the end:
    the bytes that got there before the failure are cut off again, so a
    later extension of the file reads zeros there, not half a write that
    failed. (A size limit stands in for the full disk: the write stops at
    it, the same way.)"""
    f = FileData(MemoryPool(64 << 20))
    f.write(0, b"a" * 4096)
    f.spill(str(tmp_path))
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))
    try:
        with pytest.raises(OSError):
            f.write(4096, b"b" * 16384)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert f.size == 4096
    f.truncate(20480)
    assert f.read(0, 20480) == b"a" * 4096 + bytes(16384)
    f.clear()


def _bytes(snap) -> bytes:
    return b"".join(bytes(p) for p in snap.pieces())


@pytest.mark.parametrize("size", [1000, CHUNK + 1000])
def test_shrinking_truncate_never_changes_a_snapshot(size):
    """A sealed snapshot is what gets hashed and published: a truncate of the
    live file after the seal must not alter it (it used to: the shared chunk's
    initialised length was lowered in place)."""
    f = FileData(MemoryPool(1 << 30))
    f.write(0, b"s" * size)
    snap = f.snapshot()
    f.truncate(size - 500)
    f.truncate(size)  # grow back: the tail must read as zeros in the file...
    assert f.read(size - 600, 600) == b"s" * 100 + bytes(500)
    assert _bytes(snap) == b"s" * size  # ...and as the old bytes in the snapshot
    snap.release()


def test_truncate_of_a_spilled_file_never_changes_a_snapshot(tmp_path):
    f = FileData(MemoryPool(64 << 20))
    f.write(0, b"a" * 5000)
    f.spill(str(tmp_path))
    snap = f.snapshot()
    f.truncate(10)
    assert _bytes(snap) == b"a" * 5000
    snap.release()


def test_older_spill_snapshot_released_late_does_not_unfreeze_a_newer_one(tmp_path):
    """Generation 1 and 2 of a spilled file are both queued; releasing 1 must
    not let the next write modify the spill file that 2 still reads."""
    f = FileData(MemoryPool(64 << 20))
    f.write(0, b"1" * 5000)
    f.spill(str(tmp_path))
    snap1 = f.snapshot()
    f.write(0, b"2" * 5000)  # copies: snap1 keeps the first spill file
    snap2 = f.snapshot()
    snap1.release()
    f.write(0, b"3" * 5000)  # snap2 still shares the spill file: must copy again
    assert _bytes(snap2) == b"2" * 5000
    snap2.release()
    assert f.read(0, 5000) == b"3" * 5000


def test_truncating_an_evicted_file_to_zero_makes_it_resident_and_empty():
    pool = MemoryPool(1 << 30)
    f = FileData(pool)
    f.write(0, b"q" * 10000)
    f.evict()
    f.clear()
    assert f.resident and f.size == 0
    f.write(0, b"new")
    assert f.read(0, 10) == b"new"


def _joined(snapshot) -> bytes:
    return b"".join(bytes(p) for p in snapshot.pieces())


def test_bytes_handed_out_stay_promised_while_only_appended_to():
    pool = MemoryPool(1 << 30)
    f = FileData(pool)
    stream = object()
    payload = os.urandom(3 * CHUNK + 100)
    f.write(0, payload[: 2 * CHUNK + 5])
    first = f.hand_out(stream, 2 * CHUNK)
    assert (first.start, first.size) == (0, 2 * CHUNK) and _joined(first) == payload[: 2 * CHUNK]
    f.write(2 * CHUNK + 5, payload[2 * CHUNK + 5 :])  # appends keep the promise
    second = f.hand_out(stream, 3 * CHUNK)
    assert _joined(second) == payload[2 * CHUNK : 3 * CHUNK]
    sealed = f.snapshot()
    assert sealed.stream is stream
    tail = sealed.tail(3 * CHUNK)
    sealed.release()  # the tail holds its chunks on its own
    assert _joined(tail) == payload[3 * CHUNK :]
    for s in (first, second, tail):
        s.release()
    assert pool.used == f.allocated


@pytest.mark.parametrize("change", ["write below", "truncate below", "truncate to zero", "spill"])
def test_a_change_below_what_was_handed_out_breaks_the_promise(change, tmp_path):
    f = FileData(MemoryPool(1 << 30))
    stream = object()
    f.write(0, b"a" * (2 * CHUNK))
    f.hand_out(stream, 2 * CHUNK).release()
    if change == "write below":
        f.write(CHUNK, b"b")
    elif change == "truncate below":
        f.truncate(2 * CHUNK - 1)
    elif change == "truncate to zero":
        f.clear()
    else:
        f.spill(str(tmp_path))
    f.write(f.size, b"c" * CHUNK)  # appending afterwards does not mend it
    snap = f.snapshot()
    assert getattr(snap, "stream", None) is None
    snap.release()


def test_a_write_at_or_after_what_was_handed_out_keeps_the_promise():
    f = FileData(MemoryPool(1 << 30))
    stream = object()
    f.write(0, b"a" * (2 * CHUNK + 10))
    f.hand_out(stream, 2 * CHUNK).release()
    f.write(2 * CHUNK, b"b" * 10)  # rewrites bytes not handed out yet
    f.truncate(2 * CHUNK)
    snap = f.snapshot()
    assert snap.stream is stream
    snap.release()


def test_the_frontier_follows_a_writer_going_in_order_from_the_start():
    f = FileData(MemoryPool(1 << 30))
    f.write(0, b"a" * 100)
    f.write(100, b"b" * 100)
    assert f.frontier == f.size == 200  # appends
    g = FileData(MemoryPool(1 << 30))
    g.truncate(3 * CHUNK)  # sized first, then filled in order (safetensors)
    g.write(0, b"h" * 152)
    g.write(152, b"x" * CHUNK)
    assert g.frontier == 152 + CHUNK and g.size == 3 * CHUNK
    g.write(2 * CHUNK, b"y")  # ahead of the writer: not in order
    assert g.frontier == 152 + CHUNK
    g.write(10, b"z")  # behind it
    assert g.frontier == 152 + CHUNK
    g.truncate(100)
    assert g.frontier == 100
    g.clear()
    assert g.frontier == 0


def _cgroups(tmp_path, proc_lines: list[str], files: dict[str, str]):
    (tmp_path / "cgroup").write_text("".join(line + "\n" for line in proc_lines))
    for rel, text in files.items():
        (tmp_path / "sys" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "sys" / rel).write_text(text + "\n")
    return str(tmp_path / "cgroup"), str(tmp_path / "sys")


@pytest.mark.parametrize("proc_lines, files, expected", [
    # v2: the cgroup's own limit, or its parent's where it has none ("max")
    (["0::/kubepods/pod1/c1"], {"kubepods/pod1/c1/memory.max": "max", "kubepods/pod1/memory.max": str(2 << 30)}, 2 << 30),
    (["0::/a/b"], {"a/b/memory.max": str(1 << 30), "a/memory.max": str(4 << 30)}, 1 << 30),
    # v2 in a container: its own path is not visible, its limit is at the root of what is
    (["0::/"], {"memory.max": str(3 << 30)}, 3 << 30),
    (["0::/docker/abc"], {"memory.max": str(3 << 30)}, 3 << 30),
    # v1, the memory controller on a line of its own or beside others
    (["4:memory:/docker/abc", "3:cpu:/docker/abc"], {"memory/docker/abc/memory.limit_in_bytes": str(5 << 30)}, 5 << 30),
    (["7:cpuacct,memory:/x"], {"memory/memory.limit_in_bytes": str(6 << 30)}, 6 << 30),
    # no limit
    (["0::/"], {"memory.max": "max"}, None),
    (["4:memory:/"], {"memory/memory.limit_in_bytes": "9223372036854771712"}, None),
    (["0::/gone"], {}, None),
    (["garbage"], {}, None),
])
def test_total_ram_is_capped_by_the_cgroup(tmp_path, proc_lines, files, expected):
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert total_ram(*_cgroups(tmp_path, proc_lines, files)) == (physical if expected is None else min(physical, expected))


def test_total_ram_without_cgroups(tmp_path):
    assert total_ram(str(tmp_path / "none"), str(tmp_path)) == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
