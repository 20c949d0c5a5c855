"""The second-generation engine against the failures it was built for (each
of these failed on the first engine): ordering of directory commits and
rotations, namespace cases, permanent errors, hung calls, crash leftovers,
verified restarts. Real inode tree, real local store, in-process."""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import trio
from ckptfs.fs.tree import RENAME_EXCHANGE, ROOT
from ckptfs.writeback import engine as engine_module
from ckptfs.writeback import manifest, residency
from ckptfs.writeback.backend import DAEMONS, STAGING, Backend, open_store
from ckptfs.writeback.calls import Deadlines, StoreCalls, StoreTimeout
from ckptfs.writeback.engine import Retry
from ckptfs.writeback.journal import FileGen, Remove, Rename
from ckptfs.writeback.localstore import LocalBackend
from ckptfs.writeback.publisher import MARKERS
from ckptfs.writeback.state import State
from ckptfs.writeback.verify import verify

from tests.unit.test_engine import FaultyBackend, Rig, _loads_over, _store_fds, run_until_flushed


class Checked:
    """Wraps a backend: after every call that changes the store, `check`
    sees the store as a reader would at that moment."""

    MUTATING = {"publish", "move", "move_dir", "copy", "delete", "exchange", "rmdir", "put"}

    def __init__(self, inner, check) -> None:
        self.inner, self.check = inner, check
        self.violations: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in self.MUTATING:
            return attr

        def call(*args, **kwargs):
            out = attr(*args, **kwargs)
            self.violations += self.check()
            return out

        return call


async def test_directory_commit_becomes_visible_as_a_unit(tmp_path):
    """Orbax: files written into `N.orbax-checkpoint-tmp`, the directory
    renamed to `N` before their turn, then `N/commit_success.txt`. The store
    must never show `N/` with only some of its files, nor the marker early."""
    rig = Rig(tmp_path / "store")
    members = {"manifest.ocdbt", "d/params.0", "d/params.1", "_METADATA"}

    def check():
        out = []
        for step in ("1", "2"):
            d = tmp_path / "store" / step
            if d.exists():
                have = {os.path.relpath(os.path.join(p, n), d) for p, _, ns in os.walk(d) for n in ns}
                if not members <= have:
                    out.append(f"{step}/ visible with only {sorted(have)}")
        return out

    checked = Checked(rig.backend, check)
    rig.engine.backend = checked
    for step in ("1", "2"):
        tmp = f"{step}.orbax-checkpoint-tmp-123"
        rig.mkdir(tmp)
        rig.mkdir(f"{tmp}/d")
        for m in sorted(members):
            rig.write(f"{tmp}/{m}", os.urandom(1000))
        rig.rename(tmp, step)  # before any of its files' turn
        rig.write(f"{step}/commit_success.txt", b"ok")
    await run_until_flushed(rig)
    assert not checked.violations, checked.violations
    assert set(rig.files()) == {f"{s}/{m}" for s in ("1", "2") for m in [*members, "commit_success.txt"]}
    assert not any("orbax-checkpoint-tmp" in p for p in os.listdir(tmp_path / "store"))
    assert verify(rig.backend).clean


async def test_directory_commit_on_an_object_store_shows_markers_last(tmp_path):
    """memory:// has no directories: members move first, markers last."""
    import fsspec

    rig = Rig(tmp_path / "store")
    rig.backend = rig.engine.backend = open_store(f"memory://{tmp_path.name}/obj")
    rig.backend.prepare("test-obj", time.time())
    mem = fsspec.filesystem("memory")
    order = []
    real_move = rig.backend.move
    rig.backend.move = lambda s, d: (order.append(d.rsplit("/", 1)[-1]), real_move(s, d))
    rig.mkdir("5.tmp")
    rig.write("5.tmp/a", b"A")
    rig.write("5.tmp/commit_success.txt", b"ok")
    await run_until_flushed(rig)  # both published under the tmp name
    rig.write("5.tmp/b", b"B")
    rig.rename("5.tmp", "5")
    await run_until_flushed(rig)
    assert order[-1] == "commit_success.txt" and "a" in order
    names = sorted(p.rsplit("/", 1)[-1] for p in mem.find(f"/{tmp_path.name}/obj/5"))
    assert names == ["a", "b", "commit_success.txt"]
    mem.rm(f"/{tmp_path.name}", recursive=True)


class _Checkpoints:
    """Checkpoints `c<N>/` of `files` made and deleted in a rig's mount, and
    those its store holds whole."""

    def __init__(self, rig: Rig, files: tuple[str, ...]) -> None:
        self.rig, self.files = rig, files

    def complete(self) -> list[str]:
        root = self.rig.root
        return sorted(c for c in os.listdir(root) if c.startswith("c") and all((root / c / f).exists() for f in self.files))

    def save(self, c: str) -> None:
        self.rig.mkdir(c)
        for f in self.files:
            self.rig.write(f"{c}/{f}", c.encode() * 100)

    def delete(self, c: str) -> None:
        for f in self.files:
            self.rig.unlink(f"{c}/{f}")
        self.rig.store.rmdir(ROOT, c.encode())


async def test_rotation_never_leaves_the_store_without_a_complete_checkpoint(tmp_path):
    """keep-2 rotation through an outage: c3 and c4 are written and deleted
    again before the store comes back. The deletions of c1 and c2 must wait
    until a newer complete checkpoint is in the store."""
    rig = Rig(tmp_path / "store")
    ckpts = _Checkpoints(rig, ("model", "optim", "done"))
    complete, save, delete = ckpts.complete, ckpts.save, ckpts.delete
    save("c1")
    save("c2")
    await run_until_flushed(rig)
    ever = [False]

    def check():
        have = complete()
        if have:
            ever[0] = True
            return []
        return ["no complete checkpoint in the store"] if ever[0] else []

    faulty = FaultyBackend(Checked(rig.backend, check), error_rate=0.0, latency_s=0.0)
    rig.engine.backend = faulty
    faulty.down = True
    for n in range(3, 7):  # keep 2: save c{n}, delete c{n-2}
        save(f"c{n}")
        delete(f"c{n - 2}")

    async def outage():
        await trio.sleep(0.5)
        faulty.down = False

    await run_until_flushed(rig, outage)
    assert not faulty.inner.violations, faulty.inner.violations
    assert sorted(complete()) == ["c5", "c6"] and sorted(os.listdir(tmp_path / "store")) == [".ckptfs", "c5", "c6"]


class Stalling:
    """Wraps a backend: a call naming a path under `prefix` waits until
    `go` is set (a slow upload of the newest checkpoint)."""

    def __init__(self, inner, prefix: str) -> None:
        self.inner, self.prefix, self.go = inner, prefix, threading.Event()

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr) or name in ("dirs", "staging", "daemon_id", "hidden_name"):
            return attr

        def call(*args, **kwargs):
            if self.prefix in repr(args):
                self.go.wait(30)
            return attr(*args, **kwargs)

        return call


async def test_a_rotation_that_outruns_write_back_keeps_the_last_complete_checkpoint(tmp_path):
    """keep-1 rotation: c2, c3 and c4 are saved, and c1, c2, c3 deleted,
    before the store comes back from an outage; then c4's upload is slow.
    c2 and c3 are never uploaded (deleted before their turn, C4), so the
    store may go from c1 to c4 directly, but it must not remove c1 before
    c4 is in: it would hold no complete checkpoint (found by a kill -9
    soak of a fast keep-3 rotation)."""
    rig = Rig(tmp_path / "store")
    ckpts = _Checkpoints(rig, ("model", "done"))
    complete, save, delete = ckpts.complete, ckpts.save, ckpts.delete
    save("c1")
    await run_until_flushed(rig)
    stalling = Stalling(Checked(rig.backend, lambda: [] if complete() else ["no complete checkpoint in the store"]), "c4/")
    faulty = FaultyBackend(stalling, error_rate=0.0, latency_s=0.0)
    rig.engine.backend = faulty
    faulty.down = True
    for n in range(2, 5):
        save(f"c{n}")
        delete(f"c{n - 1}")

    async def slow_c4():
        faulty.down = False
        await trio.sleep(1.0)  # the store is back; c4's upload hangs meanwhile
        held = complete()
        stalling.go.set()
        assert held, "no complete checkpoint in the store while c4 was being uploaded"

    try:
        await run_until_flushed(rig, slow_c4)
    finally:
        stalling.go.set()
    assert not stalling.inner.violations, stalling.inner.violations
    assert complete() == ["c4"]


