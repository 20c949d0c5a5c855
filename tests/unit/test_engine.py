"""The write-back engine in-process: the real inode store, real backends."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
import time

import pytest
import trio
import trio.lowlevel
import xxhash
from ckptfs.fs import loading, memory
from ckptfs.fs.memory import MemoryPool
from ckptfs.fs.tree import ROOT, InodeTree
from ckptfs.writeback import backend as backend_module
from ckptfs.writeback import manifest
from ckptfs.writeback.backend import Backend, open_store
from ckptfs.writeback.calls import Deadlines
from ckptfs.writeback.engine import Engine, Retry
from ckptfs.writeback.state import State

W = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


class Rig:
    def __init__(self, root, claim: bool = True, **kw):
        self.root = root
        self.url = str(root)  # a local directory, or an object store's URL (memory://)
        self.backend = open_store(self.url)
        if claim:  # as a daemon does after its scan
            self.backend.prepare(f"test-{id(self):x}", time.time())
        self.store = InodeTree(MemoryPool(1 << 30))
        kw.setdefault("retry", Retry(first_s=0.01, max_s=0.05))
        self.engine = Engine(self.backend, self.store, **kw)
        self.store.journal = self.engine

    def write(self, path: str, data: bytes, keep_open: bool = False):
        parent = self.dir_of(path)
        h = self.store.create(parent.ino, os.path.basename(path).encode(), 0o644, W, 0, 0)
        self.store.write(h.fh, 0, data)
        if not keep_open:
            self.store.release(h.fh)
        return h

    def dir_of(self, path: str):
        d = os.path.dirname(path)
        return self.store.inode_at(d) if d else self.store.get(ROOT)

    def mkdir(self, path: str):
        return self.store.mkdir(self.dir_of(path).ino, os.path.basename(path).encode(), 0o755, 0, 0)

    def rename(self, a: str, b: str):
        self.store.rename(self.dir_of(a).ino, os.path.basename(a).encode(), self.dir_of(b).ino, os.path.basename(b).encode())

    def unlink(self, path: str):
        self.store.unlink(self.dir_of(path).ino, os.path.basename(path).encode())

    def files(self) -> dict[str, bytes]:
        out = {}
        for dirpath, dirnames, names in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if d != ".ckptfs"]
            for n in names:
                p = os.path.join(dirpath, n)
                out[os.path.relpath(p, self.root)] = open(p, "rb").read()
        return out


async def run_until_flushed(rig: Rig, body=None, after=None):
    """Run the engine: `body`, a flush, then `after` (while it still runs)."""
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        if body is not None:
            await body()
        with trio.fail_after(20):
            await rig.engine.flush()
            if after is not None:
                await after()
        n.cancel_scope.cancel()


async def test_sealed_files_are_published_with_manifest(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.write("a.bin", b"A" * 100_000)
    rig.mkdir("d")
    rig.write("d/b.bin", b"B")
    await run_until_flushed(rig)
    assert rig.files() == {"a.bin": b"A" * 100_000, "d/b.bin": b"B"}
    rec = manifest.read(rig.backend, "a.bin")
    assert rec.current.size == 100_000 and rec.current.xxh3 == manifest.digest_of([b"A" * 100_000]).xxh3


async def test_renamed_before_publication_only_final_name(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.write(".metadata.tmp", b"meta")
    rig.rename(".metadata.tmp", ".metadata")
    await run_until_flushed(rig)
    assert rig.files() == {".metadata": b"meta"}
    assert manifest.read(rig.backend, ".metadata.tmp") is None


async def test_deleted_before_publication_never_uploaded(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.write("tmpfile", b"x" * 10)
    rig.unlink("tmpfile")
    await run_until_flushed(rig)
    assert rig.files() == {}
    assert rig.engine.queue == type(rig.engine.queue)()


async def test_rewrite_supersedes_older_generation(tmp_path):
    rig = Rig(tmp_path / "store")
    for i in range(5):
        rig.write("latest", f"step {i}".encode())
    await run_until_flushed(rig)
    assert rig.files() == {"latest": b"step 4"}


async def test_directory_rename_after_publication_moves_files(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.mkdir("100.orbax-checkpoint-tmp")
    rig.write("100.orbax-checkpoint-tmp/params", b"p")
    await run_until_flushed(rig)
    assert rig.files() == {"100.orbax-checkpoint-tmp/params": b"p"}
    rig.rename("100.orbax-checkpoint-tmp", "100")
    rig.write("100/commit_success.txt", b"ok")
    await run_until_flushed(rig)
    assert rig.files() == {"100/params": b"p", "100/commit_success.txt": b"ok"}
    assert not (tmp_path / "store" / "100.orbax-checkpoint-tmp").exists()


async def test_unlink_after_rename_over_keeps_the_new_file(tmp_path):
    """X published at a; a deleted; Z renamed onto a: the store keeps Z."""
    rig = Rig(tmp_path / "store")
    rig.write("a", b"X")
    await run_until_flushed(rig)
    rig.write("b", b"Z")
    rig.unlink("a")
    rig.rename("b", "a")
    await run_until_flushed(rig)
    assert rig.files() == {"a": b"Z"}


async def test_rewrite_then_rename_keeps_newest(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.write("a", b"gen1")
    await run_until_flushed(rig)
    rig.write("a", b"gen2")
    rig.rename("a", "b")
    await run_until_flushed(rig)
    assert rig.files() == {"b": b"gen2"}


async def test_rmtree_reaches_store_after_newer_checkpoint(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.mkdir("checkpoint-1")
    rig.write("checkpoint-1/model", b"1")
    await run_until_flushed(rig)
    rig.mkdir("checkpoint-2")
    rig.write("checkpoint-2/model", b"2")
    rig.unlink("checkpoint-1/model")
    rig.store.rmdir(ROOT, b"checkpoint-1")
    order = [type(op).__name__ for op in rig.engine.queue]
    assert order.index("FileGen") < order.index("Remove")
    await run_until_flushed(rig)
    assert rig.files() == {"checkpoint-2/model": b"2"}
    assert not (tmp_path / "store" / "checkpoint-1").exists()


async def test_open_file_is_not_published_until_sealed(tmp_path):
    rig = Rig(tmp_path / "store")
    h = rig.write("big", b"partial", keep_open=True)
    await run_until_flushed(rig)
    assert rig.files() == {}
    rig.store.write(h.fh, 7, b" and the rest")
    rig.store.release(h.fh)
    await run_until_flushed(rig)
    assert rig.files() == {"big": b"partial and the rest"}


async def test_snapshot_is_what_gets_published_even_if_rewritten_meanwhile(tmp_path):
    rig = Rig(tmp_path / "store")
    h = rig.write("f", b"sealed bytes")
    inode = h.inode
    h2 = rig.store.open(inode.ino, os.O_WRONLY)
    rig.store.write(h2.fh, 0, b"XXXXXX")  # not sealed yet: must not leak
    await run_until_flushed(rig)
    assert rig.files() == {"f": b"sealed bytes"}
    rig.store.release(h2.fh)


async def test_restart_scan_shows_files_and_loads_verified(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.mkdir("ckpt")
    rig.write("ckpt/model", b"M" * 5000)
    rig.store.symlink(ROOT, b"last", b"ckpt/model", 0, 0)
    await run_until_flushed(rig)

    rig2 = Rig(tmp_path / "store")
    n = await rig2.engine.scan()
    assert n == 1
    node = rig2.store.inode_at("ckpt/model")
    assert node.size == 5000 and not node.data.resident
    await rig2.engine.load(node.ino)
    assert node.data.read(0, 10000) == b"M" * 5000
    assert rig2.store.readlink(rig2.store.inode_at("last").ino) == b"ckpt/model"


@pytest.mark.parametrize("again", ["at once", "after a try that failed midway"])
async def test_a_staged_copy_gone_from_the_store_is_staged_again(tmp_path, caplog, again):
    """A publication whose staged copy is gone (cleaned away; on S3, an open
    upload consumed by an attempt whose answer was lost) while the store
    does not hold its bytes was tried again with the same dead copy for
    ever, and every change after it waited (seen over SeaweedFS: 15 changes
    unpublished at unmount). Staging it again is retried in place: a try
    that failed after reading the bytes (a connection reset midway, an
    answer lost) left the next one the spent reader of the snapshot, which
    failed every try after for ever ("snapshot yielded 0 bytes")."""
    rig = Rig(tmp_path / "store")
    real, real_stage = rig.backend.publish, rig.backend.stage
    lost, failed = [], []

    def publish(staged, path, pieces=(), mode=None):
        if not lost and path == "model.pt":
            lost.append(staged.token)
            rig.backend.discard(staged)  # gone before this attempt
        return real(staged, path, pieces, mode=mode)

    def stage(pieces, size, name=None, elsewhere=False):
        if lost and not failed and again != "at once":
            failed.append(sum(len(p) for p in pieces))
            raise ConnectionError("injected: the connection was reset once every byte was sent")
        return real_stage(pieces, size, name, elsewhere)

    rig.backend.publish, rig.backend.stage = publish, stage
    data = os.urandom(5 << 20)  # staged ahead, then published from its staged copy
    rig.write("model.pt", data)
    await run_until_flushed(rig)
    assert lost and rig.files() == {"model.pt": data}
    assert "is gone from the store: staging generation 1 again" in caplog.text
    assert failed == ([] if again == "at once" else [len(data)])


async def test_every_name_of_a_hard_linked_symlink_comes_back_after_a_restart(tmp_path):
    """link(2) of a symlink (`cp -al`, rsync --link-dest) gives the symlink
    another name. Its Link op was published as a file's, with no bytes and
    no record: every extra name, and the symlink itself once its first
    name was removed, was gone after a restart."""
    rig = Rig(tmp_path / "store")
    rig.mkdir("d")
    s = rig.store.symlink(ROOT, b"s", b"a", 0, 0)
    rig.store.link(s.ino, ROOT, b"t")
    t = rig.store.symlink(rig.store.inode_at("d").ino, b"u", b"../b", 0, 0)
    rig.store.link(t.ino, ROOT, b"v")

    async def later():
        rig.unlink("d/u")  # the first name goes: the other stays a symlink
        rig.rename("t", "w")

    await run_until_flushed(rig, later)
    await run_until_flushed(rig)
    rig2 = Rig(tmp_path / "store")
    await rig2.engine.scan()
    links = {p: rig2.store.readlink(rig2.store.inode_at(p).ino) for p in ("s", "w", "v")}
    assert links == {"s": b"a", "w": b"a", "v": b"../b"}
    assert rig2.store.inode_at("t") is None and rig2.store.inode_at("d/u") is None


async def test_a_directory_the_local_store_has_only_through_its_symlinks_records_is_renamed_with_them(tmp_path):
    """A local store where `a` is no directory, only the parent of a
    symlink's record (`a/s`): a crash in a directory move left it so (the
    move done, the old names' records not yet deleted), which a node taking
    over applies again (found by the takeover explorer). The rename of `a`
    assembled `x` in a hidden directory, since the store had nothing at
    `a`, and deleted the records at the old names only when it moved the
    directory itself: `a/s` stayed, and every restart showed it again."""
    store = tmp_path / "store"
    rig = Rig(store, claim=False)
    manifest.write(rig.backend, manifest.Record.of("a/s", "symlink", manifest.Meta(0o777, 0, 0, 1), target="t"))
    await rig.engine.scan()
    rig.backend.prepare("first", time.time())

    async def rename():
        rig.rename("a", "x")

    await run_until_flushed(rig, rename)
    back = Rig(store, claim=False)
    await back.engine.scan()
    assert back.store.inode_at("a") is None
    assert back.store.readlink(back.store.inode_at("x/s").ino) == b"t"


async def test_a_directory_on_an_object_store_changed_after_a_restart_keeps_its_change(tmp_path):
    """An object store holds an empty directory as its record alone. A
    restart restores records deepest first: `d/y` made `d` a node of no
    inode in the publisher's replica, as its parent, and `d`'s own record
    left it so. A chmod or utime of `d` after the restart was never
    recorded, and the next restart lost it (found by a crash explorer). A
    directory implied only by a file another tool wrote (`x`) is changed
    too."""
    url = f"memory://{tmp_path.name}-dirs"
    rig = Rig(url)
    rig.mkdir("d")
    rig.mkdir("d/y")
    await run_until_flushed(rig)
    rig.backend.put("x/g", b"by another tool")  # no record: x is implied by the file
    rig = Rig(url, claim=False)
    await rig.engine.scan()
    rig.backend.prepare("again", time.time())

    async def change():
        for path in ("d", "d/y", "x"):
            rig.store.setattr(rig.store.inode_at(path).ino, mode=stat.S_IFDIR | 0o700, mtime_ns=123_000_000_000)

    await run_until_flushed(rig, change)
    back = Rig(url, claim=False)
    await back.engine.scan()
    for path in ("d", "d/y", "x"):
        inode = back.store.inode_at(path)
        assert (inode.mode & 0o7777, inode.mtime_ns) == (0o700, 123_000_000_000), path


async def test_a_directory_the_store_has_no_record_of_comes_back_with_the_same_time_after_the_next_restart(tmp_path):
    """A directory the store holds no record of (made by another tool, or
    by a daemon killed before it recorded it) comes back with the time of
    the restart. It was never recorded after it, so every restart showed
    it with a new mtime (found by a crash explorer)."""
    for url in (str(tmp_path / "store"), f"memory://{tmp_path.name}-unrecorded"):
        rig = Rig(url, claim=False)
        rig.backend.put("x/y/g", b"by another tool")
        await rig.engine.scan()
        rig.backend.prepare("first", time.time())
        await run_until_flushed(rig)
        first = {path: rig.store.inode_at(path).mtime_ns for path in ("x", "x/y")}
        time.sleep(0.01)
        back = Rig(url, claim=False)
        await back.engine.scan()
        assert {path: back.store.inode_at(path).mtime_ns for path in ("x", "x/y")} == first, url


async def test_an_object_beside_objects_under_its_name_shows_the_directory_with_a_warning(tmp_path, caplog):
    """S3 and GCS can hold an object `d/a` and objects under `d/a/`, which a
    file system cannot show together: the mount shows the directory and
    leaves the file out, saying so; the file stays in the store."""
    import fsspec
    from fsspec.implementations.memory import MemoryFile

    mem = fsspec.filesystem("memory")
    root = f"/{tmp_path.name}/obj"
    for path, data in (("d/a", b"file"), ("d/a/b", b"under"), ("d/c", b"beside")):
        mem.store[f"{root}/{path}"] = MemoryFile(mem, f"{root}/{path}", data)  # as S3 holds them (memory:// refuses to write this)
    try:
        rig = Rig(f"memory:/{root}", claim=False)
        assert await rig.engine.scan() == 2
        assert rig.store.inode_at("d/a").is_dir and rig.store.inode_at("d/a/b").size == 5
        assert rig.store.inode_at("d/c").size == 6
        assert any("holds a file d/a and files under d/a/" in r.getMessage() for r in caplog.records)
        assert mem.cat_file(f"{root}/d/a") == b"file"
    finally:
        mem.rm(f"/{tmp_path.name}", recursive=True)


async def test_objects_no_file_system_can_name_are_left_out_and_do_not_stop_the_restart(tmp_path, caplog):
    """S3 takes keys such as `a//b`, `..`, `e/../f` or a name over 255
    bytes, which another tool may have written: one used to fail every
    restart (EINVAL from the tree). They are left out, with a warning, and
    stay in the store; the rest is shown."""
    import fsspec
    from fsspec.implementations.memory import MemoryFile

    mem = fsspec.filesystem("memory")
    root = f"/{tmp_path.name}/obj"
    odd = ["a//b", "c/./d", "e/../f", "..", ".", "g/..", "k/" + "z" * 256, "n\0x"]
    for path in [*odd, "ok", "m/" + "y" * 255]:
        mem.store[f"{root}/{path}"] = MemoryFile(mem, f"{root}/{path}", path.encode())  # as S3 holds them
    try:
        rig = Rig(f"memory:/{root}", claim=False)
        manifest.write(rig.backend, manifest.Record("", "dir", mode=0o750, mtime_ns=123))  # the root's record: "" names it
        assert await rig.engine.scan() == 2
        assert rig.store.inode_at("ok").size == 2 and rig.store.inode_at("m/" + "y" * 255).size == 257
        assert rig.store.inodes[ROOT].mode & 0o7777 == 0o750 and rig.store.inodes[ROOT].mtime_ns == 123
        warned = " ".join(r.getMessage() for r in caplog.records)
        for path in odd:
            assert f"the store holds {path}, which no file system can name" in warned
        assert mem.cat_file(f"{root}/a//b") == b"a//b"
    finally:
        mem.rm(f"/{tmp_path.name}", recursive=True)


async def test_corrupt_store_object_reads_as_eio(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.write("model", b"good" * 1000)
    await run_until_flushed(rig)
    (tmp_path / "store" / "model").write_bytes(b"evil" * 1000)
    rig2 = Rig(tmp_path / "store")
    await rig2.engine.scan()
    node = rig2.store.inode_at("model")
    with pytest.raises(OSError):
        await rig2.engine.load(node.ino)
    assert "model" in rig2.engine.verify_failures


async def test_eviction_frees_only_published_and_reloads(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.write("pub", b"P" * (8 << 20))
    await run_until_flushed(rig)
    h = rig.write("unpub", b"U" * (8 << 20), keep_open=True)
    used = rig.store.pool.used
    freed = rig.engine.evict(1 << 40)
    assert freed == 8 << 20 and rig.store.pool.used == used - freed
    assert h.inode.data.resident
    pub = rig.store.inode_at("pub")
    assert not pub.data.resident
    await rig.engine.load(pub.ino)
    assert pub.data.read(0, 4) == b"PPPP"
    rig.store.release(h.fh)


async def test_a_file_no_replica_shows_reads_as_eio_said_once_as_an_error(tmp_path, caplog):
    """A fault of ckptfs itself: an evicted file that the publisher's replica
    of the store shows nowhere. Its reads answered EIO and logged nothing;
    now the first says which file, as an error, and later ones stay quiet."""
    rig = Rig(tmp_path / "store")
    rig.write("pub", b"P" * (8 << 20))
    await run_until_flushed(rig)
    rig.engine.evict(1 << 40)
    pub = rig.store.inode_at("pub")
    rig.engine.publisher.replica.lookup("pub").shown = None  # as if the replica lost track of it
    for _ in range(2):
        with pytest.raises(OSError) as err:
            await rig.engine.load(pub.ino)
        assert err.value.errno == errno.EIO
    said = [r for r in caplog.records if r.levelname == "ERROR" and "neither RAM nor the store" in r.getMessage()]
    assert len(said) == 1 and "pub" in said[0].getMessage()


async def test_ram_eviction_leaves_spilled_files_and_spill_room_evicts_them(tmp_path):
    """A spilled file holds no RAM: making room in RAM used to evict it
    all the same (its local copy lost for nothing, and, freeing "0 bytes",
    every other file with it). Room in the spill directory evicts it, and
    says so in bytes."""
    rig = Rig(tmp_path / "store")
    rig.store.spill_dir = str(tmp_path)
    h = rig.write("spilled", b"S" * (8 << 20), keep_open=True)
    rig.store.spill(h.inode)
    rig.store.release(h.fh)
    await run_until_flushed(rig)  # published first: the least recently used
    rig.write("ram", b"R" * (8 << 20))
    await run_until_flushed(rig)
    spilled, ram = rig.store.inode_at("spilled"), rig.store.inode_at("ram")
    assert rig.engine.evict(1) == 8 << 20  # one file of RAM
    assert not ram.data.resident and spilled.data.resident and spilled.data.spilled
    assert await rig.engine.make_spill_room()
    assert not spilled.data.resident
    assert rig.engine.residency.counters.evicted_bytes == 16 << 20 and not rig.engine.residency.lru
    assert not await rig.engine.make_spill_room()  # nothing left to free, nothing to wait for
    await rig.engine.load(spilled.ino)
    assert spilled.data.read(0, 4) == b"SSSS"


async def test_a_load_makes_room_for_the_whole_chunks_it_takes(tmp_path):
    """A load into RAM reserves whole chunks (a file of 7 MiB takes 8): it
    made room for the file's size only, found the budget short by the
    rest, and went to the spill directory with RAM full of published files
    it could have evicted (and, the spill directory full, a read failed
    with ENOSPC). It evicts for what it takes."""
    rig = Rig(tmp_path / "store")
    rig.store.pool.limit = 15 << 20
    rig.store.spill_dir = str(tmp_path)
    size = 7 << 20
    assert rig.store.ram_for(size) == 8 << 20
    for name in ("x", "y"):
        rig.write(name, os.urandom(size))
        await run_until_flushed(rig)
        rig.engine.evict(1 << 40)
    x, y = rig.store.inode_at("x"), rig.store.inode_at("y")
    await rig.engine.load(x.ino)
    assert x.data.resident and rig.store.free_bytes() == 7 << 20  # y's size, less than it takes
    await rig.engine.load(y.ino)
    assert y.data.resident and not y.data.spilled and not x.data.resident


async def test_wait_published_for_fsync_durable(tmp_path):
    rig = Rig(tmp_path / "store")
    h = rig.write("f", b"data", keep_open=True)
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        assert rig.store.seal(h.inode)
        with trio.fail_after(10):
            await rig.engine.wait_published(h.inode.ino, h.inode.generation)
        assert rig.files() == {"f": b"data"}
        n.cancel_scope.cancel()
    rig.store.release(h.fh)


async def test_failures_retry_until_the_store_comes_back(tmp_path):
    rig = Rig(tmp_path / "store")
    real_publish = rig.backend.publish
    calls = {"n": 0}

    def flaky(staged, path, pieces=(), mode=None):
        calls["n"] += 1
        if calls["n"] <= 4:
            raise ConnectionError("store unreachable")
        real_publish(staged, path, pieces, mode)

    rig.backend.publish = flaky
    rig.backend.publish_group = functools.partial(Backend.publish_group, rig.backend)  # groups meet the fault too
    rig.write("a", b"1")
    rig.write("b", b"2")

    async def watch():
        with trio.fail_after(10):
            while not any(g.state is State.FAILED for g in rig.engine.unpublished()):
                await trio.sleep(0.01)
        assert sum(g.state is State.FAILED for g in rig.engine.unpublished()) == 1 and "store unreachable" in rig.engine.failing()[0].error

    await run_until_flushed(rig, watch)
    assert rig.files() == {"a": b"1", "b": b"2"}


async def test_rewrite_during_publication_publishes_both_in_order(tmp_path):
    import threading

    rig = Rig(tmp_path / "store")
    entered, release = threading.Event(), threading.Event()
    real_publish = rig.backend.publish

    def slow_publish(staged, path, pieces=(), mode=None):
        if path == "latest":
            entered.set()
            release.wait(10)
        real_publish(staged, path, pieces, mode=mode)

    rig.backend.publish = slow_publish
    rig.write("latest", b"gen1")

    async def body():
        assert await trio.to_thread.run_sync(entered.wait, 10), "gen1's publication never began"
        rig.write("latest", b"gen2")  # sealed while gen1 is being published
        rig.backend.publish = real_publish
        release.set()

    await run_until_flushed(rig, body)
    assert rig.files() == {"latest": b"gen2"}
    assert rig.engine.published_gen[rig.store.inode_at("latest").ino] == 2


async def test_prefetch_loads_what_only_the_store_holds(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.mkdir("ckpt")
    rig.write("ckpt/a", b"A" * 1000)
    rig.write("other", b"O")
    await run_until_flushed(rig)
    rig2 = Rig(tmp_path / "store")
    await rig2.engine.scan()
    assert await rig2.engine.prefetch("ckpt") == (1, [])
    assert rig2.store.inode_at("ckpt/a").data.resident and not rig2.store.inode_at("other").data.resident


async def test_mode_changes_reach_the_manifest_and_come_back(tmp_path):
    rig = Rig(tmp_path / "store")
    h = rig.write("model.safetensors", b"x")
    await run_until_flushed(rig)
    rig.store.setattr(h.inode.ino, mode=0o600)
    await run_until_flushed(rig)
    assert manifest.read(rig.backend, "model.safetensors").mode == 0o600
    rig2 = Rig(tmp_path / "store")
    await rig2.engine.scan()
    assert stat.S_IMODE(rig2.store.inode_at("model.safetensors").mode) == 0o600


class FaultyBackend:
    """Wraps a backend: fails a share of calls at random, adds latency, and
    can be switched fully off (an outage). `lost_rate`: a share of the calls
    that do reach the store are reported failed all the same (their answer
    lost, as a call that timed out after the store carried it out)."""

    def __init__(self, inner, error_rate: float, latency_s: float, seed: int = 0, lost_rate: float = 0.0):
        import random

        self.inner, self.error_rate, self.latency_s, self.lost_rate = inner, error_rate, latency_s, lost_rate
        self.rng = random.Random(seed)
        self.down = False
        self.calls = self.failures = 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name in ("dirs", "staging", "daemon_id", "hidden_name") or not callable(attr):  # names, not store calls
            return attr

        def call(*args, **kwargs):
            import time as _t

            self.calls += 1
            _t.sleep(self.latency_s * self.rng.random())
            if self.down or self.rng.random() < self.error_rate:
                self.failures += 1
                raise ConnectionError(f"injected fault in {name}")
            out = attr(*args, **kwargs)
            if self.lost_rate and self.rng.random() < self.lost_rate:
                self.failures += 1
                raise ConnectionError(f"injected: the answer of {name} was lost")
            return out

        return call


async def test_staged_data_no_file_needs_is_deleted_though_the_first_try_fails(tmp_path):
    """Staged data that shows nothing (its file was overwritten or deleted)
    is deleted in the background: a transient failure is tried again (on
    S3 an upload left open costs storage until a restart)."""
    rig = Rig(tmp_path / "store")
    staged = rig.backend.stage([b"x" * 1000], 1000, "f")
    assert staged.token is not None and rig.backend.staged_exists(staged.token)
    real, tries = rig.backend.discard, []

    def discard(s):
        tries.append(s)
        if len(tries) == 1:
            raise ConnectionError("injected: the store did not answer")
        real(s)

    rig.backend.discard = discard
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        rig.engine.discard_soon(staged, "f")
        with trio.fail_after(10):
            while len(tries) < 2:
                await trio.sleep(0.01)
        n.cancel_scope.cancel()
    assert not rig.backend.staged_exists(staged.token)


async def test_faulty_store_every_file_eventually_published_byte_identical(tmp_path):
    rig = Rig(tmp_path / "store")
    faulty = FaultyBackend(rig.backend, error_rate=0.3, latency_s=0.005, seed=7)
    rig.engine.backend = faulty
    payloads = {f"ckpt/shard{i}": os.urandom(50_000 + i) for i in range(30)}
    rig.mkdir("ckpt")

    async def body():
        for i, (p, data) in enumerate(payloads.items()):
            rig.write(p, data)
            if i == 10:
                faulty.down = True  # a full outage for a while
            if i == 20:
                await trio.sleep(0.3)
                faulty.down = False
            await trio.lowlevel.checkpoint()
        rig.write("ckpt/.metadata", b"marker")  # written last

    await run_until_flushed(rig, body)
    assert faulty.failures > 10
    assert rig.files() == {**payloads, "ckpt/.metadata": b"marker"}
    from ckptfs.writeback.verify import verify

    report = verify(rig.backend)
    assert report.clean and len(report.ok) == 31


async def test_renamed_after_staging_is_published_under_its_final_name_without_a_second_upload(tmp_path):
    """Staging is bound to no name: a file staged under its temp name and
    renamed before its turn is published under the final name only (C4),
    from the one staged copy."""
    import threading

    rig = Rig(tmp_path / "store")
    backend = rig.backend
    staged_count = []
    real_stage = backend.stage
    gate = threading.Event()

    def stage(pieces, size, name=None, hidden=False):
        staged_count.append(size)
        if size == len(first):
            gate.wait(10)
        return real_stage(pieces, size, name, hidden)

    backend.stage = stage
    first, meta = b"1" * backend.stage_ahead_from, b"meta" * backend.stage_ahead_from  # staged ahead, not inline
    rig.write("first", first)
    rig.write(".metadata.tmp", meta)

    async def body():
        with trio.fail_after(10):
            while not any(g.staged is not None for g in rig.engine.unpublished()):
                await trio.sleep(0.01)
        rig.rename(".metadata.tmp", ".metadata")
        gate.set()

    await run_until_flushed(rig, body)
    assert rig.files() == {"first": first, ".metadata": meta}
    assert sorted(n for n in staged_count if n in (len(first), len(meta))) == [len(first), len(meta)]  # one upload each
    assert manifest.read(rig.backend, ".metadata.tmp") is None


def _evicted_big_file(tmp_path, size: int):
    rig = Rig(tmp_path / "store")
    data = os.urandom(1 << 20) * (size >> 20) + os.urandom(size % (1 << 20))
    rig.write("big", data)
    return rig, data


def _gate_loads(backend, gate) -> list[int]:
    """Loads from `backend` call `gate(offset)` before each read (one per
    block, two for the first: its lead, then the rest); returns the list of
    block numbers read, in order."""
    opened, order = backend.open_source, []

    def open_source(path):
        source = opened(path)
        read = source.read

        def gated(off, n, into=None):
            if off % manifest.BLOCK == 0:
                order.append(off // manifest.BLOCK)
            gate(off)
            yield from read(off, n, into)

        source.read = gated
        return source

    backend.open_source = open_source
    return order


async def test_a_load_serves_each_block_once_verified_before_the_rest_arrives(tmp_path):
    import threading

    rig, data = _evicted_big_file(tmp_path, 2 * manifest.BLOCK + 1000)
    await run_until_flushed(rig)
    assert len(manifest.read(rig.backend, "big").current.blocks) == 3
    node = rig.store.inode_at("big")
    assert rig.engine.evict(1 << 40) == node.data.allocated or not node.data.resident
    go = threading.Event()
    _gate_loads(rig.backend, lambda off: off < manifest.BLOCK or go.wait(30))  # the store stalls after the first block
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.load(node.ino, 0, 4096)
        assert not node.data.resident and node.data.read(0, 4096) == data[:4096]
        go.set()
        with trio.fail_after(20):
            await rig.engine.load(node.ino)
        assert node.data.resident and node.data.read(0, len(data)) == data
        assert rig.store.pool.used == node.data.allocated
        n.cancel_scope.cancel()


async def test_the_block_a_reader_waits_for_is_loaded_first(tmp_path):
    """torch.load reads a zip's directory at the end of the file first: that
    block must not wait for the whole file to load in order."""
    import threading

    rig, data = _evicted_big_file(tmp_path, 3 * manifest.BLOCK + 1000)
    await run_until_flushed(rig)
    node = rig.store.inode_at("big")
    rig.engine.evict(1 << 40)
    go = threading.Event()
    order = _gate_loads(rig.backend, lambda off: off == 3 * manifest.BLOCK or go.wait(30))  # only the last block comes
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.load(node.ino, len(data) - 100, len(data))
        assert node.data.read(len(data) - 100, 100) == data[-100:] and not node.data.resident
        go.set()
        with trio.fail_after(20):
            await rig.engine.load(node.ino, manifest.BLOCK + 5, manifest.BLOCK + 10)
            await rig.engine.load(node.ino)
        # then on from the start, each block once; the whole file, in RAM, is a load of its own, which
        # reads the descriptor the reads were served from (not counted here: the store file is not opened again)
        assert order[0] == 3 and sorted(order) == [0, 1, 2, 3]
        assert rig.engine.counters.loads == 2
        assert node.data.resident and node.data.read(0, len(data)) == data
        n.cancel_scope.cancel()


async def test_a_file_whose_record_has_no_block_hashes_loads_in_order_and_whole(tmp_path):
    """A record with only the whole file's hash (written before block
    hashes) cannot vouch for one block: the file is read in order and
    served once all of it is checked."""
    import threading

    rig, data = _evicted_big_file(tmp_path, 2 * manifest.BLOCK + 1000)
    await run_until_flushed(rig)
    node = rig.store.inode_at("big")
    rig.engine.evict(1 << 40)
    res = rig.engine.residency
    rec = manifest.read(rig.backend, "big")
    res.expect([node.ino], [rec._replace(current=manifest.Digest(rec.current.size, rec.current.xxh3))])
    go = threading.Event()
    order = _gate_loads(rig.backend, lambda off: off < 2 * manifest.BLOCK or go.wait(30))
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        asked = []

        async def reader():
            await rig.engine.load(node.ino, len(data) - 10, len(data))
            asked.append(True)

        n.start_soon(reader)
        with trio.fail_after(20):
            while len(order) < 3:
                await trio.sleep(0.01)
        await trio.sleep(0.2)
        assert order == [0, 1, 2] and not asked and not node.data.resident  # in order, nothing served yet
        go.set()
        with trio.fail_after(20):
            await rig.engine.load(node.ino)
        assert node.data.read(0, len(data)) == data
        n.cancel_scope.cancel()


async def test_a_record_with_too_few_block_hashes_never_serves_an_unchecked_block(tmp_path):
    """A record whose block list is short (damaged) cannot vouch for the
    blocks it lacks: the file loads in order and whole, and rot in such a
    block is caught by the whole file's hash."""

    rig, data = _evicted_big_file(tmp_path, 2 * manifest.BLOCK + 1000)
    await run_until_flushed(rig)
    node = rig.store.inode_at("big")
    rig.engine.evict(1 << 40)
    rec = manifest.read(rig.backend, "big")
    rig.engine.residency.expect([node.ino], [rec._replace(current=rec.current._replace(blocks=rec.current.blocks[:1]))])
    with open(tmp_path / "store" / "big", "r+b") as f:  # the last block rots in the store
        f.seek(2 * manifest.BLOCK + 10)
        f.write(bytes([data[2 * manifest.BLOCK + 10] ^ 1]))
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20), pytest.raises(OSError):
            await rig.engine.load(node.ino, len(data) - 100, len(data))
        assert not node.data.resident and rig.store.pool.used == 0
        n.cancel_scope.cancel()


