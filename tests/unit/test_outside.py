"""Files the torch helpers wrote straight to the store while the daemon did
not answer (C7) are taken into a mount that lives on (`writeback.outside`):
the mount shows what the store holds, unless the mount changed since."""

from __future__ import annotations

import os

import pytest
import trio
from ckptfs.writeback.backend import open_store
from ckptfs.writeback.outside import READ
from ckptfs.writeback.storeio import write_file
from ckptfs.writeback.verify import verify

from tests.unit.test_engine import FaultyBackend, Rig, run_until_flushed

W = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def _helper(rig: Rig):
    """The store as a torch helper's fallback opens it: no daemon of its own."""
    return open_store(rig.url)


def _read(rig: Rig, path: str) -> bytes | None:
    node = rig.store.inode_at(path)
    return None if node is None else bytes(node.data.read(0, node.data.size))


async def test_a_file_written_straight_to_the_store_replaces_the_older_one_in_the_mount(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.mkdir("run")
    rig.write("run/model.pt", b"old")
    took = []

    async def body():
        await rig.engine.flush()
        write_file(_helper(rig), "run/model.pt", b"newer, from the fallback")
        took.append(await rig.engine.outside.take())
        took.append(await rig.engine.outside.take())  # taken once

    await run_until_flushed(rig, body)
    assert took == [1, 0]
    assert _read(rig, "run/model.pt") == b"newer, from the fallback"
    assert rig.files() == {"run/model.pt": b"newer, from the fallback"}
    assert sorted(rig.store.get(rig.store.inode_at("run").ino).children) == [b"model.pt"]  # no hidden name left
    assert verify(rig.backend).clean


@pytest.mark.parametrize("when", ["before its turn", "refused at its turn"])
async def test_an_older_generation_queued_in_the_mount_gives_way_to_the_store_file(tmp_path, when):
    """A generation sealed before the helper's write (queued: the store was
    down, the daemon hung) never reaches the store, and the mount shows the
    store's file, whether it is taken in before that generation's turn or
    after its publication was refused (the store's file is newer)."""
    rig = Rig(tmp_path / "store")
    rig.write("model.pt", b"queued while the store was down")  # sealed, not published: the engine is not running
    write_file(_helper(rig), "model.pt", b"newer, from the fallback")
    if when == "refused at its turn":
        await run_until_flushed(rig)
        assert _read(rig, "model.pt") == b"queued while the store was down"
    assert await rig.engine.outside.take() == 1
    await run_until_flushed(rig)
    assert _read(rig, "model.pt") == b"newer, from the fallback"
    assert rig.files() == {"model.pt": b"newer, from the fallback"}


async def test_a_checkpoint_written_straight_to_the_store_appears_with_its_directories(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.mkdir("run")
    helper = _helper(rig)

    async def body():
        await rig.engine.flush()
        for name, data in (("state.pt", b"s" * 100_000), ("shards/0.bin", b"0" * 10), ("ckptfs-commit.json", b"{}")):
            write_file(helper, f"run/step-2/{name}", data)
        assert await rig.engine.outside.take() == 3

    await run_until_flushed(rig, body)
    assert _read(rig, "run/step-2/state.pt") == b"s" * 100_000
    assert _read(rig, "run/step-2/shards/0.bin") == b"0" * 10
    assert _read(rig, "run/step-2/ckptfs-commit.json") == b"{}"
    assert set(rig.files()) == {"run/step-2/state.pt", "run/step-2/shards/0.bin", "run/step-2/ckptfs-commit.json"}


async def test_a_file_changed_in_the_mount_after_the_write_to_the_store_is_kept(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.write("model.pt", b"v1")

    async def body():
        await rig.engine.flush()
        write_file(_helper(rig), "model.pt", b"v2, from the fallback")
        rig.write("model.pt", b"v3, written in the mount after it")
        assert await rig.engine.outside.take() == 0

    await run_until_flushed(rig, body)
    assert _read(rig, "model.pt") == b"v3, written in the mount after it"
    assert rig.files() == {"model.pt": b"v3, written in the mount after it"}


@pytest.mark.parametrize("how", ["removed", "renamed away", "its directory removed"])
async def test_a_name_the_mount_let_go_of_after_the_write_to_the_store_is_not_made_again(tmp_path, how):
    """(The engine stopped while the mount changes and takes files in: the
    store still has the file when its record is read.)"""
    rig = Rig(tmp_path / "store")
    rig.mkdir("d")
    rig.write("d/model.pt", b"v1")
    await run_until_flushed(rig)
    write_file(_helper(rig), "d/model.pt", b"v2, from the fallback")
    if how == "removed":
        rig.unlink("d/model.pt")
    elif how == "renamed away":
        rig.rename("d/model.pt", "kept.pt")
    else:
        rig.unlink("d/model.pt")
        rig.store.rmdir(rig.store.inode_at("").ino, b"d")
    assert await rig.engine.outside.take() == 0
    await run_until_flushed(rig)
    assert rig.store.inode_at("d/model.pt") is None
    assert "d/model.pt" not in rig.files()  # (renamed away: the store's file at the name moved with it)


async def test_a_file_open_for_writing_holds_back_what_was_written_after_it(tmp_path):
    """A file the mount is writing is left for a later look, and so is what
    the helper wrote after it: a completion marker is never taken in before
    the files written before it. Sealed after the helper's write, the
    mount's file is the newer. (The engine stopped meanwhile: the mount's
    file is not published before the look.)"""
    rig = Rig(tmp_path / "store")
    rig.mkdir("step-2")
    h = rig.write("step-2/state.pt", b"being written", keep_open=True)
    await run_until_flushed(rig)
    helper = _helper(rig)
    write_file(helper, "step-2/state.pt", b"saved by the helper")
    write_file(helper, "step-2/commit_success.txt", b"done")
    assert await rig.engine.outside.take() == 0
    assert rig.store.inode_at("step-2/commit_success.txt") is None
    rig.store.release(h.fh)  # sealed now, after the helper's write
    assert await rig.engine.outside.take() == 1
    await run_until_flushed(rig)
    assert _read(rig, "step-2/state.pt") == b"being written"
    assert _read(rig, "step-2/commit_success.txt") == b"done"
    assert rig.files() == {"step-2/state.pt": b"being written", "step-2/commit_success.txt": b"done"}


async def test_a_mark_naming_no_file_of_the_mount_is_left_alone(tmp_path, caplog):
    """Marks are the store's, and anyone who may write it may plant one:
    one naming ckptfs's own prefix, a path out of the store, or a path the
    store has no file at is left alone, and what was written after it is
    taken in."""
    from ckptfs.writeback import manifest

    rig = Rig(tmp_path / "store")
    helper = _helper(rig)
    for planted in (".ckptfs/index", "../../etc/passwd", "a//b", "not/there"):
        manifest.mark_outside(helper, planted)
    write_file(helper, "model.pt", b"saved by the helper")

    async def body():
        assert await rig.engine.outside.take() == 1

    await run_until_flushed(rig, body)
    assert _read(rig, "model.pt") == b"saved by the helper"
    assert rig.files() == {"model.pt": b"saved by the helper"}
    assert sum("no file of the mount: left alone" in r.getMessage() for r in caplog.records) == 3


async def test_a_change_of_the_mount_while_a_large_file_is_taken_in_is_honoured(tmp_path):
    """A large file is written into the mount a piece at a time, the mount
    serving in between; a write of the mount's own to that name meanwhile
    is newer: the piece written so far goes (never published), and the
    mount keeps its file. (The engine stopped: nothing is published
    before the look.)"""
    import trio

    rig = Rig(tmp_path / "store")
    rig.write("model.pt", b"v1")
    await run_until_flushed(rig)
    write_file(_helper(rig), "model.pt", os.urandom(5 << 20))
    took = []

    async def taking():
        took.append(await rig.engine.outside.take())

    def hidden() -> list[bytes]:
        return [n for n in rig.store.get(rig.store.inode_at("").ino).children if n.startswith(b".ckptfs-taking-in.")]

    async with trio.open_nursery() as n:
        n.start_soon(taking)
        with trio.fail_after(30):
            while not hidden():  # the first piece is in
                await trio.sleep(0)
        rig.write("model.pt", b"v3, written in the mount meanwhile")
    assert took == [0] and hidden() == []
    await run_until_flushed(rig)
    assert _read(rig, "model.pt") == b"v3, written in the mount meanwhile"
    assert rig.files() == {"model.pt": b"v3, written in the mount meanwhile"}


class _ReadsFail(FaultyBackend):
    """The store, its reads of file data failing while `down` (the listing,
    the marks and the records still come)."""

    def __getattr__(self, name):
        return super().__getattr__(name) if name in ("read", "open_source") else getattr(self.inner, name)


async def test_a_file_the_store_cannot_give_is_left_out_and_one_it_fails_to_give_now_waits(tmp_path, caplog):
    """A symlink planted where the helper's file was is never followed: that
    file can never be taken in, and is left out with a warning; what was
    written after it is taken in. A read the store fails now holds that
    file, and what was written after it, for the next look, said once."""
    rig = Rig(tmp_path / "store")
    helper = _helper(rig)
    write_file(helper, "a.pt", b"a")
    write_file(helper, "b.pt", b"b")
    (tmp_path / "secret").write_bytes(b"not the store's")
    (tmp_path / "store" / "a.pt").unlink()
    (tmp_path / "store" / "a.pt").symlink_to(tmp_path / "secret")
    assert await rig.engine.outside.take() == 1
    assert _read(rig, "a.pt") is None and _read(rig, "b.pt") == b"b"
    assert sum("a.pt was written to the store while this daemon did not answer, and cannot be taken in" in r.getMessage()
               for r in caplog.records) == 1

    write_file(helper, "c.pt", b"c")
    write_file(helper, "d.pt", b"d")
    rig.engine.backend = failing = _ReadsFail(rig.backend, error_rate=0.0, latency_s=0.0)
    failing.down = True
    for _ in range(2):
        with pytest.raises(ConnectionError):
            await rig.engine.outside.take()
    assert _read(rig, "c.pt") is None and _read(rig, "d.pt") is None
    assert sum("c.pt was written to the store while this daemon did not answer; it cannot be read now" in r.getMessage()
               for r in caplog.records) == 1
    failing.down = False
    assert await rig.engine.outside.take() == 2
    await run_until_flushed(rig)
    (tmp_path / "store" / "a.pt").unlink()  # (the planted link)
    assert rig.files() == {"b.pt": b"b", "c.pt": b"c", "d.pt": b"d"}


async def test_a_file_whose_bytes_are_not_its_records_is_left_out_and_nothing_of_it_shows(tmp_path, caplog):
    """The store's file is checked against its record as it is taken in: one
    that rotted (or was written over by hand) is left out with a warning,
    the hidden file it was written into goes, and what was written after it
    is taken in."""
    rig = Rig(tmp_path / "store")
    rig.write("a.pt", b"the mount's own")
    await run_until_flushed(rig)
    helper = _helper(rig)
    write_file(helper, "a.pt", b"x" * 3_000_000)
    write_file(helper, "b.pt", b"b")
    with open(tmp_path / "store" / "a.pt", "r+b") as f:
        f.seek(2_500_000)
        f.write(b"y")
    assert await rig.engine.outside.take() == 1
    assert _read(rig, "a.pt") == b"the mount's own" and _read(rig, "b.pt") == b"b"
    assert sorted(rig.store.get(1).children) == [b"a.pt", b"b.pt"]  # no hidden name left
    assert any("a.pt was written to the store while this daemon did not answer, and cannot be taken in: a.pt: checksum mismatch"
               in r.getMessage() for r in caplog.records)


def _peak_rss() -> int:
    return next(int(ln.split()[1]) << 10 for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))


async def test_a_file_is_taken_in_as_it_comes_from_the_store_never_held_whole_besides(tmp_path):
    """Taking a file in reads it from the store a block at a time into the
    file in RAM: the daemon holds the file once (in its RAM budget), not
    also whole in its own memory, twice while it was joined (a checkpoint
    shard of many GiB put that much on top of the budget)."""
    rig = Rig(tmp_path / "store")
    size = 128 << 20
    with open(tmp_path / "shard.bin", "wb") as f:
        for _ in range(size >> 24):
            f.write(os.urandom(16 << 20))
    from ckptfs.fallback import mapped

    with mapped(str(tmp_path / "shard.bin")) as data:
        write_file(_helper(rig), "shard.bin", data)
    (tmp_path / "shard.bin").unlink()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak is the size now
    before = _peak_rss()
    assert await rig.engine.outside.take() == 1
    grew = _peak_rss() - before
    assert rig.store.inode_at("shard.bin").data.size == size
    assert grew < size + (96 << 20), grew >> 20  # the file in RAM, and a block or so on its way (159 MiB here; 317 before)
    await run_until_flushed(rig)
    assert verify(rig.backend).clean


def _blocks_read(backend, gate) -> list[int]:
    """Takings-in from `backend` call `gate(block)` before reading each
    READ-sized block of a file; returns the blocks read, in order."""
    opened, order = backend.open_source, []

    def open_source(path):
        source = opened(path)
        read = source.read

        def gated(off, n, into=None):
            order.append(off // READ)
            gate(off // READ)
            yield from read(off, n, into)

        source.read = gated
        return source

    backend.open_source = open_source
    return order


async def test_a_store_that_fails_in_the_middle_of_a_file_has_it_taken_in_at_a_later_look(tmp_path, caplog):
    """A read the store fails after the file's first block (the connection
    lost, a deadline) is the store's failure now, as at its first block:
    the file, and what was written after it, wait for the next look. (It
    was taken for the mount's own failure: that file was left out for
    good.)"""
    rig = Rig(tmp_path / "store")
    data = os.urandom(READ + 1000)
    rig.write("big.pt", b"old")
    await run_until_flushed(rig)
    helper = _helper(rig)
    write_file(helper, "big.pt", data)
    write_file(helper, "after.pt", b"after")
    down = [True]

    def gate(block):
        if block == 1 and down[0]:
            raise ConnectionError("the store went away")

    _blocks_read(rig.backend, gate)
    with pytest.raises(ConnectionError):
        await rig.engine.outside.take()
    assert _read(rig, "big.pt") == b"old" and _read(rig, "after.pt") is None
    assert "big.pt was written to the store while this daemon did not answer; it cannot be read now" in caplog.text
    down[0] = False
    assert await rig.engine.outside.take() == 2
    assert _read(rig, "big.pt") == data and _read(rig, "after.pt") == b"after"


async def test_an_unmount_stops_taking_a_file_in_between_two_blocks(tmp_path):
    """The drain of an unmount does not wait for the rest of a large file
    being taken in: it stops after the block being read, and nothing of it
    shows."""
    import threading

    rig = Rig(tmp_path / "store")
    write_file(_helper(rig), "big.pt", os.urandom(2 * READ + 1000))
    go = threading.Event()
    order = _blocks_read(rig.backend, lambda block: block == 0 or go.wait(30))
    async with trio.open_nursery() as n:
        took = []

        async def take():
            took.append(await rig.engine.outside.take())

        n.start_soon(take)
        with trio.fail_after(20):
            while len(order) < 2:
                await trio.sleep(0.01)
        rig.engine.outside.stop()
        go.set()
    assert took == [0] and order == [0, 1]  # block 2 never read
    assert _read(rig, "big.pt") is None and not rig.store.get(1).children