@pytest.mark.parametrize("marker, markers", [("commit_success.txt", MARKERS), ("done", (*MARKERS, "done"))],
                         ids=["built-in marker", "a marker of the user's own (--marker done)"])
async def test_a_marker_never_shows_without_data_deleted_after_it(tmp_path, marker, markers):
    """Rotation that has removed an old checkpoint's data but not yet its
    marker when write-back reaches them (rmtree removes in directory order):
    the data is never published (deleted before its turn, C4), and the marker
    must not appear alone in the store before the newer checkpoint (whose
    files were closed before the removal) is there: the mount never showed
    that state. Found by the kill -9 crash-point test; for a marker of the
    user's own (`done`, not one ckptfs knows), by a keep-1 rotation faster
    than an S3 store: every checkpoint's `done` reached the store, alone."""
    rig = Rig(tmp_path / "store", markers=markers)
    root = tmp_path / "store"

    def check():
        if (root / "1" / marker).exists() and not (root / "1" / "a").exists() and not (root / "2" / "a").exists():
            return [f"1/{marker} without its data, before checkpoint 2"]
        return []

    checked = Checked(rig.backend, check)
    rig.engine.backend = checked
    for step in ("1", "2"):
        rig.mkdir(step)
        rig.write(f"{step}/a", step.encode() * 100)
        rig.write(f"{step}/{marker}", b"ok")
    rig.unlink("1/a")  # rmtree of 1 under way: its marker is next
    await run_until_flushed(rig)
    assert not checked.violations, checked.violations
    assert (root / "2" / "a").exists() and (root / "1" / marker).exists() and not (root / "1" / "a").exists()
    rig.unlink(f"1/{marker}")
    rig.store.rmdir(ROOT, b"1")
    await run_until_flushed(rig)
    assert sorted(os.listdir(root)) == [".ckptfs", "2"]