async def test_a_corrupt_block_is_never_served(tmp_path):
    rig, data = _evicted_big_file(tmp_path, 2 * manifest.BLOCK + 1000)
    await run_until_flushed(rig)
    node = rig.store.inode_at("big")
    rig.engine.evict(1 << 40)
    with open(tmp_path / "store" / "big", "r+b") as f:  # the second block rots in the store
        f.seek(manifest.BLOCK + 10)
        f.write(bytes([data[manifest.BLOCK + 10] ^ 1]))
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.load(node.ino, 0, 4096)  # the first block is sound
            assert node.data.read(0, 4096) == data[:4096]
            with pytest.raises(OSError) as exc:
                await rig.engine.load(node.ino, 0, manifest.BLOCK + 20)
        assert "block 1" in str(exc.value) and "big" in rig.engine.verify_failures
        assert not node.data.resident and rig.store.pool.used == 0  # nothing half-loaded stays
        n.cancel_scope.cancel()


async def test_the_first_byte_of_a_file_waits_for_its_first_16_mib_alone(tmp_path):
    """A digest made now hashes blocks of 16 MiB (they were 64 MiB): a
    reader of a file's first bytes after a restart waits for one such
    block read and verified, not for the 64 MiB around it."""
    import threading

    rig, data = _evicted_big_file(tmp_path, 40 << 20)
    await run_until_flushed(rig)
    digest = manifest.read(rig.backend, "big").current
    assert digest.block_size == 16 << 20 and len(digest.blocks) == 3
    node = rig.store.inode_at("big")
    rig.engine.evict(1 << 40)
    go = threading.Event()
    order = _gate_loads(rig.backend, lambda off: off < 16 << 20 or go.wait(30))  # the store stalls past 16 MiB
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.load(node.ino, 0, 4096)
        assert node.data.read(0, 4096) == data[:4096] and order[0] == 0  # (block 1 may wait at the gate)
        go.set()
        with trio.fail_after(20):
            await rig.engine.load(node.ino)
        assert node.data.read(0, len(data)) == data
        n.cancel_scope.cancel()


@pytest.mark.parametrize("where", ["in place", "in RAM", "spilled"])
async def test_a_files_first_mib_is_served_once_it_verifies_before_the_rest_of_its_block(tmp_path, where):
    """A reader's first requests (a header, the first bytes) wait for the
    file's lead (its first MiB) read and verified, not for the 16 MiB
    block around it: read from a local store in place, or into RAM or the
    spill directory from an object store."""
    import threading

    store = tmp_path / "store" if where == "in place" else f"memory://{tmp_path.name}-lead"
    rig = Rig(store)
    data = os.urandom(20 << 20)
    rig.write("big", data)
    await run_until_flushed(rig)
    digest = manifest.read(rig.backend, "big").current
    assert digest.lead == xxhash.xxh3_128(data[: manifest.LEAD]).hexdigest()
    node = rig.store.inode_at("big")
    rig.engine.evict(1 << 40)
    if where == "spilled":
        rig.store.spill_dir = str(tmp_path)
        rig.store.pool.reserve(rig.store.pool.available)  # no room in RAM
    go = threading.Event()
    order = _gate_loads(rig.backend, lambda off: off < manifest.LEAD or go.wait(30))  # the store stalls past the lead
    try:
        async with trio.open_nursery() as n:
            await n.start(rig.engine.run)
            with trio.fail_after(20):
                await rig.engine.load(node.ino, 0, 4096)
                await rig.engine.load(node.ino, manifest.LEAD - 100, manifest.LEAD)
            assert not node.data.resident and order == [0]
            assert node.data.read(0, 4096) == data[:4096] and node.data.read(manifest.LEAD - 100, 100) == data[manifest.LEAD - 100 : manifest.LEAD]
            assert (node.data.borrowed is not None) == (where == "in place") and (node.data.spilled if where == "spilled" else True)
            asked = []

            async def past_the_lead():
                await rig.engine.load(node.ino, 0, manifest.LEAD + 1)
                asked.append(True)

            n.start_soon(past_the_lead)
            await trio.sleep(0.2)
            assert not asked  # one byte more waits for the block
            go.set()
            with trio.fail_after(20):
                await rig.engine.load(node.ino)
            assert asked and node.data.read(0, len(data)) == data
            n.cancel_scope.cancel()
    finally:
        go.set()