async def test_exchange_of_two_published_files_swaps_them_in_the_store(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.write("a", b"AAAA")
    rig.write("b", b"BB")
    await run_until_flushed(rig)
    rig.store.rename(ROOT, b"a", ROOT, b"b", RENAME_EXCHANGE)
    await run_until_flushed(rig)
    assert rig.files() == {"a": b"BB", "b": b"AAAA"}
    assert verify(rig.backend).clean
    # evicting and reading back both must give the swapped bytes
    rig.engine.evict(1 << 40)
    for path, want in (("a", b"BB"), ("b", b"AAAA")):
        node = rig.store.inode_at(path)
        await rig.engine.load(node.ino)
        assert node.data.read(0, 10) == want


async def test_hard_links_reach_the_store_and_survive_the_loss_of_one_name(tmp_path):
    rig = Rig(tmp_path / "store")
    h = rig.write("a", b"linked")
    await run_until_flushed(rig)
    rig.store.link(h.inode.ino, ROOT, b"b")
    await run_until_flushed(rig)
    assert rig.files() == {"a": b"linked", "b": b"linked"}
    rig.write("c", b"other")
    rig.rename("c", "a")  # over a name whose file has another link
    await run_until_flushed(rig)
    assert rig.files() == {"a": b"other", "b": b"linked"}
    assert verify(rig.backend).clean


@pytest.mark.parametrize("held", ["open", "being-opened"])
@pytest.mark.parametrize("how", ["unlink", "replace", "rmtree"])
async def test_a_held_file_whose_only_copy_is_the_stores_is_loaded_before_that_copy_goes(tmp_path, held, how):
    """A published file evicted from RAM (or not loaded since a restart) is
    deleted or replaced in the mount while a process has it open, or is
    opening it (the kernel looked it up; the open waits for the load): it
    stays readable until its last close, and the store's copy is its only
    one. The publisher deleted that copy with the name, and the reads after
    failed with EIO. It loads the file first, and eviction passes it over.
    (rmtree: removals of many files are applied together, and went past it.)"""
    rig = Rig(tmp_path / "store")
    if how == "rmtree":
        rig.mkdir("old")
    h = rig.write("old/ckpt" if how == "rmtree" else "ckpt", b"x" * 5000)
    others = [rig.write(f"old/{i}", b"o") for i in range(3)] if how == "rmtree" else []
    await run_until_flushed(rig)
    inode = h.inode
    assert rig.engine.evict(1 << 40) and not inode.data.resident
    if held == "open":
        reader = rig.store.open(inode.ino, os.O_RDONLY)
    else:
        rig.store.ref(inode)  # the kernel's lookup; its open comes once the load is done
    if how == "unlink":
        rig.unlink("ckpt")
    elif how == "replace":
        rig.write("new", b"y")
        rig.rename("new", "ckpt")
    else:
        for path in ["old/ckpt", *(f"old/{i}" for i in range(len(others)))]:
            rig.unlink(path)
        rig.store.rmdir(ROOT, b"old")
    await run_until_flushed(rig)
    assert rig.files() == ({"ckpt": b"y"} if how == "replace" else {})  # the store's copy is gone
    assert inode.data.resident and bytes(inode.data.read(0, 5000)) == b"x" * 5000
    rig.engine.evict(1 << 40)
    assert inode.data.resident  # no name: RAM holds its only copy
    if held == "open":
        rig.store.release(reader.fh)
    else:
        rig.store.forget(inode.ino, 1)
    assert inode.ino not in rig.store.inodes


@pytest.mark.parametrize("how", ["unlink", "replace"])
async def test_a_held_file_read_in_place_keeps_its_store_file_when_its_name_goes(tmp_path, monkeypatch, how):
    """A large file in a local store read in place (served from a descriptor
    of its store file) is deleted or replaced in the mount while a process
    holds it open. That descriptor keeps the bytes when the store's name
    goes: the publisher used to copy the whole file into RAM or the spill
    directory first, and write-back waited for the copy (a 10 GB
    checkpoint mmapped by a reader while a rotation deletes it). Now
    nothing is loaded; the reads go on, the file keeps its descriptor past
    the limit of files served in place, and a writer's load into RAM reads
    that descriptor, verified."""
    monkeypatch.setattr(residency, "IN_PLACE_MAX", 1)
    rig = Rig(tmp_path / "store")
    size = residency.IN_PLACE_FROM + 1000
    data = {name: os.urandom(size) for name in ("ckpt", "other1", "other2")}
    for name, d in data.items():
        rig.write(name, d)
    await run_until_flushed(rig)
    inode = rig.store.inode_at("ckpt")
    assert rig.engine.evict(1 << 40) and not inode.data.resident
    reader = rig.store.open(inode.ino, os.O_RDWR)

    async def body():
        with trio.fail_after(20):
            await rig.engine.load(inode.ino, 0, size)
        await _loads_over(rig)
        if how == "unlink":
            rig.unlink("ckpt")
        else:
            rig.write("new", b"y")
            rig.rename("new", "ckpt")

    async def after():
        assert rig.files() == {"other1": data["other1"], "other2": data["other2"], **({"ckpt": b"y"} if how == "replace" else {})}
        assert rig.engine.counters.loads == 1 and not inode.data.resident  # the store's copy went, nothing was loaded
        for name in ("other1", "other2"):  # served in place too, past IN_PLACE_MAX: the held file keeps its descriptor
            other = rig.store.inode_at(name)
            with trio.fail_after(20):
                await rig.engine.load(other.ino, 0, size)
            await _loads_over(rig)
        assert rig.store.inode_at("other1").data.borrowed is None and inode.data.borrowed is not None
        with trio.fail_after(20):
            await rig.engine.load(inode.ino, 0, size)
        assert bytes(inode.data.read(0, size)) == data["ckpt"]
        with trio.fail_after(20):
            await rig.engine.load(inode.ino)  # a writer's: into RAM, from the descriptor
        assert inode.data.resident and bytes(inode.data.read(0, size)) == data["ckpt"]
        assert inode.data.borrowed is None and rig.engine.counters.loads == 4

    await run_until_flushed(rig, body, after)
    rig.store.release(reader.fh)
    assert inode.ino not in rig.store.inodes
    assert not any(_store_fds(p) for p in (tmp_path / "store").iterdir())


async def test_truncate_to_zero_of_an_evicted_file_is_published(tmp_path):
    rig = Rig(tmp_path / "store")
    h = rig.write("f", b"x" * 5000)
    await run_until_flushed(rig)
    assert rig.engine.evict(1 << 40) and not h.inode.data.resident
    h2 = rig.store.open(h.inode.ino, os.O_WRONLY | os.O_TRUNC)
    rig.store.release(h2.fh)
    await run_until_flushed(rig)
    assert rig.files() == {"f": b""}
    rig.engine.evict(1 << 40)
    rig.store.setattr(h.inode.ino, size=0)  # truncate by path, no handle
    await run_until_flushed(rig)
    assert rig.files() == {"f": b""}


async def test_truncate_after_seal_never_changes_what_is_published(tmp_path):
    rig = Rig(tmp_path / "store")
    h = rig.write("f", b"sealed" * 1000)
    rig.store.setattr(h.inode.ino, size=10)  # seals generation 2 at once
    await run_until_flushed(rig)
    assert rig.files() == {"f": b"sealedseal"}
    rec = manifest.read(rig.backend, "f")
    assert rec.current.size == 10 and verify(rig.backend).clean


async def test_queued_renames_and_removals_count_as_unpublished(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.write("a", b"A")
    await run_until_flushed(rig)
    faulty = FaultyBackend(rig.backend, error_rate=0.0, latency_s=0.0)
    faulty.down = True
    rig.engine.backend = faulty
    rig.rename("a", "b")
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        left = await rig.engine.drain(0.5)
        n.cancel_scope.cancel()
    assert [type(op).__name__ for op in left] == ["Rename"]


class _StalledGroups:
    """Wraps a backend: publications, of groups and of single files, wait
    until `go` is set."""

    def __init__(self, inner) -> None:
        self.inner, self.go = inner, threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def publish_group(self, *args, **kwargs):
        self.go.wait(30)
        return self.inner.publish_group(*args, **kwargs)

    def publish(self, *args, **kwargs):
        self.go.wait(30)
        return self.inner.publish(*args, **kwargs)


async def test_a_file_gone_from_the_mount_leaves_nothing_of_it_in_the_engine(tmp_path, monkeypatch):
    """A mount that saves and rotates for weeks must not grow with every
    file it ever published: once a file is gone from the mount for good (no
    name, no handle, no reference from the kernel), the engine keeps nothing
    of it: its published generation, its place in the eviction order, its
    nodes in the replica of the store. Nor of files deleted while their
    publication was under way (it completes; they are forgotten then). And
    the upload rate remembers the last 30 s of publications (here 0.1 s)
    whether or not anyone asks for it."""
    monkeypatch.setattr(engine_module, "THROUGHPUT_S", 0.1)
    rig = Rig(tmp_path / "store")
    stalled = rig.engine.backend = _StalledGroups(rig.backend)
    e = rig.engine

    gens: list[FileGen] = []
    under_way: list[FileGen] = []

    def kept() -> tuple[int, int, int]:
        return len(e.published_gen), len(e.residency.lru), len(e.publisher.replica._by_ino)

    async def body():
        stalled.go.set()
        for rnd in range(3):  # a checkpoint saved, then rotated away
            rig.mkdir("ck")
            for i in range(20):
                rig.write(f"ck/f{i}", b"x" * 100)
            await e.flush()
            assert kept()[0] == 20
            for i in range(20):
                rig.unlink(f"ck/f{i}")
            rig.store.rmdir(ROOT, b"ck")
            await e.flush()
            assert kept() == (0, 0, 0), f"round {rnd}"
        await trio.sleep(0.2)  # what was published so far is older than the upload rate's window
        stalled.go.clear()
        gens.extend(e.pending[rig.write(name, b"y" * 100).inode.ino] for name in ("late1", "late2"))
        # Together in a group, or (one staged before the other) the first alone, the second
        # queued behind it: both paths are stalled, and at least the first is under way
        with trio.fail_after(10):
            while not gens[0].publishing:
                await trio.sleep(0.01)
        under_way.extend(g for g in gens if g.publishing)
        rig.unlink("late1")
        rig.unlink("late2")
        stalled.go.set()

    await run_until_flushed(rig, body)
    assert under_way and all(g.state is State.PUBLISHED for g in under_way), "a publication under way completes"
    assert all(g.state in (State.PUBLISHED, State.DROPPED) for g in gens)
    assert set(rig.files()) == set()
    assert kept() == (0, 0, 0)
    assert len(e._recent) == sum(g.state is State.PUBLISHED for g in gens) >= 1  # the late files published


def _symlink_in_the_store(tmp_path, at: str) -> tuple[Rig, Path]:
    """A rig whose (local) store has a symlink at `at`, to the directory it
    returns, which ckptfs must never write into: what goes under `at` is
    parked after two tries, or skipped if it is a directory's move."""
    rig = Rig(tmp_path / "store", retry=Retry(first_s=0.01, max_s=0.05, park_after=2, parked_s=3600))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "store" / at).parent.mkdir(parents=True)
    (tmp_path / "store" / at).symlink_to(elsewhere)
    return rig, elsewhere


async def test_a_name_the_store_cannot_take_is_parked_and_blocks_nothing_it_does_not_order(tmp_path):
    """A symlink planted in the (local) store where a directory of the mount
    goes: the store never follows it, so the file in that directory can
    never be published there. It is parked after a few tries; files sealed
    after it are published; a completion marker in its tree is held back; its
    fsync=durable waiter gets EIO; nothing is written where the symlink points."""
    rig, elsewhere = _symlink_in_the_store(tmp_path, "top/bad")
    long_dir = "top/bad"
    parent = ""
    for part in long_dir.split("/"):
        parent = f"{parent}/{part}" if parent else part
        rig.mkdir(parent)
    h = rig.write(f"{long_dir}/big", b"B" * 100)
    rig.write("after", b"later file")
    marker = rig.write(f"{long_dir.split('/')[0]}/commit_success.txt", b"ok")

    async def body():
        with pytest.raises(OSError) as exc:
            with trio.fail_after(10):
                await rig.engine.wait_published(h.inode.ino, h.inode.generation)
        assert exc.value.errno == errno.EIO
        with pytest.raises(OSError) as exc:  # the marker's fsync=durable: held back, so EIO too (it waited for ever)
            with trio.fail_after(10):
                await rig.engine.wait_published(marker.inode.ino, marker.inode.generation)
        assert exc.value.errno == errno.EIO and "held back: top/bad/big" in exc.value.strerror

    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        await body()
        with trio.fail_after(10):
            await rig.engine.flush()  # returns: what is left is stuck behind the parked file
        files = rig.files()
        assert files.get("after") == b"later file"
        assert not any(p.endswith("commit_success.txt") for p in files)
        left = rig.engine.unpublished()
        assert any(getattr(op, "state", None) is State.PARKED for op in left)
        assert list(elsewhere.iterdir()) == []
        n.cancel_scope.cancel()


@pytest.mark.parametrize("resolve", ["deleted", "renamed out of its tree", "its directory renamed out"])
async def test_a_marker_held_back_by_a_parked_file_is_published_once_that_file_is_gone_from_its_tree(tmp_path, resolve):
    """A file parked for good (the store has a symlink where its directory
    goes) holds back the completion marker of its tree. Once the user
    deletes it or moves it out of the marker's tree, the marker must be
    published; it stayed held back for good, with nothing left to wake it
    (found by a test of `--marker` on a real mount). A file moved is tried
    again at its new name at once (it waited for the hourly retry here)."""
    rig, elsewhere = _symlink_in_the_store(tmp_path, "ck/bad")
    rig.mkdir("ck")
    rig.mkdir("ck/bad")
    h = rig.write("ck/bad/shard", b"S" * 100)
    rig.write("ck/commit_success.txt", b"ok")

    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with pytest.raises(OSError):
            with trio.fail_after(10):
                await rig.engine.wait_published(h.inode.ino, h.inode.generation)  # parked: EIO
        with trio.fail_after(10):
            await rig.engine.flush()  # returns: the marker is stuck behind the parked file
        assert "ck/commit_success.txt" not in rig.files()
        if resolve == "deleted":
            rig.unlink("ck/bad/shard")
        elif resolve == "renamed out of its tree":
            rig.rename("ck/bad/shard", "shard")
        else:
            rig.rename("ck/bad", "bad")
        with trio.fail_after(10):
            await rig.engine.flush()
        assert rig.files().get("ck/commit_success.txt") == b"ok"
        # moved where the store takes it: tried again at once, not at its next retry (parked_s: an hour here)
        assert not [op for op in rig.engine.unpublished() if isinstance(op, FileGen)]
        assert list(elsewhere.iterdir()) == []
        n.cancel_scope.cancel()
    moved = {"deleted": None, "renamed out of its tree": "shard", "its directory renamed out": "bad/shard"}[resolve]
    assert moved is None or rig.files()[moved] == b"S" * 100


async def test_a_marker_is_held_back_where_a_directory_rename_could_not_be_applied(tmp_path):
    """Orbax: files into `5.orbax-checkpoint-tmp-1/`, the directory renamed to
    `5`, then `5/commit_success.txt`. Another tool left a symlink at `5/sub`
    in the (local) store, so the rename can never be applied (skipped: the
    store differs from the mount there) and the data stays at the temporary
    name. The marker vouches for `5/manifest`, which the store does not have
    there: it must not be published (it was, alone), while files elsewhere
    go on, and a flush says it is stuck."""
    rig, elsewhere = _symlink_in_the_store(tmp_path, "5/sub")
    rig.write("4.pt", b"old checkpoint")
    await run_until_flushed(rig)
    rig.mkdir("5.orbax-checkpoint-tmp-1")
    rig.mkdir("5.orbax-checkpoint-tmp-1/sub")
    rig.write("5.orbax-checkpoint-tmp-1/sub/x", b"x" * 100)
    rig.write("5.orbax-checkpoint-tmp-1/manifest", b"m" * 100)
    rig.rename("5.orbax-checkpoint-tmp-1", "5")
    marker = rig.write("5/commit_success.txt", b"ok")
    rig.write("after", b"after")
    rig.unlink("4.pt")  # rotation: waits behind the held marker (C3), so a flush must say it is stuck, not wait for ever
    await run_until_flushed(rig)
    files = rig.files()
    assert files.get("after") == b"after" and files.get("4.pt") == b"old checkpoint"
    assert "5/commit_success.txt" not in files, sorted(files)
    [removal] = [op for op in rig.engine.unpublished() if isinstance(op, Remove)]
    assert rig.engine.stuck(removal)
    [held] = [op for op in rig.engine.unpublished() if isinstance(op, FileGen) and op.ino == marker.inode.ino]
    assert rig.engine.stuck(held) and "the rename of 5.orbax-checkpoint-tmp-1" in rig.engine.publisher.held_back(held)
    [skipped] = [op for op in rig.engine.unpublished() if isinstance(op, Rename)]  # reported by every flush after, and at unmount
    assert rig.engine.stuck(skipped) and rig.engine.waiting(skipped)
    assert list(elsewhere.iterdir()) == []


async def test_a_publish_that_half_succeeded_is_success_on_retry(tmp_path):
    """The data was made visible, then the call failed: the retry finds its
    staged copy gone and the final bytes right, and moves on."""
    rig = Rig(tmp_path / "store")
    real = rig.backend.publish
    calls = []

    def publish_then_fail(staged, path, pieces=(), mode=None):
        real(staged, path, pieces, mode)
        calls.append(path)
        if len(calls) == 1:
            raise ConnectionError("reply lost")

    rig.backend.publish = publish_then_fail
    rig.write("a", b"A" * 10)
    rig.write("b", b"B" * 10)
    await run_until_flushed(rig)
    assert rig.files() == {"a": b"A" * 10, "b": b"B" * 10} and verify(rig.backend).clean


async def test_a_hung_store_call_is_abandoned_and_retried(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.engine.calls.deadlines = Deadlines(call_s=0.3, min_rate=1 << 40)
    release = threading.Event()
    real = rig.backend.publish
    hung = []

    def publish(staged, path, pieces=(), mode=None):
        if not hung:
            hung.append(path)
            release.wait(30)  # hangs far past its deadline
        real(staged, path, pieces, mode)

    rig.backend.publish = publish
    rig.backend.publish_group = functools.partial(Backend.publish_group, rig.backend)  # groups meet the hang too
    rig.write("a", b"A")
    rig.write("b", b"B")
    try:
        with trio.fail_after(10):
            await run_until_flushed(rig)
    finally:
        release.set()
    assert rig.files() == {"a": b"A", "b": b"B"}
    assert rig.engine.calls.abandoned == 1


async def test_the_store_calls_running_count_each_thread_at_work_an_abandoned_one_until_it_ends():
    """What the FUSE loop asks before it spins (`fuseloop.Turns`, `busy`)."""
    calls = StoreCalls(Deadlines(call_s=0.2, min_rate=1 << 40))
    release = threading.Event()
    assert calls.running == 0
    try:
        with pytest.raises(StoreTimeout):
            await calls.run("hang", release.wait, 30)
        assert calls.running == 1  # abandoned, still at work
    finally:
        release.set()
    with trio.fail_after(10):
        while calls.running:
            await trio.sleep(0.01)
    assert await calls.run("quick", lambda: 7) == 7 and calls.running == 0


async def test_durable_fsync_waits_through_transient_errors(tmp_path):
    rig = Rig(tmp_path / "store")
    faulty = FaultyBackend(rig.backend, error_rate=0.5, latency_s=0.0, seed=3)
    rig.engine.backend = faulty
    handles = [rig.write(f"f{i}", b"x" * 100, keep_open=True) for i in range(8)]
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        for h in handles:
            assert rig.store.seal(h.inode)
        with trio.fail_after(20):
            for h in handles:
                await rig.engine.wait_published(h.inode.ino, h.inode.generation)  # no EIO on retryable errors
        n.cancel_scope.cancel()
    assert faulty.failures > 0
    for h in handles:
        rig.store.release(h.fh)


async def test_restart_refuses_bytes_that_do_not_match_their_record(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.write("appended", b"good" * 100)
    rig.write("norecord", b"fine" * 100)
    await run_until_flushed(rig)
    with open(tmp_path / "store" / "appended", "ab") as f:
        f.write(b"extra")  # same prefix, different size: must not be served
    (tmp_path / "store" / manifest.record_path("norecord")).write_bytes(b"{not json")
    rig2 = Rig(tmp_path / "store")
    await rig2.engine.scan()
    for path in ("appended", "norecord"):
        with pytest.raises(OSError) as exc:
            await rig2.engine.load(rig2.store.inode_at(path).ino)
        assert exc.value.errno == errno.EIO
        assert path in rig2.engine.verify_failures


async def test_crash_leftovers_are_cleaned_at_the_next_mount_and_real_losses_are_not_hidden(tmp_path):
    """A record written just before a crash kept its data from being
    published (its staged bytes are still there): removed at the next mount.
    A recorded file deleted from the store behind ckptfs's back: its record
    stays, so verify reports it. A dead daemon's staging goes, a live one's
    stays."""
    store = tmp_path / "store"
    rig = Rig(store)
    rig.write("kept", b"k")
    rig.write("lost", b"l")
    await run_until_flushed(rig)
    backend = rig.backend
    (store / STAGING / "dead-daemon").mkdir(parents=True)
    (store / STAGING / "dead-daemon" / "partial").write_bytes(b"x")
    manifest.write(backend, manifest.Record("ghost", "file", manifest.Digest(1, "00"), None,
                                            source=f"staged:{STAGING}/dead-daemon/partial"))
    (store / STAGING / "old-format-file").write_bytes(b"y")
    (store / "lost").unlink()
    rig2 = Rig(store, claim=False)
    await rig2.engine.scan()
    live = open_store(str(store))  # another daemon on the same store, alive
    live.prepare("live-daemon", time.time())
    live_staged = live.stage([b"in flight"], 9)
    rig2.backend.prepare("next-daemon", time.time())
    report = verify(rig2.backend)
    assert report.missing == ["lost"] and not report.corrupt and not report.extra
    assert manifest.read(rig2.backend, "ghost") is None
    assert not (store / STAGING / "dead-daemon").exists() and not (store / STAGING / "old-format-file").exists()
    assert (store / live_staged.token).exists()


async def test_snapshot_memory_is_kept_while_an_abandoned_upload_still_reads_it(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.engine.calls.deadlines = Deadlines(call_s=0.2, min_rate=1 << 40)
    release = threading.Event()
    real = rig.backend.stage
    seen = []

    def stage(pieces, size, name=None, hidden=False):
        if not seen:
            seen.append(size)
            release.wait(20)
        return real(pieces, size, name, hidden)

    rig.backend.stage = stage
    h = rig.write("f", b"z" * 5000)
    gen = rig.engine.pending[h.inode.ino]
    try:
        with trio.fail_after(10):
            await run_until_flushed(rig)
        assert gen.state is State.PUBLISHED and gen.readers == 1 and gen.snapshot is not None
    finally:
        release.set()
    with trio.fail_after(10):
        while gen.readers:
            await trio.sleep(0.02)
    assert gen.snapshot is None  # released once the abandoned thread let go
    assert rig.files() == {"f": b"z" * 5000}


async def test_a_newer_file_written_straight_to_the_store_is_not_overwritten(tmp_path):
    """The daemon could not publish (store down, or the daemon hung) while the
    torch helpers wrote a newer file straight to the store: when the daemon
    gets to its older generation, the newer file stays."""
    from ckptfs.writeback import storeio

    rig = Rig(tmp_path / "store")
    rig.write("model.pt", b"generation 1")
    await run_until_flushed(rig)
    faulty = FaultyBackend(rig.backend, error_rate=0.0, latency_s=0.0)
    faulty.down = True
    rig.engine.backend = faulty
    rig.write("model.pt", b"generation 2, sealed first")
    rig.write("other.pt", b"o")

    async def body():
        await trio.sleep(0.2)
        storeio.write_file(rig.backend, "model.pt", b"written to the store later")
        faulty.down = False

    await run_until_flushed(rig, body)
    assert rig.files() == {"model.pt": b"written to the store later", "other.pt": b"o"}
    assert verify(rig.backend).clean


class LateDelete:
    """A backend whose first delete of `path` answers only after `delay_s`
    (past the deadline), and then deletes: a call that lands late."""

    def __init__(self, inner, path: str, delay_s: float) -> None:
        self.inner, self.path, self.delay_s = inner, path, delay_s
        self.late_done = threading.Event()
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def delete(self, path: str) -> None:
        if path == self.path:
            self.calls += 1
        if path == self.path and self.calls == 1:
            time.sleep(self.delay_s)
            self.inner.delete(path)
            self.late_done.set()
            return
        self.inner.delete(path)


async def test_a_late_store_call_never_undoes_a_later_change(tmp_path):
    """A delete abandoned at its deadline still lands later. The new file
    written under the same name after it must survive it: later changes to
    that path wait until the abandoned call is done (C11)."""
    rig = Rig(tmp_path / "store")
    rig.engine.calls.deadlines = Deadlines(call_s=0.2, min_rate=1 << 40)
    rig.write("f", b"old")
    await run_until_flushed(rig)
    late = LateDelete(rig.backend, "f", delay_s=1.5)
    rig.engine.backend = late
    rig.unlink("f")
    rig.write("f", b"new")
    await run_until_flushed(rig)
    assert late.late_done.wait(10)
    assert rig.files() == {"f": b"new"}
    assert manifest.read(rig.backend, "f").current == manifest.digest_of([b"new"])


@pytest.mark.parametrize("reuse", ["dir-where-a-file-was", "file-where-a-dir-was", "same-name-new-file", "renamed-onto-the-name"])
async def test_a_name_taken_again_while_its_removal_waits(tmp_path, reuse):
    """A removal waits for generations sealed before it (rotation, C3); `x`
    rewritten twice keeps it waiting (its middle generation is superseded).
    A later op that takes the name again must not fail on the old entry
    (ENOTDIR, ENOTEMPTY: found by the random-ops test) nor have the late
    removal delete the new one."""
    rig = Rig(tmp_path / "store")
    rig.write("x", b"x1")
    if reuse == "file-where-a-dir-was":
        rig.mkdir("a")
        rig.write("a/f", b"old")
    else:
        rig.write("a", b"old")
    await run_until_flushed(rig)
    rig.write("x", b"x2")  # sealed before the removal, superseded below: the removal waits
    if reuse == "file-where-a-dir-was":
        rig.unlink("a/f")
        rig.store.rmdir(ROOT, b"a")
    else:
        rig.unlink("a")
    want = {"x": b"x3"}
    if reuse == "dir-where-a-file-was":
        rig.mkdir("a")
        rig.write("a/b", b"new")
        want["a/b"] = b"new"
    elif reuse == "renamed-onto-the-name":
        rig.write("c", b"new")
        rig.rename("c", "a")
        want["a"] = b"new"
    else:
        rig.write("a", b"new")
        want["a"] = b"new"
    rig.write("x", b"x3")
    await run_until_flushed(rig)
    assert rig.files() == want
    assert verify(rig.backend).clean
    rig.engine.evict(1 << 40)  # what the store shows is what comes back
    for path, data in want.items():
        node = rig.store.inode_at(path)
        await rig.engine.load(node.ino)
        assert node.data.read(0, 10) == data


async def test_small_files_are_published_in_groups_and_a_failed_group_goes_one_by_one(tmp_path):
    """Group commit: many small files closed while the publisher is busy
    are shown by a few store calls (records, then data, two syncs), not
    several calls each. A group that fails halfway (some files already
    renamed into place) is published again one file at a time, and the
    store ends exactly as the mount is, with a clean verify."""
    rig = Rig(tmp_path / "store")
    files = {f"d{i % 3}/f{i}": os.urandom(100 + i) for i in range(300)}
    for d in ("d0", "d1", "d2"):
        rig.mkdir(d)
    for path, data in files.items():
        rig.write(path, data)
    before = rig.engine.calls.count
    await run_until_flushed(rig)
    assert rig.files() == files
    assert rig.engine.calls.count - before < 20  # 300 files, a few group calls (and a heartbeat, a directory sync)
    assert verify(rig.backend).clean

    groups = _half_a_group(rig.backend, 1)
    again = {path: os.urandom(50) for path in files}
    for path, data in again.items():
        rig.write(path, data)
    await run_until_flushed(rig)
    assert groups and groups[0][1] > 1
    assert rig.files() == again
    assert verify(rig.backend).clean


async def test_the_files_of_a_group_commit_are_logged_by_one_record_with_a_line_each(tmp_path):
    """Each published file has its INFO line (size, generation, time since
    its seal). A group commit of 512 small files wrote them as 512 records
    from the event loop, a write to the log file each, while FUSE requests
    waited (about 16 us of the event loop per file, 5% of its time while
    small files were created). The files a store call published are now
    one record with a line per file; a file published alone keeps a record
    of its own."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler, logger = Keep(logging.INFO), logging.getLogger("ckptfs.writeback.engine")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        rig = Rig(tmp_path / "store")
        rig.mkdir("d")
        files = {f"d/f{i}": os.urandom(100 + i) for i in range(300)}
        for path, data in files.items():
            rig.write(path, data)
        await run_until_flushed(rig)
        rig.write("alone", b"x")
        await run_until_flushed(rig)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert rig.files() == files | {"alone": b"x"}
    published = [r for r in records if r.getMessage().startswith("published ")]
    lines = [line for r in published for line in getattr(r, "lines", [r.getMessage()])]
    assert sorted(line.split(" ")[1] for line in lines) == sorted([*files, "alone"])  # every file once
    assert all(r.getMessage() == "\n".join(r.lines) for r in published if hasattr(r, "lines"))
    assert len(published) < 20  # a few group commits, and the file published alone
    assert published[-1].getMessage().startswith("published alone (1 bytes, generation 1, ") and not hasattr(published[-1], "lines")


async def test_a_group_commit_hands_its_snapshots_back_to_the_event_loop_at_once(monkeypatch, tmp_path):
    """The thread that publishes a group reads every file's snapshot, then
    hands each back to the event loop (`run_sync_soon`: a write to trio's
    wakeup socket, a callback, a wakeup of every task waiting for a change).
    It did so once per file: 512 wakeups of the event loop per group while
    FUSE requests waited. Now once per store call; every snapshot is still
    let go once its file is published."""
    calls = []
    real = trio.lowlevel.TrioToken.run_sync_soon

    def counted(self, fn, *args, **kw):
        calls.append(fn)
        return real(self, fn, *args, **kw)

    monkeypatch.setattr(trio.lowlevel.TrioToken, "run_sync_soon", counted)
    rig = Rig(tmp_path / "store")
    rig.mkdir("d")
    files = {f"d/f{i}": os.urandom(100 + i) for i in range(300)}
    for path, data in files.items():
        rig.write(path, data)
    gens = [op for op in rig.engine.queue if isinstance(op, FileGen)]
    assert len(gens) == 300
    await run_until_flushed(rig)
    assert rig.files() == files
    assert all(gen.state is State.PUBLISHED and gen.readers == 0 and gen.snapshot is None for gen in gens)
    assert len(calls) < 30, len(calls)  # a few group commits (and trio's own thread hand-offs)


async def test_a_group_commit_opens_the_staging_directory_once_for_its_small_files(monkeypatch, tmp_path):
    """A local store stages each small file of a group before its record
    (`storeio._staged_now`). Each was written through a descriptor of the
    staging directory reached from the store's root again: a tenth of the
    publishing thread's time. Now `stage_many` opens it once per group.
    (How many groups the publisher makes depends on how fast it runs beside
    the writes: counted, not assumed.)"""
    rig = Rig(tmp_path / "store")
    opened, groups = [], []  # groups: (files, times it opened the staging directory)
    real_dir, real_stage_many = LocalBackend._dir, LocalBackend.stage_many

    def counted(self, path, create=False):
        opened.append(path)
        return real_dir(self, path, create)

    def stage_many(self, files):
        before = len(opened)
        try:
            return real_stage_many(self, files)
        finally:
            groups.append((len(files), opened[before:].count(self.staging)))

    monkeypatch.setattr(LocalBackend, "_dir", counted)
    monkeypatch.setattr(LocalBackend, "stage_many", stage_many)
    rig.mkdir("d")
    files = {f"d/f{i}": os.urandom(100 + i) for i in range(300)}
    for path, data in files.items():
        rig.write(path, data)
    await run_until_flushed(rig)
    assert rig.files() == files
    assert sum(n for n, _ in groups) >= len(files) and max(n for n, _ in groups) > 1, groups  # staged in group commits
    assert all(opens == 1 for _, opens in groups), groups  # the directory opened once for each


async def test_a_directory_rename_rewrites_its_records_in_groups(tmp_path):
    """A published directory renamed (Orbax's temporary directory, renamed
    once complete): each file's record moves to its new path. They are
    written in a few group commits, not one store call (and fsync) each:
    2,500 files took 5,000 calls, a stall of seconds for everything behind
    it. A group that fails halfway is written again, and the store ends with
    exactly the new records, verified clean."""
    rig = Rig(tmp_path / "store")
    files = {f"tmp/d{i % 2}/f{i}": os.urandom(10 + i % 50) for i in range(2500)}
    rig.mkdir("tmp")
    for d in ("tmp/d0", "tmp/d1"):
        rig.mkdir(d)
    for path, data in files.items():
        rig.write(path, data)
    rig.store.symlink(rig.dir_of("tmp/l").ino, b"l", b"d0/f0", 0, 0)
    await run_until_flushed(rig)
    assert rig.files() == files

    groups = _half_a_group(rig.backend, 1)  # the first call writes records only: half of them land
    rig.rename("tmp", "step")
    before = rig.engine.calls.count
    await run_until_flushed(rig)
    assert groups and groups[0][0] > 1
    assert rig.engine.calls.count - before < 20  # 2,501 records written and 2,501 deleted: a few calls each
    assert rig.files() == {"step" + p[len("tmp"):]: data for p, data in files.items()}
    records, unreadable = manifest.read_all(rig.backend)
    assert not unreadable
    assert {p for p, r in records.items() if r.kind != "dir"} == {"step" + p[len("tmp"):] for p in files} | {"step/l"}
    assert records["step/l"].target == "d0/f0"
    assert verify(rig.backend).clean


@pytest.mark.parametrize("made_first", [False, True], ids=["hidden", "in-store"])
async def test_a_directory_renamed_before_its_files_turn_is_assembled_in_groups(tmp_path, made_first):
    """Orbax writes a checkpoint's files into a temporary directory and
    renames it once complete, usually before the files' turn. They are then
    published into the directory (its old name in the store, or a hidden one
    if the store never had it) by group commits, not one store call and
    three fsyncs each (2,500 files: 5,000 calls, several seconds of
    publication held up). The marker still goes last, one at a time; a group
    that fails halfway goes one by one; the store ends exactly as the mount."""
    rig = Rig(tmp_path / "store")
    files = {f"tmp/f{i}": os.urandom(10 + i % 50) for i in range(2500)}
    rig.mkdir("tmp")
    if made_first:
        await run_until_flushed(rig)  # the store has tmp/ when its files' turns come
    for path, data in files.items():
        rig.write(path, data)
    rig.write("tmp/commit_success.txt", b"ok")

    groups = _half_a_group(rig.backend, 2)
    rig.rename("tmp", "step")
    before = rig.engine.calls.count
    await run_until_flushed(rig)
    assert len(groups) >= 2 and max(files for _, files in groups) > 100
    assert rig.engine.calls.count - before < 700  # the failed group's files go one by one: the rest in groups
    want = {"step" + p[len("tmp"):]: data for p, data in files.items()} | {"step/commit_success.txt": b"ok"}
    assert rig.files() == want
    records, _ = manifest.read_all(rig.backend)
    assert {p for p, r in records.items() if r.kind == "file"} == set(want)
    assert verify(rig.backend).clean


async def test_a_directory_renamed_before_its_files_turn_on_an_object_store_goes_in_groups_and_its_marker_last(tmp_path):
    """The same on an object store (memory://, no directories): the files
    the store never showed go to their new names by group commits (one
    request each, side by side; one at a time, a directory of 500 small
    files took 10 s to reach S3); one shown at the old name and rewritten
    since is published at the new name (its old copy goes) one at a time;
    the completion marker goes last."""
    import fsspec

    rig = Rig(tmp_path / "store")
    rig.backend = rig.engine.backend = open_store(f"memory://{tmp_path.name}/obj")
    rig.backend.prepare("test-obj", time.time())
    mem = fsspec.filesystem("memory")
    rig.mkdir("1.tmp")
    rig.write("1.tmp/old", b"first")
    await run_until_flushed(rig)  # shown under the temporary name
    files = {f"f{i}": os.urandom(10 + i % 50) for i in range(600)} | {"old": b"second", "commit_success.txt": b"ok"}
    for name, data in files.items():
        rig.write(f"1.tmp/{name}", data)
    groups, alone = [], []  # files published by each group commit; files published one at a time
    real_group, real_publish = rig.backend.publish_group, rig.backend.publish

    def group(records, group_files):
        groups.append([path for _, path, _, _ in group_files])
        rig.backend.publish = real_publish  # its files, side by side
        try:
            real_group(records, group_files)
        finally:
            rig.backend.publish = one

    def one(staged, path, *args, **kwargs):
        alone.append(path)
        real_publish(staged, path, *args, **kwargs)

    rig.backend.publish_group, rig.backend.publish = group, one
    rig.rename("1.tmp", "1")
    await run_until_flushed(rig)
    assert len(groups) <= 2 and sum(map(len, groups)) == 600
    assert alone == ["1/old", "1/commit_success.txt"]  # the one shown under the old name, then the marker, last
    root = f"/{tmp_path.name}/obj"
    stored = {p[len(root) + 1 :]: mem.cat_file(p) for p in mem.find(root) if "/.ckptfs/" not in p}
    assert stored == {f"1/{name}": data for name, data in files.items()}
    records, _ = manifest.read_all(rig.backend)
    assert {p for p, r in records.items() if r.kind == "file"} == {f"1/{name}" for name in files}
    assert verify(rig.backend).clean
    mem.rm(root, recursive=True)


async def test_the_removal_of_many_published_files_takes_a_few_store_calls(tmp_path):
    """The rmtree of an old checkpoint of thousands of files: each removal
    took three store calls (its record marked, the file, the record), and
    everything written after it waited behind them. Now a few calls for
    all; a file with another name (a hard link) still keeps its bytes; a
    group that fails halfway goes one at a time; the store ends exactly as
    the mount, verified clean."""
    rig = Rig(tmp_path / "store")
    for round_, n in enumerate((2500, 300)):
        old = f"old{round_}"
        rig.mkdir(old)
        files = {f"{old}/f{i}": os.urandom(10 + i % 50) for i in range(n)}
        for path, data in files.items():
            rig.write(path, data)
        await run_until_flushed(rig)
        rig.store.link(rig.store.inode_at(f"{old}/f7").ino, rig.store.get(ROOT).ino, f"keep{round_}".encode())
        groups = _half_a_group(rig.backend, 1) if round_ else []  # the second time, the first group commit fails halfway
        for path in files:
            rig.unlink(path)
        rig.store.rmdir(ROOT, old.encode())
        rig.write(f"new{round_}", b"after the rotation")
        before = rig.engine.calls.count
        await run_until_flushed(rig)
        if not round_:
            assert rig.engine.calls.count - before < 20  # 2,500 removals and a new file
        else:
            assert groups and groups[0][0] > 1
        stored = rig.files()
        assert not any(p.startswith("old") for p in stored), sorted(stored)[:5]
        assert stored[f"keep{round_}"] == files[f"{old}/f7"] and stored[f"new{round_}"] == b"after the rotation"
        records, _ = manifest.read_all(rig.backend)
        assert {p for p, r in records.items() if r.kind == "file"} == set(stored)
        assert verify(rig.backend).clean


async def test_files_whose_times_are_set_right_after_closing_are_still_published_in_groups(tmp_path):
    """tar and `cp -a` set each file's owner and mode just before closing
    it and its times just after. Each change went into the queue as an op
    of its own, so no two files were ever next to each other, and each was
    published alone (a store call and three fsyncs), then its record
    rewritten. A change before the close now goes with the seal that
    follows, one right after it with the generation it follows; the store
    ends with every mode and mtime set."""
    rig = Rig(tmp_path / "store")
    rig.mkdir("d")
    files = {f"d/f{i}": os.urandom(10 + i % 50) for i in range(300)}
    for i, (path, data) in enumerate(files.items()):
        h = rig.write(path, data, keep_open=True)
        rig.store.setattr(h.inode.ino, mode=0o600 if i % 2 else 0o640)  # fchmod before close (tar, cp -a)
        rig.store.release(h.fh)
        rig.store.setattr(h.inode.ino, mtime_ns=1_577_836_800_000_000_000 + i)  # utimensat after it (tar)
    before = rig.engine.calls.count
    await run_until_flushed(rig)
    assert rig.engine.calls.count - before < 20  # 300 files: a few group calls
    assert rig.files() == files
    records, _ = manifest.read_all(rig.backend)
    for i, path in enumerate(files):
        assert (records[path].mode & 0o777, records[path].mtime_ns) == (0o600 if i % 2 else 0o640, 1_577_836_800_000_000_000 + i)
        assert os.stat(tmp_path / "store" / path).st_mode & 0o777 == (0o600 if i % 2 else 0o640)
    assert verify(rig.backend).clean


async def test_a_chmod_of_a_published_file_kept_open_and_written_reaches_the_store_at_once(tmp_path):
    """A log file published once, reopened and written (its changes not
    sealed yet), then made private: the store's copy must not stay readable
    until the file is closed. (A change of attributes rides on the next
    seal only for a new file, which the store has never shown.)"""
    rig = Rig(tmp_path / "store")
    h = rig.write("train.log", b"step 1\n")
    await run_until_flushed(rig)
    assert os.stat(tmp_path / "store" / "train.log").st_mode & 0o777 == 0o644
    w = rig.store.open(h.inode.ino, os.O_WRONLY | os.O_APPEND)
    rig.store.write(w.fh, 7, b"step 2\n")
    rig.store.setattr(h.inode.ino, mode=0o600)
    await run_until_flushed(rig)
    assert os.stat(tmp_path / "store" / "train.log").st_mode & 0o777 == 0o600
    records, _ = manifest.read_all(rig.backend)
    assert records["train.log"].mode & 0o777 == 0o600
    rig.store.release(w.fh)
    await run_until_flushed(rig)
    assert rig.files() == {"train.log": b"step 1\nstep 2\n"}


def _half_a_group(backend, nth: int) -> list[tuple[int, int]]:
    """The backend's `nth` group commit lands its records and half its files
    (half its records if it has no files), then the store fails. Returns
    the (records, files) of every group commit, as they come."""
    real, groups = backend.publish_group, []

    def half(records, group_files):
        groups.append((len(records), len(group_files)))
        if len(groups) == nth:
            real(records if group_files else records[: len(records) // 2], group_files[: len(group_files) // 2])
            raise ConnectionError("injected: the store went away in the middle of a group")
        real(records, group_files)

    backend.publish_group = half
    return groups


def _failing_publication(rig: Rig, inner) -> FaultyBackend:
    """The store (`inner`, wrapped) goes down, and `x.tmp` is written."""
    faulty = FaultyBackend(inner, error_rate=0.0, latency_s=0.0)
    rig.engine.backend = faulty
    faulty.down = True
    rig.write("x.tmp", b"data")
    return faulty


async def _until_a_publication_failed(rig: Rig) -> None:
    """Until a turn came and its publication failed (its retry then waits `Retry.first_s`)."""
    with trio.fail_after(10):
        while not any(g.tries for g in rig.engine.unpublished()):
            await trio.sleep(0.01)


async def test_a_publication_retried_after_its_file_was_renamed_is_not_made_under_the_old_name(tmp_path):
    """The turn of `x.tmp` comes, its publication fails (store down), the
    file is renamed meanwhile: the retry must not publish under the temp
    name (C4); the file appears under its new name at the rename's turn."""
    rig = Rig(tmp_path / "store", retry=Retry(first_s=0.5, max_s=0.5))  # the rename lands while it waits to retry
    root = tmp_path / "store"
    checked = Checked(rig.backend, lambda: ["x.tmp in the store"] if (root / "x.tmp").exists() else [])
    faulty = _failing_publication(rig, checked)

    async def body():
        await _until_a_publication_failed(rig)
        rig.rename("x.tmp", "x")
        faulty.down = False

    await run_until_flushed(rig, body)
    assert not checked.violations, checked.violations
    assert rig.files() == {"x": b"data"}
    assert verify(rig.backend).clean


async def test_a_file_deleted_while_its_publication_failed_settles_and_lets_removals_go(tmp_path):
    """Its publication is under way (failing: store down) when the file is
    renamed and deleted (a checkpoint manager pruning an unpublished step):
    the deletion cannot drop a publication under way, so it must take effect
    when that publication ends unshown. It stayed in flight forever, and
    every later removal (and flush) waited for it."""
    rig = Rig(tmp_path / "store", retry=Retry(first_s=0.5, max_s=0.5))  # the changes land while it waits to retry
    rig.write("old", b"published")
    await run_until_flushed(rig)
    faulty = _failing_publication(rig, rig.backend)

    async def body():
        await _until_a_publication_failed(rig)
        rig.rename("x.tmp", "x")
        rig.unlink("x")
        rig.unlink("old")  # waits for the generations sealed before it
        faulty.down = False

    await run_until_flushed(rig, body)
    assert rig.files() == {}
    assert not rig.engine.unsettled


async def test_a_small_object_put_whole_is_a_leftover_only_if_its_daemon_crashed(tmp_path):
    """Object stores PUT small files whole at publication (record source
    `put:<daemon>`). A record without its data is a crash leftover only if
    that daemon died (its heartbeat is still there); a daemon that exited
    cleanly took its heartbeat away, and a file of its missing later is a
    real loss that verify must report (it was forgotten without a word)."""
    store = tmp_path / "store"
    backend = open_store(str(store))
    backend.prepare("setup", time.time())
    backend.put(f"{DAEMONS}/crashed", json.dumps({"time": time.time() - 3600, "pid": 1}).encode())
    for name, daemon in (("torn", "crashed"), ("lost", "exited")):
        manifest.write(backend, manifest.Record(name, "file", manifest.Digest(1, "00"), None, source=f"put:{daemon}"))
    backend.retire()
    rig = Rig(store, claim=False)
    await rig.engine.scan()
    rig.backend.prepare("next-daemon", time.time())
    assert manifest.read(rig.backend, "torn") is None
    assert verify(rig.backend).missing == ["lost"]


async def test_a_record_marked_as_being_deleted_whose_file_is_gone_is_a_leftover_whoever_marked_it(tmp_path):
    """A removal marks the file's record (`delete:<daemon>`), deletes the
    file, then the record. A record so marked with no file left is the
    rest of a removal whatever became of that daemon: a cluster node that
    took over from a node killed between the two (alive on the scan's view:
    its heartbeat was fresh), or a daemon that exited cleanly after a
    failed delete of the record. The scan kept it, and verify called the
    removed file missing for good (found by a takeover explorer)."""
    store = tmp_path / "store"
    backend = open_store(str(store))
    backend.prepare("setup", time.time())
    manifest.write(backend, manifest.Record("gone", "file", manifest.Digest(1, "00"), None, source="delete:exited"))
    backend.retire()
    rig = Rig(store, claim=False)
    await rig.engine.scan()
    rig.backend.prepare("next-daemon", time.time())
    assert manifest.read(rig.backend, "gone") is None
    assert verify(rig.backend).clean


async def test_a_daemon_killed_a_moment_ago_is_known_dead_to_the_scan_after_the_mount_checked_the_store(tmp_path):
    """kill -9, then a mount at once: the dead daemon's heartbeat is fresh,
    and only its pid (gone, on this host) tells it dead. The mount first
    asks whether a live daemon uses the store; that question used to delete
    the dead heartbeat, so the scan then took the record of a small file
    PUT whole, its data never written, for a file lost (verify: missing)."""
    import subprocess
    import sys

    store = tmp_path / "store"
    backend = open_store(str(store))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    daemon = f"{socket.gethostname()}-{gone.stdout.strip()}-{time.time_ns():x}"
    backend.put(f"{DAEMONS}/{daemon}", json.dumps({"time": time.time(), "pid": int(gone.stdout)}).encode())
    manifest.write(backend, manifest.Record("torn", "file", manifest.Digest(1, "00"), None, source=f"put:{daemon}"))
    rig = Rig(store, claim=False)
    assert rig.backend.live_daemons() == set()  # the mount's check (preflight.check_no_daemon)
    await rig.engine.scan()
    rig.backend.prepare("next-daemon", time.time())
    assert manifest.read(rig.backend, "torn") is None
    assert verify(rig.backend).clean
    assert rig.backend.find(DAEMONS) == [f"{DAEMONS}/next-daemon"]


async def test_a_crash_between_deleting_a_file_and_its_record_leaves_no_record_of_a_lost_file(tmp_path):
    """A deletion removes the data, then the record. A daemon killed in
    between left the record of a file published from its staged copy,
    long consumed: the next mount took it for a file lost from the store
    (verify: missing). The record is marked as being deleted first."""
    from tests.unit.test_convergence import _crash_after

    store = tmp_path / "store"
    rig = Rig(store)
    rig.write("big", os.urandom(300_000))
    await run_until_flushed(rig)
    assert manifest.read(rig.backend, "big").source.startswith("staged:")
    rig.unlink("big")
    await _crash_after(rig, "delete")  # the data's delete, before the record's
    assert not (store / "big").exists() and manifest.read(rig.backend, "big") is not None
    daemon = rig.backend.daemon_id  # dead: its heartbeat stopped long ago
    rig.backend.put(f"{DAEMONS}/{daemon}", json.dumps({"time": time.time() - 3600, "pid": 1}).encode())
    again = Rig(store, claim=False)
    await again.engine.scan()
    again.backend.prepare("next-daemon", time.time())
    assert manifest.read(again.backend, "big") is None
    assert verify(again.backend).clean


async def test_a_removal_behind_a_parked_file_that_replaced_an_earlier_generation_is_stuck_not_waited_for(tmp_path):
    """The first unsettled generation is one the parked file superseded
    before its turn. Removals after it wait for the parked file, as behind
    any parked file; a flush used to take them for still under way and
    waited for ever (in a cluster: `flush --cluster` ran out its timeout
    behind a file lost with its node, rewritten just before)."""
    rig, _ = _symlink_in_the_store(tmp_path, "top/bad")
    rig.write("gone", b"published, then removed")
    rig.mkdir("top")
    rig.mkdir("top/bad")
    async with trio.open_nursery() as n:
        await n.start(rig.engine.run)
        with trio.fail_after(10):
            await rig.engine.flush()
        rig.write("top/bad/f", b"first")
        rig.write("top/bad/f", b"second: supersedes the first before its turn")
        rig.unlink("gone")
        with trio.fail_after(10):
            await rig.engine.flush()  # returns: what is left is stuck behind the parked file
        assert "gone" in rig.files()  # the removal waits for the parked file
        left = rig.engine.unpublished()
        assert [op.name for op in left if isinstance(op, Remove)] == ["gone"]
        assert [op.state for op in left if isinstance(op, FileGen)] == [State.PARKED]
        n.cancel_scope.cancel()


async def test_an_exchange_whose_try_lands_late_is_not_applied_beside_the_next_try(tmp_path):
    """An exchange on an object store is one store call, its plan. A try
    abandoned at its deadline goes on in its thread; the next try applied
    the plan beside it. The late thread, still deleting the originals,
    then deleted the files the next try had moved to those names: both lost."""
    url = f"memory://{tmp_path.name}/late"
    rig = Rig(url)
    rig.write("x", b"x" * 1000)
    rig.write("y", b"y" * 2000)
    await run_until_flushed(rig)
    rig.engine.calls.deadlines = Deadlines(call_s=0.3, min_rate=1 << 40)
    release = threading.Event()
    real = rig.backend.delete
    held = []

    def delete(path):
        if path in ("x", "y") and not held:  # the first original's delete answers late
            held.append(path)
            release.wait(20)
        return real(path)

    rig.backend.delete = delete
    rig.store.rename(ROOT, b"x", ROOT, b"y", RENAME_EXCHANGE)

    async def late():
        await trio.sleep(1.5)  # long after the next try would have moved both files
        release.set()

    try:
        with trio.fail_after(30):
            await run_until_flushed(rig, late)
            while rig.engine.calls.stragglers():  # the late try is done too
                await trio.sleep(0.05)
    finally:
        release.set()
    assert held and [b"".join(rig.backend.read(p)) for p in ("x", "y")] == [b"y" * 2000, b"x" * 1000]
    assert verify(rig.backend).clean