async def test_a_file_whose_lead_rots_is_never_served_and_one_that_rots_past_it_serves_its_lead_alone(tmp_path):
    rig, data = _evicted_big_file(tmp_path, 20 << 20)
    await run_until_flushed(rig)
    node = rig.store.inode_at("big")
    rig.engine.evict(1 << 40)

    def rot(at: int) -> None:
        with open(tmp_path / "store" / "big", "r+b") as f:
            f.seek(at)
            f.write(bytes([data[at] ^ 1]))

    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        rot(2 << 20)  # past the lead, within the first block
        with trio.fail_after(20):
            await rig.engine.load(node.ino, 0, 4096)  # the lead is sound
            assert node.data.read(0, 4096) == data[:4096]
            with pytest.raises(OSError) as exc:
                await rig.engine.load(node.ino, 0, manifest.LEAD + 1)
        assert "block 0" in str(exc.value)
        rot(2 << 20)  # (mended)
        rot(10)  # in the lead
        rig.engine.residency.verify_failures.clear()
        with trio.fail_after(20), pytest.raises(OSError) as exc:
            await rig.engine.load(node.ino, 0, 4096)
        assert f"first {manifest.LEAD} bytes" in str(exc.value) and "big" in rig.engine.verify_failures
        assert not node.data.resident and rig.store.pool.used == 0
        n.cancel_scope.cancel()


def _old_digest(data: bytes) -> manifest.Digest:
    """`data`'s digest as a daemon of before 2026-11-29 made it: blocks of 64 MiB."""
    import xxhash

    step = manifest.OLD_BLOCK
    blocks = [xxhash.xxh3_128(data[i : i + step]).hexdigest() for i in range(0, len(data), step)]
    return manifest.Digest(len(data), xxhash.xxh3_128(data).hexdigest(), tuple(blocks) if len(blocks) > 1 else (), step)


async def test_a_file_published_with_blocks_of_64_mib_loads_block_by_block_against_them(tmp_path):
    """A store written before blocks of 16 MiB: its records' block hashes
    are of 64 MiB. A load verifies and serves such a file 64 MiB at a time,
    the block a reader waits for first, and a rotten block is never served."""
    import threading

    rig, data = _evicted_big_file(tmp_path, manifest.OLD_BLOCK + (20 << 20))
    await run_until_flushed(rig)
    node = rig.store.inode_at("big")
    rig.engine.evict(1 << 40)
    rec = manifest.read(rig.backend, "big")
    old = _old_digest(data)
    assert old == rec.current and len(old.blocks) == 2
    rig.engine.residency.expect([node.ino], [rec._replace(current=old)])
    go = threading.Event()
    order = _gate_loads(rig.backend, lambda off: off == manifest.OLD_BLOCK or go.wait(30))  # only the last block comes
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.load(node.ino, len(data) - 100, len(data))
        assert node.data.read(len(data) - 100, 100) == data[-100:]
        go.set()
        with trio.fail_after(20):
            await rig.engine.load(node.ino)
        assert [i * manifest.BLOCK for i in order] == [manifest.OLD_BLOCK, 0]  # two reads, of 64 MiB and the rest
        assert node.data.read(0, len(data)) == data
        rig.engine.evict(1 << 40)
        with open(tmp_path / "store" / "big", "r+b") as f:  # rot past 16 MiB, within the first 64 MiB
            f.seek(20 << 20)
            f.write(bytes([data[20 << 20] ^ 1]))
        rig.engine.residency.expect([node.ino], [rec._replace(current=old)])
        with trio.fail_after(20), pytest.raises(OSError):
            await rig.engine.load(node.ino, 0, 4096)  # its block is all of the first 64 MiB
        with trio.fail_after(20):
            await rig.engine.load(node.ino, len(data) - 100, len(data))
        assert node.data.read(len(data) - 100, 100) == data[-100:]  # the sound block is served
        n.cancel_scope.cancel()


@pytest.mark.parametrize("holds", ["current", "previous"])
async def test_a_file_whose_two_digests_have_blocks_of_two_sizes_loads_whichever_the_store_holds(tmp_path, holds):
    """Republished across the change of block size, a file's record may
    name a current digest with blocks of 16 MiB and a previous one with
    blocks of 64 MiB, of the same size: the store may hold either. The load
    verifies against both (the one with the smaller blocks checked whole)."""
    rig, data = _evicted_big_file(tmp_path, manifest.OLD_BLOCK + (1 << 20))
    await run_until_flushed(rig)
    node = rig.store.inode_at("big")
    rig.engine.evict(1 << 40)
    other = os.urandom(len(data))
    rec = manifest.read(rig.backend, "big")
    rig.engine.residency.expect([node.ino], [rec._replace(previous=_old_digest(other))])
    if holds == "previous":
        (tmp_path / "store" / "big").write_bytes(other)
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.load(node.ino, 0, 4096)
            await rig.engine.load(node.ino)
        assert node.data.read(0, len(data)) == (data if holds == "current" else other)
        n.cancel_scope.cancel()


def _store_fds(path) -> int:
    """How many of this process's descriptors are open on `path`."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
    return n


async def _published_and_evicted(tmp_path, size: int):
    """A file "big" of `size` random bytes, published, then evicted."""
    rig, data = _evicted_big_file(tmp_path, size)
    await run_until_flushed(rig)
    node = rig.store.inode_at("big")
    rig.engine.evict(1 << 40)
    return rig, data, node


async def _read_all(rig: Rig, node, size: int) -> None:
    """A reader of every byte of `node`, and its load over."""
    with trio.fail_after(20):
        await rig.engine.load(node.ino, 0, size)
    await _loads_over(rig)


async def _loads_over(rig: Rig) -> None:
    """Until no load runs (a reader is answered before its load's end)."""
    with trio.fail_after(20):
        while rig.engine.residency._loads:
            await trio.sleep(0.01)


async def test_a_load_after_a_restart_whose_file_the_publisher_moved_meanwhile_keeps_its_own_record(tmp_path):
    """After a restart from the manifest index, a load verifies against the
    index's record, and one that fails reads the record the store holds at
    its path. When the failure came from the publisher moving the file
    meanwhile (renamed in the mount, another file published at its old
    name), the record there is the other file's: the load must go on from
    the file's new name against its own record. (Asked in the other order,
    the other file's record became the one to verify against, and the load
    started again and again.)"""
    import threading

    rig = Rig(tmp_path / "store")
    mine, other = os.urandom(5000), os.urandom(7000)
    rig.write("a", mine)
    await run_until_flushed(rig)
    node = rig.store.inode_at("a")
    rig.engine.evict(1 << 40)
    assert not node.data.resident
    residency = rig.engine.residency
    residency.recheck = True  # as after a scan from the index, which gave this record
    residency.expect([node.ino], [manifest.read(rig.backend, "a")])
    go, waiting = threading.Event(), threading.Event()
    opened = rig.backend.open_source

    def open_source(path):  # the load's first open of the store file waits for the test
        if not go.is_set():
            waiting.set()
            go.wait(30)
        return opened(path)

    rig.backend.open_source = open_source
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        n.start_soon(rig.engine.load, node.ino)
        with trio.fail_after(20):
            while not waiting.is_set():
                await trio.sleep(0.01)
            rig.rename("a", "y")
            rig.write("a", other)
            await rig.engine.flush()  # the store: this file at y, the other one at a
            go.set()
            await rig.engine.load(node.ino)
        assert node.data.read(0, len(mine)) == mine
        await _loads_over(rig)
        n.cancel_scope.cancel()
    assert rig.files() == {"y": mine, "a": other}


async def test_a_reader_of_a_large_file_in_a_local_store_is_served_in_place(tmp_path):
    """Reads of an evicted file in a local store come from the store's file,
    verified block by block: nothing of it stays in RAM (a cold torch.load
    after a restart paid for 2 GiB of fresh memory and a copy; the blocks
    held for the reader go once no read comes). A writer loads it into
    RAM, and then the store file is let go."""
    rig, data, node = await _published_and_evicted(tmp_path, 2 * manifest.BLOCK + 1000)
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.load(node.ino, len(data) - 10, len(data))
            assert node.data.read(len(data) - 10, 10) == data[-10:]
            await rig.engine.load(node.ino, 0, len(data))
        await _loads_over(rig)
        assert b"".join(node.data.read(off, 1 << 20) for off in range(0, len(data), 1 << 20)) == data
        with trio.fail_after(20):
            while rig.store.pool.used:
                await trio.sleep(0.05)
        assert not node.data.resident
        assert rig.engine.counters.loads == 1 and _store_fds(tmp_path / "store" / "big") == 1
        with trio.fail_after(20):
            await rig.engine.load(node.ino)  # a writer's
        assert node.data.resident and rig.store.pool.used == node.data.allocated > 0
        assert node.data.read(0, len(data)) == data and node.data.borrowed is None
        assert _store_fds(tmp_path / "store" / "big") == 0
        n.cancel_scope.cancel()


async def test_a_reader_in_place_is_answered_from_the_blocks_just_verified(tmp_path, monkeypatch):
    """Reads of a file served in place come from the blocks its load just
    verified, held in RAM for the reader (views, not copies out of the store
    file's page cache); the load keeps pace with its reader, so every read
    past the first block finds its block held, and never more than
    HELD_BYTES are."""
    import mmap

    monkeypatch.setattr(loading, "HELD_IDLE_S", 3600.0)  # a slow machine's pause between two reads lets no block go
    monkeypatch.setattr(loading, "HELD_MAX_S", 3600.0)
    monkeypatch.setattr(loading, "HELD_BYTES", 3 * manifest.BLOCK)  # fewer than the blocks the reader goes through
    rig, data, node = await _published_and_evicted(tmp_path, 5 * manifest.BLOCK + 1000)
    most = 0
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        for off in range(0, len(data), 1 << 20):
            with trio.fail_after(20):
                await rig.engine.load(node.ino, off, off + (1 << 20))
            piece = node.data.read(off, 1 << 20)
            if off >= manifest.BLOCK:  # the first block a load verifies is not held (no fresh RAM before it is served)
                assert isinstance(piece, memoryview) and isinstance(piece.obj, mmap.mmap), off
            assert piece == data[off : off + (1 << 20)]
            del piece
            most = max(most, rig.store.pool.used)
        await _loads_over(rig)
        assert 0 < most <= loading.HELD_BYTES
        assert rig.store.pool.used == memory.CHUNK  # the last block alone: the reads went past the others
        n.cancel_scope.cancel()


async def test_a_load_in_place_keeping_pace_goes_on_at_once_for_a_reader_that_waits(tmp_path, monkeypatch):
    """A load waits while its reader is still at the blocks held for it, but
    not when a reader waits for bytes not served yet (the end of the file,
    say): then the oldest held block goes."""
    monkeypatch.setattr(loading, "HELD_IDLE_S", 3600.0)  # nothing goes for lack of reads, or for time
    monkeypatch.setattr(loading, "HELD_MAX_S", 3600.0)
    monkeypatch.setattr(loading, "HELD_BYTES", 3 * manifest.BLOCK)
    rig, data, node = await _published_and_evicted(tmp_path, 5 * manifest.BLOCK + 1000)
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.load(node.ino, manifest.BLOCK, manifest.BLOCK + 4096)
            while rig.store.pool.used < loading.HELD_BYTES:  # blocks 2-4 held (1, the first verified, is not)
                await trio.sleep(0.01)
            await rig.engine.load(node.ino, len(data) - 100, len(data))
        assert bytes(node.data.read(len(data) - 100, 100)) == data[-100:]
        assert node.data.read(manifest.BLOCK, 10) == data[manifest.BLOCK : manifest.BLOCK + 10]
        n.cancel_scope.cancel()


async def test_eviction_lets_go_of_the_blocks_held_for_readers_first(tmp_path, monkeypatch):
    """Blocks held for the reader of a file read in place are RAM that
    files may want: eviction (a writer making room, `ckptfs evict`) lets
    them go first, and the reader reads on from the store file."""
    monkeypatch.setattr(loading, "HELD_IDLE_S", 3600.0)  # they would stay held for as long
    monkeypatch.setattr(loading, "HELD_MAX_S", 3600.0)
    rig, data, node = await _published_and_evicted(tmp_path, 3 * manifest.BLOCK + 1000)
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.load(node.ino, 0, 4096)
        await _loads_over(rig)
        held = rig.store.pool.used
        assert held > 0
        assert rig.engine.evict(1) == held and rig.store.pool.used == 0
        assert bytes(node.data.read(2 * manifest.BLOCK, 100)) == data[2 * manifest.BLOCK : 2 * manifest.BLOCK + 100]
        n.cancel_scope.cancel()


async def test_a_load_the_daemon_stops_is_not_logged_as_an_error(tmp_path, caplog):
    """Unmounting while a file loads (its reader read a few bytes of a big
    file, say) stops the load: said so, not logged as an error loading it."""
    import logging
    import threading

    rig, _, node = await _published_and_evicted(tmp_path, 2 * manifest.BLOCK + 1000)
    go = threading.Event()
    _gate_loads(rig.backend, lambda off: off < manifest.BLOCK or go.wait(30))  # the store stalls after the first block
    try:
        with caplog.at_level(logging.INFO, logger="ckptfs.writeback.residency"):
            async with trio.open_nursery() as n:
                await n.start(rig.engine.run)
                with trio.fail_after(20):
                    await rig.engine.load(node.ino, 0, 4096)
                n.cancel_scope.cancel()  # the daemon stops with the load under way
    finally:
        go.set()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "stopped loading big: the daemon is stopping" in caplog.text


async def test_a_load_in_place_whose_reader_stopped_goes_on_and_lets_its_ram_go(tmp_path):
    """A load waits for its reader only while the reader reads: one that
    stopped after the first bytes does not stall it, and what it held goes
    once no read comes."""
    rig, data, node = await _published_and_evicted(tmp_path, 5 * manifest.BLOCK + 1000)
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.load(node.ino, 0, 4096)
        assert node.data.read(0, 4096) == data[:4096]
        await _loads_over(rig)
        assert node.data.borrowed.covers(0, None) and rig.engine.counters.loads == 1
        with trio.fail_after(20):
            while rig.store.pool.used:
                await trio.sleep(0.05)
        assert bytes(node.data.read(3 * manifest.BLOCK, 100)) == data[3 * manifest.BLOCK : 3 * manifest.BLOCK + 100]
        n.cancel_scope.cancel()


async def test_a_file_served_in_place_whose_store_file_changes_is_verified_again(tmp_path):
    """The bytes served in place are the ones verified: a store file written
    in place afterwards (ckptfs never does) ends the borrow, and the next
    read verifies again: EIO, never the changed bytes. A chmod of it (the
    publisher's) does not."""
    rig, data, node = await _published_and_evicted(tmp_path, 2 * manifest.BLOCK + 1000)
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        await _read_all(rig, node, len(data))
        assert node.data.read(manifest.BLOCK + 5, 10) == data[manifest.BLOCK + 5 : manifest.BLOCK + 15]
        os.chmod(tmp_path / "store" / "big", 0o600)  # the publisher's chmod (a new ctime) changes no byte
        with trio.fail_after(20):
            await rig.engine.load(node.ino, 0, len(data))
        assert rig.engine.counters.loads == 1 and not rig.engine.residency._loads
        with open(tmp_path / "store" / "big", "r+b") as f:  # the second block rots in place
            f.seek(manifest.BLOCK + 10)
            f.write(bytes([data[manifest.BLOCK + 10] ^ 1]))
        with trio.fail_after(20), pytest.raises(OSError) as exc:
            await rig.engine.load(node.ino, manifest.BLOCK + 5, manifest.BLOCK + 15)
        assert exc.value.errno == errno.EIO and "block 1" in str(exc.value)
        n.cancel_scope.cancel()


async def test_a_store_file_written_in_place_while_its_first_block_is_read_is_never_served(tmp_path, monkeypatch):
    """The status a borrow checks its store file against is the one the load
    saw when it opened the file, before it read a byte: a write in place
    while the first block is read (after the bytes it changes were read and
    hash as they should) ends the borrow, and the reader gets EIO, never
    the changed byte. (Taken when the descriptor reached the event loop,
    after that block, it would miss the write.)"""
    rig, data, node = await _published_and_evicted(tmp_path, 2 * manifest.BLOCK + 1000)
    store_file = tmp_path / "store" / "big"
    read = backend_module._FileSource.read

    def read_then_written(self, off, n, into=None):
        yield from read(self, off, n, into)
        if off == 0:  # the first block read, not yet served: another tool writes the file in place
            st = store_file.stat()
            with open(store_file, "r+b") as f:
                f.seek(10)
                f.write(bytes([data[10] ^ 1]))
            os.utime(store_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # (a later mtime, even on a coarse clock)

    monkeypatch.setattr(backend_module._FileSource, "read", read_then_written)
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20), pytest.raises(OSError) as exc:
            await rig.engine.load(node.ino, 0, 4096)
        assert exc.value.errno == errno.EIO
        n.cancel_scope.cancel()


@pytest.mark.parametrize("named", [True, False], ids=["named", "deleted-while-open"])
async def test_a_load_into_ram_from_the_store_file_served_in_place_is_verified_again(tmp_path, named):
    """A load into RAM (a writer's) of a file served whole in place reads
    the descriptor the reads came from, and verifies again: a store file
    rotten in place under it (size and mtime as before, so the borrow did
    not notice) fails the load with EIO, ends the borrow, and goes no
    round through the publisher's paths (a named file's mount path is not
    its store path after a rename, which read as "moved": a load again
    from the same descriptor, for ever)."""
    rig, data, node = await _published_and_evicted(tmp_path, 2 * manifest.BLOCK + 1000)
    reader = rig.store.open(node.ino, os.O_RDONLY)
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        await _read_all(rig, node, len(data))
        n.cancel_scope.cancel()
    # The engine stopped: the rename waits for its turn (the store has the file at "big"), the load runs here
    rig.rename("big", "moved")
    store_file = tmp_path / "store" / "big"
    st = store_file.stat()
    with open(store_file, "r+b") as f:
        f.seek(manifest.BLOCK + 10)
        f.write(bytes([data[manifest.BLOCK + 10] ^ 1]))
    os.utime(store_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    if not named:
        rig.unlink("moved")
    assert node.data.borrowed is not None
    with trio.fail_after(20), pytest.raises(OSError) as exc:
        await rig.engine.load(node.ino)
    assert exc.value.errno == errno.EIO and "block 1" in str(exc.value)
    assert node.data.borrowed is None and not node.data.resident
    rig.store.release(reader.fh)


async def test_a_held_file_served_in_place_keeps_its_borrow_through_a_failed_load_into_ram(tmp_path, monkeypatch):
    """A file deleted while a process reads it in place has no copy but the
    store file it is served from. A load into RAM (a writer's) that fails
    for a passing reason ended that borrow with it (a failed load evicts
    what it half-loaded), and the next try found the file nowhere: EIO.
    The borrow goes on, and the next try reads it again."""
    from ckptfs.writeback import residency

    rig, data, node = await _published_and_evicted(tmp_path, 2 * manifest.BLOCK + 1000)
    reader = rig.store.open(node.ino, os.O_RDONLY)

    async def body():
        await _read_all(rig, node, len(data))
        rig.unlink("big")

    await run_until_flushed(rig, body)
    assert rig.files() == {} and node.data.borrowed is not None
    failed: list[int] = []
    source_of = residency.source_of

    def flaky(fd: int):
        if not failed:
            failed.append(fd)
            os.close(fd)
            raise OSError(errno.EIO, "a passing failure")
        return source_of(fd)

    monkeypatch.setattr(residency, "source_of", flaky)
    with trio.fail_after(20):
        await rig.engine.load(node.ino)
    assert failed and node.data.resident and node.data.read(0, len(data)) == data
    rig.store.release(reader.fh)


async def test_a_read_in_place_that_would_wait_for_the_disk_is_handed_off_the_event_loop(tmp_path):
    """Served in place, a read whose bytes left the page cache would wait for
    the store's disk on the event loop (on a network file system, seconds
    in which no other request is answered): it says so instead, and the
    bytes come from a read of its own in a worker thread."""
    from ckptfs.fs.loading import WouldBlock

    rig, data, node = await _published_and_evicted(tmp_path, 2 * manifest.BLOCK + 1000)
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        await _read_all(rig, node, len(data))
        with trio.fail_after(20):  # the blocks held for the reader go once no read comes
            while rig.store.pool.used:
                await trio.sleep(0.05)
        assert node.data.read(5, 10) == data[5:15]  # just verified: in the page cache
        fd = os.open(tmp_path / "store" / "big", os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the kernel lets the store file's pages go
        os.close(fd)
        with pytest.raises(WouldBlock) as slow:
            node.data.read(manifest.BLOCK, 1 << 20)
        got = await trio.to_thread.run_sync(slow.value.reader())
        assert got == data[manifest.BLOCK : manifest.BLOCK + (1 << 20)] and slow.value.still_served()
        n.cancel_scope.cancel()


async def test_files_served_in_place_at_once_are_bounded(tmp_path, monkeypatch):
    """Each file served in place holds a descriptor of its store file: only
    the most recently read IN_PLACE_MAX do; the others are let go (a read
    verifies them again)."""
    from ckptfs.writeback import residency

    monkeypatch.setattr(residency, "IN_PLACE_MAX", 2)
    rig = Rig(tmp_path / "store")
    files = {f"f{i}": os.urandom(residency.IN_PLACE_FROM) for i in range(4)}
    for name, data in files.items():
        rig.write(name, data)
    await run_until_flushed(rig)
    rig.engine.evict(1 << 40)
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        for round_ in range(2):
            for name, data in files.items():
                node = rig.store.inode_at(name)
                with trio.fail_after(20):
                    await rig.engine.load(node.ino, 0, len(data))
                assert node.data.read(0, len(data)) == data and not node.data.resident
                await _loads_over(rig)  # its worker's own descriptor closed
                open_now = [m for m in files if rig.store.inode_at(m).data.borrowed is not None]
                assert len(open_now) <= 2, (round_, open_now)
                assert sum(_store_fds(tmp_path / "store" / m) for m in files) <= 2
        await _loads_over(rig)
        await trio.sleep(3 * loading.HELD_IDLE_S)  # the blocks held for the last readers go once no read comes
        assert rig.engine.counters.loads == 8 and rig.store.pool.used == 0
        n.cancel_scope.cancel()


async def test_a_reader_waiting_on_a_load_dropped_by_a_truncate_gets_the_file_as_it_is_now(tmp_path):
    import threading

    rig, _ = _evicted_big_file(tmp_path, 2 * manifest.BLOCK)
    await run_until_flushed(rig)
    node = rig.store.inode_at("big")
    rig.engine.evict(1 << 40)
    go = threading.Event()
    _gate_loads(rig.backend, lambda off: go.wait(30))

    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        waited = []

        async def reader():
            await rig.engine.load(node.ino)
            waited.append(True)

        n.start_soon(reader)
        await trio.sleep(0.2)
        rig.store.setattr(node.ino, size=0)  # open(O_TRUNC) meanwhile: the load is dropped
        go.set()
        with trio.fail_after(20):
            while not waited:
                await trio.sleep(0.01)
        assert node.data.resident and node.data.size == 0
        n.cancel_scope.cancel()


async def test_settled_generations_leave_the_in_flight_set(tmp_path):
    """Status and removals look at the generations still in flight; once
    published they must leave it (they stayed forever: status cost O(files
    ever written) per query)."""
    rig = Rig(tmp_path / "store")
    for i in range(50):
        rig.write(f"f{i}", b"x" * i)
    rig.write("f0", b"again")  # supersedes one
    await run_until_flushed(rig)
    assert len(rig.files()) == 50
    assert not rig.engine.unsettled


async def test_a_small_file_whose_bytes_cannot_be_read_is_retried_and_the_engine_lives(tmp_path):
    """Small files are hashed on the spot; an I/O error reading a snapshot
    (a spilled file's disk) is a failed try like any other. It used to
    escape as an illegal state change and end the whole engine."""
    rig = Rig(tmp_path / "store")
    h = rig.write("small", b"bytes")
    gen = rig.engine.pending[h.inode.ino]
    real = gen.snapshot.pieces
    calls = []

    def pieces():
        calls.append(1)
        if len(calls) == 1:
            raise OSError(5, "Input/output error (injected)")
        return real()

    gen.snapshot.pieces = pieces
    await run_until_flushed(rig)
    assert rig.files() == {"small": b"bytes"} and len(calls) >= 2


# -- staging while written (streaming.py) ----------------------------------------------
def _staging_files(root) -> list[str]:
    staging = root / ".ckptfs" / "staging"
    return [str(p) for p in staging.rglob("*") if p.is_file()] if staging.exists() else []


@pytest.mark.parametrize("end", ["closed", "deleted while open", "rewritten below what was staged"])
async def test_a_file_staged_while_written_holds_no_memory_of_its_own(tmp_path, end):
    """Whatever becomes of a file staged while written, every chunk handed to
    its upload thread is given back: the RAM pool ends holding the file's
    own bytes only (or nothing, once it is deleted), and no staging is left."""
    rig = Rig(tmp_path / "store")
    pool = rig.store.pool
    data = os.urandom(96 << 20)
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        h = rig.store.create(ROOT, b"shard.bin", 0o644, W, 0, 0)
        for off in range(0, len(data), 1 << 20):
            rig.store.write(h.fh, off, data[off : off + (1 << 20)])
            await trio.sleep(0)
        with trio.fail_after(20):  # handed out, and being staged
            while sum(os.path.getsize(p) for p in _staging_files(tmp_path / "store")) < 64 << 20:
                await trio.sleep(0.01)
        if end == "deleted while open":
            rig.unlink("shard.bin")
        elif end == "rewritten below what was staged":
            rig.store.write(h.fh, 0, b"new header")
        rig.store.release(h.fh)
        with trio.fail_after(20):
            await rig.engine.flush()
            while _staging_files(tmp_path / "store") or rig.engine.streams.running:
                await trio.sleep(0.01)
        await trio.sleep(0.1)  # the last snapshots' releases, asked for by the upload thread
        n.cancel_scope.cancel()
    if end == "deleted while open":
        assert rig.files() == {} and pool.used == 0
    else:
        expected = b"new header" + data[10:] if end.startswith("rewritten") else data
        assert rig.files() == {"shard.bin": expected}
        inode = rig.store.inode_at("shard.bin")
        assert pool.used == inode.data.allocated == len(data)
        assert rig.engine.counters.staged_while_written == (1 if end == "closed" else 0)


@pytest.mark.parametrize("move", ["rename", "exchange"])
async def test_a_load_whose_file_the_publisher_moves_meanwhile_loads_it_from_its_new_name(tmp_path, move):
    """A rename's or an exchange's turn does not wait for loads: a load that
    opens the old name after the store moved the file finds nothing there,
    or the other file's bytes. It must load the file from its new name, not
    fail with EIO ('missing from the store', 'checksum mismatch')."""
    import threading

    from ckptfs.fs.tree import RENAME_EXCHANGE

    rig, data = _evicted_big_file(tmp_path, manifest.BLOCK + 1000)
    if move == "exchange":
        rig.write("other", os.urandom(7000))
    await run_until_flushed(rig)
    node = rig.store.inode_at("big")
    rig.engine.evict(1 << 40)
    assert not node.data.resident
    go, opened_at = threading.Event(), []
    opened = rig.backend.open_source

    def open_source(path):
        opened_at.append(path)
        go.wait(30)  # the load opens the file only after the store moved it
        return opened(path)

    rig.backend.open_source = open_source
    new = "moved" if move == "rename" else "other"
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        got = []

        async def reader():
            await rig.engine.load(node.ino)
            got.append(node.data.read(0, len(data)))

        n.start_soon(reader)
        with trio.fail_after(20):
            while not opened_at:
                await trio.sleep(0.01)
            if move == "rename":
                rig.rename("big", new)
            else:
                rig.store.rename(ROOT, b"big", ROOT, new.encode(), RENAME_EXCHANGE)
            await rig.engine.flush()  # the move's turn: the store has the file at its new name
        assert (tmp_path / "store" / new).read_bytes() == data
        go.set()
        with trio.fail_after(20):
            while not got:
                await trio.sleep(0.01)
        assert got == [data] and opened_at == ["big", new]
        assert not rig.engine.verify_failures
        n.cancel_scope.cancel()


async def _evicted_at_two_names(tmp_path, name: str, link: str):
    """A file published at `name` and its hard link `link`, evicted from RAM."""
    rig = Rig(tmp_path / "store")
    data = os.urandom(5000)
    h = rig.write(name, data)
    rig.store.link(h.inode.ino, ROOT, link.encode())
    await run_until_flushed(rig)
    rig.engine.evict(1 << 40)
    assert not h.inode.data.resident
    return rig, h, data


async def _load_while(rig: Rig, inode, opened_at: list, change) -> bytes:
    """Load `inode` with the engine running; once the load has opened the
    store (`opened_at` filled by a hooked `open_source`), apply `change` to
    the mount and flush. Returns the bytes the load brought back."""
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        got = []

        async def reader():
            await rig.engine.load(inode.ino)
            got.append(bytes(inode.data.read(0, inode.data.size)))

        n.start_soon(reader)
        with trio.fail_after(20):
            while not opened_at:
                await trio.sleep(0.01)
            change()
            await rig.engine.flush()
            while not got:
                await trio.sleep(0.01)
        assert not rig.engine.verify_failures
        n.cancel_scope.cancel()
    return got[0]


async def test_a_load_that_opens_a_name_while_another_file_takes_it_loads_the_file_from_its_other_name(tmp_path):
    """The publisher replaced the name the load opened (a rename over it)
    and had not yet recorded where the file is still shown (its hard link)
    when the load found other bytes there: the load failed with 'the store
    has N bytes', though the file was in the store all along."""
    import threading

    rig, h, data = await _evicted_at_two_names(tmp_path, "big", "twin")
    rig.write("other", os.urandom(4000))
    await run_until_flushed(rig)
    opened_at, go, checking = [], threading.Event(), threading.Event()
    backend = rig.backend
    opened, moved = backend.open_source, backend.move

    def open_source(path):
        opened_at.append(path)
        go.wait(30)  # opened once the store has the other file at this name
        return opened(path)

    def move(src, dst):
        moved(src, dst)
        go.set()
        checking.wait(30)  # the rename's turn goes on once the load found the other bytes

    checked = rig.engine.residency._moved

    async def _moved(load):
        checking.set()
        return await checked(load)

    backend.open_source, backend.move, rig.engine.residency._moved = open_source, move, _moved
    assert await _load_while(rig, h.inode, opened_at, lambda: rig.rename("other", "big")) == data
    assert opened_at == ["big", "twin"]


async def test_a_load_that_opens_a_name_in_the_moment_the_file_is_not_there_loads_it_when_it_is_back(tmp_path):
    """A file at two names (a hard link): its first name deleted, its
    other name renamed to the first. A load that opened the first name
    between the delete and the move found nothing, and by the time it
    looked, the store showed the file at that same name again: it failed
    with 'missing from the store'."""
    import threading

    rig, h, data = await _evicted_at_two_names(tmp_path, "a", "b")
    opened_at, moving, failed = [], threading.Event(), threading.Event()
    backend = rig.backend
    opened, moved = backend.open_source, backend.move

    def open_source(path):
        opened_at.append(path)
        if len(opened_at) == 1:
            moving.wait(30)  # opened once the store has nothing at this name
        try:
            return opened(path)
        finally:
            failed.set()

    def move(src, dst):
        moving.set()
        failed.wait(30)  # the file comes back to its first name once the load found nothing there
        moved(src, dst)

    backend.open_source, backend.move = open_source, move

    def change():
        rig.unlink("a")
        rig.rename("b", "a")

    assert await _load_while(rig, h.inode, opened_at, change) == data
    assert opened_at == ["a", "a"]


class _Failing:
    """Wraps a backend: the named calls fail while `failing` holds them."""

    def __init__(self, inner, *names: str, times: int = 1_000_000):
        self.inner, self.failing, self.times = inner, set(names), times

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in self.failing or not callable(attr):
            return attr

        def call(*args, **kwargs):
            if name in self.failing and self.times > 0:
                self.times -= 1
                raise ConnectionError(f"injected fault in {name}")
            return attr(*args, **kwargs)

        return call


async def test_a_load_that_fails_for_a_passing_reason_is_tried_again(tmp_path):
    rig = Rig(tmp_path / "store")
    data = os.urandom(5000)
    rig.write("f", data)
    await run_until_flushed(rig)
    node = rig.store.inode_at("f")
    rig.engine.evict(1 << 40)
    rig.engine.backend = _Failing(rig.backend, "open_source", times=2)  # fewer than LOAD_TRIES
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            await rig.engine.load(node.ino)
        assert node.data.read(0, len(data)) == data
        n.cancel_scope.cancel()


@pytest.mark.parametrize("how", ["abandoned at its deadline", "refused (EACCES)"])
async def test_a_load_that_fails_its_tries_gives_its_reader_eio(tmp_path, how):
    """As a store failure, whatever the store said: a load whose every try
    was abandoned gave its reader ETIMEDOUT, one the store refused EACCES
    (a read of a file the mount lets it read)."""
    rig = Rig(tmp_path / "store")
    rig.write("f", os.urandom(5000))
    await run_until_flushed(rig)
    node = rig.store.inode_at("f")
    rig.engine.evict(1 << 40)
    real = rig.backend.open_source

    def open_source(path):
        if how == "refused (EACCES)":
            raise PermissionError(errno.EACCES, "Permission denied", path)
        time.sleep(0.5)  # past its deadline
        return real(path)

    rig.engine.calls.deadlines = Deadlines(call_s=0.1, min_rate=1 << 40)
    rig.backend.open_source = open_source
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20), pytest.raises(OSError) as failed:
            await rig.engine.load(node.ino)
        assert failed.value.errno == errno.EIO and not node.data.resident
        n.cancel_scope.cancel()


async def test_a_failed_load_of_an_empty_file_fails_its_writer(tmp_path):
    """An empty file's load covers its no bytes: a failed one returned as if
    it had loaded, and a writer then wrote into a file not in RAM, whose
    bytes the next load attempt cleared (a write into the mount lost)."""
    rig = Rig(tmp_path / "store")
    rig.write("f", b"")
    await run_until_flushed(rig)
    node = rig.store.inode_at("f")
    rig.engine.evict(1 << 40)
    assert not node.data.resident
    rig.engine.backend = _Failing(rig.backend, "open_source")
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20), pytest.raises(OSError) as failed:
            await rig.engine.load(node.ino)
        assert failed.value.errno == errno.EIO and not node.data.resident
        rig.engine.backend = rig.backend
        with trio.fail_after(20):
            await rig.engine.load(node.ino)
        assert node.data.resident
        n.cancel_scope.cancel()


async def test_a_generation_superseded_then_deleted_while_its_publication_failed_settles(tmp_path):
    """Its publication under way when the newer generation came (so not
    dropped then), its file deleted before a try succeeded: it was held for
    ever, and every flush after it waited for it; its try had left a record
    with no file under it."""
    rig = Rig(tmp_path / "store")
    failing = _Failing(rig.backend, "publish")
    rig.engine.backend = failing
    rig.write("f", b"old" * 100)
    gen = rig.engine.pending[rig.store.inode_at("f").ino]
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(20):
            while not gen.tries:
                await trio.sleep(0.01)
        rig.write("f", b"new" * 100)  # supersedes it, under way
        rig.unlink("f")
        failing.failing.clear()
        with trio.fail_after(20):
            await rig.engine.flush()
        n.cancel_scope.cancel()
    assert rig.files() == {}
    from ckptfs.writeback.verify import verify

    assert verify(rig.backend).clean


async def test_a_flush_waits_for_every_name_of_a_hard_linked_file(tmp_path):
    import threading

    rig = Rig(tmp_path / "store")
    h = rig.write("f", b"linked" * 100, keep_open=True)
    rig.store.link(h.inode.ino, ROOT, b"g")
    rig.store.release(h.fh)  # sealed under both names
    go = threading.Event()
    copy = rig.backend.copy

    def slow_copy(src, dst):
        go.wait(30)
        return copy(src, dst)

    rig.backend.copy = slow_copy
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        flushed = []

        async def flush():
            await rig.engine.flush()
            flushed.append(True)

        n.start_soon(flush)
        await trio.sleep(0.5)
        assert not flushed  # f is published, g not yet
        go.set()
        with trio.fail_after(20):
            while not flushed:
                await trio.sleep(0.01)
        assert rig.files() == {"f": b"linked" * 100, "g": b"linked" * 100}
        n.cancel_scope.cancel()


async def test_a_flush_tries_directory_records_again_until_they_are_in(tmp_path):
    rig = Rig(tmp_path / "store")
    d = rig.mkdir("d")
    rig.store.setattr(d.ino, mode=0o750)
    rig.engine.backend = _Failing(rig.backend, "chmod", times=2)
    await run_until_flushed(rig)
    assert stat.S_IMODE(os.stat(tmp_path / "store" / "d").st_mode) == 0o750


async def test_a_directory_whose_record_cannot_be_written_does_not_hold_a_flush(tmp_path):
    rig = Rig(tmp_path / "store")
    d = rig.mkdir("d")
    rig.store.setattr(d.ino, mode=0o750)
    rig.engine.backend = _Failing(rig.backend, "chmod")  # for good
    await run_until_flushed(rig)  # within its deadline
    assert rig.engine.publisher.dirty  # left for a later sync


async def test_a_directory_sync_cut_short_keeps_the_directory_dirty(tmp_path):
    """A sync of directories' records cancelled while one is written (the
    end of a run, after a flush gave up on it) leaves that directory dirty:
    it was taken out of the dirty set first and never put back."""
    import threading

    rig = Rig(tmp_path / "store")
    d = rig.mkdir("d")
    rig.store.setattr(d.ino, mode=0o750)
    go = threading.Event()
    inner = rig.backend

    class _Stalling:
        def __getattr__(self, name):
            attr = getattr(inner, name)
            if name != "chmod":
                return attr
            return lambda *args: (go.wait(20), attr(*args))[1]

    rig.engine.backend = _Stalling()
    try:
        async with trio.open_nursery() as n:
            await n.start(rig.engine.run)
            with trio.move_on_after(1):
                await rig.engine.flush()  # waits on the stalled chmod
            n.cancel_scope.cancel()  # cancels the sync while the chmod is in flight
    finally:
        go.set()
    assert "d" in [rig.engine.publisher.replica.path_of(x) for x in rig.engine.publisher.dirty]


async def test_a_directory_record_a_flush_writes_never_lands_at_a_name_the_directory_left(tmp_path):
    """A flush writes the records of changed directories while the
    publisher goes on with what was queued after it: a directory renamed
    meanwhile got its record at its old name, after the rename had moved
    it (at a restart, a directory the mount no longer had came back)."""
    import threading

    rig = Rig(tmp_path / "store")
    rig.mkdir("a")
    x = rig.mkdir("a/x")
    inner, stall = rig.backend, manifest.record_path("a/x")
    armed, writing, go = threading.Event(), threading.Event(), threading.Event()

    class _Stalling:
        def __getattr__(self, name):
            attr = getattr(inner, name)
            if name != "put":
                return attr

            def put(path, data):
                if armed.is_set() and path == stall:
                    writing.set()
                    go.wait(20)
                return attr(path, data)

            return put

    rig.engine.backend = _Stalling()
    try:
        async with trio.open_nursery() as n:
            await n.start(rig.engine.run)
            with trio.fail_after(20):
                await rig.engine.flush()
            armed.set()
            rig.store.setattr(x.ino, mode=0o700)
            n.start_soon(rig.engine.flush)  # its sync writes the record of a/x, and stalls there
            with trio.fail_after(10):
                while not writing.is_set():
                    await trio.sleep(0.01)
            rig.rename("a", "b")
            with trio.move_on_after(1):  # the publisher applies the rename, if it may
                while rig.engine.queue:
                    await trio.sleep(0.01)
            go.set()
            with trio.fail_after(20):
                await rig.engine.flush()
            n.cancel_scope.cancel()
    finally:
        go.set()
    assert manifest.read(inner, "a/x") is None
    assert manifest.read(inner, "b/x").mode == 0o700
    rig2 = Rig(tmp_path / "store")
    await rig2.engine.scan()
    assert rig2.store.inode_at("a") is None and stat.S_IMODE(rig2.store.inode_at("b/x").mode) == 0o700


async def test_a_directory_renamed_after_the_store_lost_it_is_made_at_its_new_name(tmp_path):
    """The store's directory went missing (removed by hand) before its
    rename was published: the move finds nothing to move, and the directory
    is made at its new name, so its record and mode can be written there."""
    rig = Rig(tmp_path / "store")
    rig.mkdir("a")
    await run_until_flushed(rig)
    os.rmdir(tmp_path / "store" / "a")
    rig.rename("a", "b")
    rig.store.setattr(rig.store.inode_at("b").ino, mode=0o700)
    await run_until_flushed(rig)
    assert stat.S_IMODE(os.stat(tmp_path / "store" / "b").st_mode) == 0o700
    assert not rig.engine.publisher.dirty


class _FailingAt(_Failing):
    """The named calls fail, for good, on paths under `prefix` only."""

    def __init__(self, inner, prefix: str, *names: str):
        super().__init__(inner, *names)
        self.prefix = prefix

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in self.failing or not callable(attr):
            return attr

        def call(path, *args, **kwargs):
            if path.startswith(self.prefix):
                raise ConnectionError(f"injected fault in {name} of {path}")
            return attr(path, *args, **kwargs)

        return call


async def test_a_directory_whose_record_cannot_be_written_does_not_keep_the_others_out(tmp_path):
    """The deepest directory went first and its failure ended every sync:
    no other directory's record was ever written."""
    rig = Rig(tmp_path / "store")
    a = rig.mkdir("a")
    rig.mkdir("a/deep")
    rig.store.setattr(a.ino, mode=0o750)
    rig.store.setattr(rig.store.inode_at("a/deep").ino, mode=0o700)
    rig.engine.backend = _FailingAt(rig.backend, "a/deep", "chmod")
    await run_until_flushed(rig)
    assert stat.S_IMODE(os.stat(tmp_path / "store" / "a").st_mode) == 0o750
    assert [rig.engine.publisher.replica.path_of(d) for d in rig.engine.publisher.dirty] == ["a/deep"]


async def test_a_file_evicted_again_as_its_load_ends_is_loaded_again_for_the_caller(tmp_path):
    """A load's end wakes its callers, and another task may run first: an
    `evict` (admin, or a writer making room) dropped the file again, and the
    caller went on with no bytes in RAM. A truncate (`truncate -s`) then set
    the size of a file not in RAM (every later load failed: "the store has
    98651 bytes, the manifest says 0"). Trio wakes the waiters of one event
    in either order: the load is repeated until the evicting task has run
    first many times."""
    rig = Rig(tmp_path / "store")
    rig.write("f", b"P" * 65536)
    await run_until_flushed(rig)
    node = rig.store.inode_at("f")
    evicted_first = 0
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        for _ in range(60):
            rig.engine.evict(1 << 40)
            assert not node.data.resident
            done: list[bool] = []

            async def evictor(done: list[bool]) -> None:
                while (load := rig.engine.residency._loads.get(node.ino)) is None:
                    await trio.sleep(0)
                while not load.finished:
                    await load.changed.wait()
                if not done:  # the caller has not gone on yet
                    rig.engine.evict(1 << 40)
                    done.append(False)

            async with trio.open_nursery() as race:
                race.start_soon(evictor, done)
                await rig.engine.load(node.ino)
                if not done:
                    done.append(True)
                assert node.data.resident and node.data.read(0, 4) == b"PPPP"
            evicted_first += done[0] is False
        n.cancel_scope.cancel()
    assert evicted_first >= 5
