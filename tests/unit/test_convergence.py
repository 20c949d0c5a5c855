"""Whatever a workload does to the namespace, once the engine has flushed,
the store holds exactly what the mount shows (C2-C4, C8) and a restart over
the store shows it again, attributes included (C9). Random workloads of
every namespace operation, with the engine publishing while they run,
evictions and loads among them, on a sound store and on one that fails a
share of its calls. `CKPTFS_CONVERGENCE_SEEDS=100` runs more workloads (a
sweep by hand; the suite runs 6)."""

from __future__ import annotations

import errno
import json
import os
import random
import stat
import threading
import time

import pytest
import trio
import xxhash
from ckptfs.fs.tree import RENAME_EXCHANGE, ROOT
from ckptfs.writeback import exchange, manifest
from ckptfs.writeback.backend import DAEMONS, IMAGE, new_daemon_id
from ckptfs.writeback.calls import Deadlines
from ckptfs.writeback.manifest import Meta, Record
from ckptfs.writeback.verify import verify

from tests.unit.test_engine import FaultyBackend, Rig, run_until_flushed

W = os.O_WRONLY | os.O_CREAT
DIRS = ["", "a", "b", "a/c"]
NAMES = ["x", "y", "z", "a", "b", "c"]


def _paths(rng: random.Random) -> str:
    d = rng.choice(DIRS)
    name = rng.choice(NAMES)
    return f"{d}/{name}" if d else name


class Workload:
    def __init__(self, rig: Rig, seed: int, faulty: bool = False) -> None:
        self.rig, self.t, self.rng = rig, rig.store, random.Random(seed)
        self.faulty = faulty  # a load may fail (EIO) after its tries, as a read through the mount would
        self.open: list = []  # handles kept open for a while
        self.trace: list[str] = []  # what each step did, for a failure's message

    def _at(self, path: str):
        d, _, name = path.rpartition("/")
        parent = self.t.inode_at(d) if d else self.t.get(ROOT)
        return parent, name.encode()

    def _payload(self) -> bytes:
        n = self.rng.choice([0, 1, 100, 4000, 70_000])
        return bytes([self.rng.randrange(1, 256)]) * n if self.rng.random() < 0.5 else os.urandom(n)

    async def step(self) -> None:
        rng, t = self.rng, self.t
        path = _paths(rng)
        parent, name = self._at(path)
        node = t.inode_at(path)
        op = rng.random()
        before = len(self.trace)
        self.trace.append(f"{op:.2f} {path}")
        try:
            if parent is None or not parent.is_dir:
                return
            if op < 0.22:  # (re)write a file whole, or write into it
                if node is not None and node.is_reg and not node.data.resident:
                    await self.rig.engine.load(node.ino)
                flags = W | (os.O_TRUNC if rng.random() < 0.7 else 0)
                h = t.create(parent.ino, name, rng.choice([0o644, 0o600, 0o755]), flags, 0, 0)
                t.write(h.fh, rng.randrange(0, 3000) if not flags & os.O_TRUNC else 0, self._payload())
                if rng.random() < 0.15:
                    self.open.append(h)
                else:
                    t.release(h.fh)
            elif op < 0.32:
                dst = _paths(rng)
                dparent, dname = self._at(dst)
                if dparent is not None and dparent.is_dir:
                    flags = RENAME_EXCHANGE if rng.random() < 0.15 else 0
                    self.trace[before] += f" rename{'(exchange)' if flags else ''} to {dst}"
                    t.rename(parent.ino, name, dparent.ino, dname, flags)
            elif op < 0.40:
                if node is not None and node.is_dir:
                    t.rmdir(parent.ino, name)
                else:
                    t.unlink(parent.ino, name)
            elif op < 0.48:
                t.mkdir(parent.ino, name, rng.choice([0o755, 0o700, 0o1777]), 0, 0)
            elif op < 0.53:
                origin = _paths(rng)
                src = t.inode_at(origin)
                self.trace[before] += f" link to {origin}"
                if src is not None and src.is_reg:
                    t.link(src.ino, parent.ino, name)
            elif op < 0.57:
                t.symlink(parent.ino, name, _paths(rng).encode(), 0, 0)
            elif op < 0.64 and node is not None:
                if rng.random() < 0.5:
                    t.setattr(node.ino, mode=rng.choice([0o600, 0o640, 0o755, 0o711]))
                else:
                    t.setattr(node.ino, mtime_ns=rng.randrange(1, 2**62))
            elif op < 0.70 and node is not None and node.is_reg and not node.writers:
                if not node.data.resident:
                    await self.rig.engine.load(node.ino)
                t.setattr(node.ino, size=rng.choice([0, 10, 5000, 80_000]))
            elif op < 0.76:
                self.rig.engine.evict(rng.randrange(0, 200_000))
            elif op < 0.80 and node is not None and node.is_reg:
                await self.rig.engine.load(node.ino)
                assert node.data.resident or node.writers == 0
            elif op < 0.86 and self.open:
                t.release(self.open.pop(rng.randrange(len(self.open))).fh)
            elif op < 0.92 and self.open:  # a writer goes on, its file maybe renamed or unlinked meanwhile
                h = rng.choice(self.open)
                self.trace[before] += f" write into open ino {h.inode.ino}"
                t.write(h.fh, rng.randrange(0, 6000), self._payload())
            elif rng.random() < 0.1 and self.rig.engine.keeps_image:  # the manifest image saved, as a daemon does now and then
                self.trace[before] += " save the manifest image"
                try:
                    await self.rig.engine.save_image(IMAGE)
                except ConnectionError:  # a faulty store
                    self.trace[before] += " -> failed"
            else:
                await trio.sleep(rng.choice([0, 0, 0.001, 0.01]))
        except OSError as exc:
            self.trace[before] += f" -> {errno.errorcode.get(exc.errno)}"
            if exc.errno not in (errno.EEXIST, errno.ENOENT, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR, errno.EINVAL,
                                 errno.EPERM, errno.EBUSY) and not (self.faulty and exc.errno == errno.EIO):
                raise

    def close_all(self) -> None:
        for h in self.open:
            self.rig.store.release(h.fh)
        self.open.clear()


def _mount_view(tree, with_data: bool) -> dict:
    """path -> (kind, mode, mtime, data or target); the root's own attributes left out."""
    out = {}

    def walk(ino: int, prefix: str) -> None:
        d = tree.get(ino)
        for name, child_ino in sorted(d.children.items()):
            node = tree.get(child_ino)
            path = f"{prefix}{name.decode()}"
            if node.is_dir:
                out[path] = ("dir", stat.S_IMODE(node.mode), node.mtime_ns, None)
                walk(child_ino, path + "/")
            elif node.is_reg:
                data = bytes(node.data.read(0, node.data.size)) if with_data else None
                out[path] = ("file", stat.S_IMODE(node.mode), node.mtime_ns, data)
            else:
                out[path] = ("symlink", None, node.mtime_ns, node.target)

    walk(ROOT, "")
    return out


def _store_files(root, backend) -> dict[str, bytes]:
    if not backend.dirs:  # an object store: what it lists
        return {e.path: b"".join(backend.read(e.path)) for e in backend.walk() if not e.is_dir}
    out = {}
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".ckptfs" or dirpath != str(root)]
        for n in names:
            p = os.path.join(dirpath, n)
            assert not os.path.islink(p), p
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out


async def _load_all(rig: Rig) -> None:
    for _path, node in list(rig.store.files_under("")):
        for _ in range(5):  # a faulty store fails a load now and then, as a reader would see
            if node.data.resident:
                break
            try:
                await rig.engine.load(node.ino)
            except OSError as exc:
                if exc.errno != errno.EIO or not isinstance(rig.engine.backend, FaultyBackend):
                    raise
        assert node.data.resident


async def _assert_converged(rig: Rig, tmp_path, view: dict) -> None:
    """The store holds `view` (the mount's, taken after a flush), and a
    restart over it shows the same tree, attributes and bytes."""
    # The store: every regular file at each of its names, byte for byte; nothing else
    files = {p: v[3] for p, v in view.items() if v[0] == "file"}
    assert _store_files(rig.root, rig.backend) == files
    for p, (kind, mode, _, _) in view.items():
        if kind in ("file", "dir") and rig.backend.dirs:  # an object store keeps modes in the records only
            owner = 0o700 if kind == "dir" else 0o400  # the daemon's user always reads its files and uses its directories
            assert oct(stat.S_IMODE(os.lstat(rig.root / p).st_mode)) == oct(mode & 0o1777 | owner), (p, kind)
    report = verify(rig.backend)
    assert report.clean, report

    # A restart over the store shows the same tree, attributes and bytes (loads verified)
    back = await _restarted_view(tmp_path, rig.url)
    assert {p: v[:3] for p, v in back.items() if view.get(p) != v} == {p: v[:3] for p, v in view.items() if back.get(p) != v}
    assert back == view


async def _flushed_view(rig: Rig, body=None) -> dict:
    """Run the engine (after what was journaled while it was stopped: every
    op then has its turn after the mount moved on), flush, load all."""
    async def after():
        while rig.engine.publisher.dirty:  # a faulty store: a flush leaves a record that failed in a row to later syncs
            await rig.engine.sync_dirs()
        await _load_all(rig)

    await run_until_flushed(rig, body, after=after)
    return _mount_view(rig.store, with_data=True)


def _store(tmp_path, kind: str):
    """Where a random workload's store is: a local directory, or an object store (memory://)."""
    return tmp_path / "store" if kind == "local" else f"memory://{tmp_path.name}/objects"


async def _started(tmp_path, kind: str, monkeypatch) -> Rig:
    """A rig over an empty store, started as a daemon starts (scan, then
    claim): it saves its manifest image, and a restart relies on the
    last one with no margin for the store's clock."""
    monkeypatch.setattr(manifest, "CLOCK_MARGIN_S", 0.0)
    rig = Rig(_store(tmp_path, kind), claim=False)
    await rig.engine.scan()
    await rig.engine.claim(new_daemon_id(), time.time())
    return rig


@pytest.mark.parametrize("faults", ["none", "failed", "lost"], ids=["sound store", "faulty store", "answers lost"])
@pytest.mark.parametrize("kind", ["local", "object"])
@pytest.mark.parametrize("seed", range(int(os.environ.get("CKPTFS_CONVERGENCE_SEEDS", "6"))))
async def test_after_a_flush_the_store_and_a_restart_show_what_the_mount_shows(tmp_path, seed, kind, faults, monkeypatch):
    """`failed`: a fifth of the store calls fail before they reach it;
    `lost`: as many reach it and are reported failed all the same."""
    rig = await _started(tmp_path, kind, monkeypatch)
    if faults != "none":
        rig.engine.backend = FaultyBackend(rig.backend, error_rate=0.2 if faults == "failed" else 0.0, latency_s=0.001, seed=seed,
                                           lost_rate=0.2 if faults == "lost" else 0.0)
    work = Workload(rig, seed, faulty=faults != "none")
    for d in DIRS[1:]:
        rig.mkdir(d)

    async def body():
        for _ in range(400):
            await work.step()
        work.close_all()

    view = await _flushed_view(rig, body)
    await _assert_converged(rig, tmp_path, view)


def _answer_lost_for_the_record_of(rig: Rig, path: str, failing: dict[str, bool]) -> None:
    """While `failing["on"]`, writing the record of `path` lands in the store
    and is reported failed (its answer lost: a call that timed out)."""
    real_put = rig.backend.put

    def put(objpath, data):
        real_put(objpath, data)
        if failing["on"] and objpath == manifest.record_path(path):
            raise ConnectionError("injected: the answer was lost")

    rig.backend.put = put


@pytest.mark.parametrize("how", ["its chmod fails", "its write lands and fails"])
async def test_a_directory_whose_record_failed_to_be_written_leaves_no_record_when_removed(tmp_path, how):
    """A directory's sync wrote its record, then set the store directory's
    mode: a chmod that failed left the record there and the directory taken
    for unrecorded, as does a record write that lands but is reported
    failed (a call that timed out). Removed before a sync succeeded, its
    record stayed: the next restart showed the directory again."""
    rig = Rig(tmp_path / "store")
    failing = {"on": True}
    if how == "its chmod fails":
        real_chmod = rig.backend.chmod

        def chmod(path, mode):
            if failing["on"] and path == "d":
                raise ConnectionError("injected: chmod refused")
            real_chmod(path, mode)

        rig.backend.chmod = chmod
    else:
        _answer_lost_for_the_record_of(rig, "d", failing)
    rig.mkdir("d")
    await run_until_flushed(rig)  # its record's sync failed every try: left to later syncs
    assert rig.engine.publisher.dirty
    rig.store.rmdir(ROOT, b"d")
    failing["on"] = False
    view = await _flushed_view(rig)
    assert view == {} and manifest.read(rig.backend, "d") is None
    assert await _restarted_view(tmp_path) == {}


@pytest.mark.parametrize("answer", ["lost", "late"])
@pytest.mark.parametrize("then", ["removed", "renamed"])
@pytest.mark.parametrize("how", ["publish", "publish_group"], ids=["one file", "a group"])
@pytest.mark.parametrize("kind", ["local", "object"])
async def test_a_publication_that_landed_though_it_failed_is_taken_back_when_its_file_moves_on(tmp_path, kind, how, then, answer, caplog):
    """A publication (of one file, or of a group in one call) lands and is
    reported failed all the same (its answer lost), or is abandoned at its
    deadline and lands later; the store stays down, and the files are
    removed or renamed in the mount before a try succeeds. The store kept
    them at their old names for good: the replica took them for never shown
    there (only a record left with no file was deleted). What takes them
    back waits for the abandoned call, or it lands after; its first try
    fails, and is tried again as any store step is (it was taken for a bug
    of the publisher's)."""
    rig = Rig(_store(tmp_path, kind), deadlines=Deadlines(call_s=0.5, min_rate=1 << 40) if answer == "late" else None)
    names = ["f", "g", "h"]
    landed: list[tuple[str, list[str]]] = []  # (the call, the files it was for)
    down = {"on": True}

    def lossy(name: str):
        real = getattr(rig.backend, name)

        def call(*args, **kwargs):
            paths = [args[1]] if name == "publish" else [path for _, path, _, _ in args[1]]
            # Not these files' (a directory's record), or a step of a group's call (an object store's, in threads of its own)
            if not (down["on"] and set(paths) & set(names)) or threading.current_thread().name.startswith("ckptfs-group"):
                return real(*args, **kwargs)
            if landed or name != how:
                raise ConnectionError(f"injected: {name} did not reach the store")
            if answer == "late":
                landed.append((name, paths))
                time.sleep(1.5)  # abandoned meanwhile (its deadline 0.5 s)
                return real(*args, **kwargs)
            real(*args, **kwargs)
            landed.append((name, paths))
            raise ConnectionError(f"injected: the answer of {name} was lost")

        setattr(rig.backend, name, call)

    lossy("publish")
    lossy("publish_group")
    real_delete, deletes = rig.backend.delete, []

    def delete(path):
        if path in names and path not in deletes:
            deletes.append(path)
            raise ConnectionError(f"injected: delete {path} did not reach the store")
        real_delete(path)

    rig.backend.delete = delete
    others = threading.Semaphore(0)  # the first file is staged after the others: the three make one group at the head of the queue
    real_stage = rig.backend.stage

    def stage(pieces, size, name=None, elsewhere=False):
        out = real_stage(pieces, size, name, elsewhere)
        if name == names[0]:
            for _ in names[1:]:
                others.acquire(timeout=10)
            time.sleep(0.2)  # their staging noted by the engine meanwhile
        elif name in names:
            others.release()
        return out

    rig.backend.stage = stage
    data = {n: n.encode() * max(100, rig.backend.stage_ahead_from) for n in names}  # staged ahead of their turn (`stage` above)
    for n in names:
        rig.write(n, data[n])

    async def body():
        with trio.fail_after(10):
            while not landed or (answer == "late" and not rig.engine.calls.abandoned):
                await trio.sleep(0.01)
        if answer == "lost":
            assert set(_store_files(rig.root, rig.backend)) >= set(landed[0][1])  # it landed
        for n in names:
            rig.unlink(n) if then == "removed" else rig.rename(n, f"{n}.moved")
        down["on"] = False

    await run_until_flushed(rig, body)
    assert [name for name, _ in landed] == [how]
    assert "publisher error" not in caplog.text
    want = {} if then == "removed" else {f"{n}.moved": data[n] for n in names}
    assert _store_files(rig.root, rig.backend) == want
    assert set(await _restarted_view(tmp_path, rig.url)) == set(want)


@pytest.mark.parametrize("kind", ["local", "object"])
async def test_a_deletion_whose_abandoned_try_ends_after_its_retry_is_done_again(tmp_path, kind):
    """A deletion marks the file's record, deletes the file, then the
    record. Its first try hung in the marking and was abandoned; the retry
    deleted file and record; then the first try's marking landed, and its
    next call failed: the record was back with no file, and `verify`
    called the deleted file missing (until a restart took it for a
    leftover). The step is done once more when the late try ends."""
    rig = Rig(_store(tmp_path, kind), deadlines=Deadlines(call_s=0.5, min_rate=1 << 40))
    rig.write("f", b"x" * 1000)
    await run_until_flushed(rig)
    objpath = manifest.record_path("f")
    real_put, real_delete = rig.backend.put, rig.backend.delete
    retried, late = threading.Event(), threading.local()

    def put(path, data):
        if path == objpath and b"delete:" in data and not hasattr(put, "hung"):
            put.hung = late.on = True
            retried.wait(10)  # abandoned meanwhile (its deadline 0.5 s): the retry deletes file and record
            time.sleep(0.3)  # and is over
        real_put(path, data)

    def delete(path):
        if getattr(late, "on", False):  # (threads are reused: once)
            late.on = False
            raise ConnectionError("injected: the late try's next call failed")
        real_delete(path)
        if path == objpath:
            retried.set()

    rig.backend.put, rig.backend.delete = put, delete
    rig.unlink("f")
    await run_until_flushed(rig)
    assert retried.is_set() and rig.engine.calls.abandoned == 1
    deadline = time.monotonic() + 10
    while rig.engine.calls.stragglers() and time.monotonic() < deadline:  # the late try's marking landed, and it ended
        time.sleep(0.05)
    await run_until_flushed(rig)
    assert manifest.read(rig.backend, "f") is None
    assert verify(rig.backend).clean


async def test_a_directory_moves_only_once_an_abandoned_publication_into_it_is_done(tmp_path):
    """A directory renamed before its file's turn (Orbax's temporary one):
    at the rename's turn the file is published into the directory at its
    old name, then the directory moves. The publication's first try was
    abandoned at its deadline and landed later; its retry succeeded, and the
    move did not wait for the abandoned try (a step of the same op was taken
    for a retry of it): it landed after the move, and left the file at the
    directory's old name for good."""
    rig = Rig(tmp_path / "store", deadlines=Deadlines(call_s=0.5, min_rate=1 << 40))
    rig.mkdir("d.tmp")
    await run_until_flushed(rig)  # the directory is in the store
    data = os.urandom(rig.backend.stage_ahead_from)
    rig.write("d.tmp/x", data)
    rig.rename("d.tmp", "d")
    real_group, real_publish, slow = rig.backend.publish_group, rig.backend.publish, []

    def publish_group(records, files):
        if any(path == "d.tmp/x" for _, path, _, _ in files):
            raise ConnectionError("injected: the group's call did not reach the store")
        return real_group(records, files)

    def publish(staged, path, *args, **kwargs):
        if path == "d.tmp/x" and not slow:
            slow.append(path)
            time.sleep(1.5)  # abandoned meanwhile (its deadline 0.5 s), then it lands
        return real_publish(staged, path, *args, **kwargs)

    rig.backend.publish_group, rig.backend.publish = publish_group, publish
    await run_until_flushed(rig)
    assert slow and rig.engine.calls.abandoned
    deadline = time.monotonic() + 5
    while rig.engine.calls.stragglers() and time.monotonic() < deadline:  # the abandoned try is done: nothing lands later
        time.sleep(0.05)
    assert _store_files(rig.root, rig.backend) == {"d/x": data}
    assert set(await _restarted_view(tmp_path)) == {"d", "d/x"}


async def test_an_exchange_after_a_rewrite_that_landed_though_it_failed_moves_the_bytes_the_store_holds(tmp_path):
    """A file shown in the store is written again; that generation's
    publication lands and is reported failed (its answer lost), and the
    file is exchanged with another before a try succeeds. The replica still
    took the store for holding the generation before: the exchange's move
    from its hidden name, whose answer was lost in turn, was tried again for
    ever (the bytes there were not the ones it looked for)."""
    rig = Rig(_store(tmp_path, "object"))
    rig.write("e", b"E" * 100)
    rig.write("f", b"one" * 100)
    await run_until_flushed(rig)
    failing = {"publish": True, "move": False}
    real_publish, real_move = rig.backend.publish, rig.backend.move

    def publish(staged, path, *args, **kwargs):
        if path != "f" or not failing["publish"]:
            return real_publish(staged, path, *args, **kwargs)
        if failing["publish"] == "landed":
            raise ConnectionError("injected: the store is down")
        real_publish(staged, path, *args, **kwargs)
        failing["publish"] = "landed"
        raise ConnectionError("injected: the answer of publish was lost")

    def move(src, dst):
        real_move(src, dst)
        if src.startswith(".ckptfs/") and failing["move"] is True:  # from an exchange's hidden name (armed once the file is exchanged)
            failing["move"] = "lost"
            raise ConnectionError("injected: the answer of move was lost")

    rig.backend.publish, rig.backend.move = publish, move

    async def body():
        rig.write("f", b"two" * 100)
        with trio.fail_after(10):
            while failing["publish"] != "landed":
                await trio.sleep(0.01)
        rig.store.rename(ROOT, b"f", ROOT, b"e", RENAME_EXCHANGE)
        failing["publish"], failing["move"] = False, True

    await run_until_flushed(rig, body)
    assert failing["move"] == "lost"  # an exchange's move lost its answer
    assert _store_files(rig.root, rig.backend) == {"e": b"two" * 100, "f": b"E" * 100}
    assert set(await _restarted_view(tmp_path, rig.url)) == {"e", "f"}


async def test_a_directory_exchanged_with_one_whose_record_write_failed_then_removed_leaves_no_record(tmp_path):
    """The exchange deletes the records at both old paths that a directory
    may have (written or not as far as it knows); the one that comes to
    `d`, removed before the next sync, left `d`'s record of the other."""
    rig = Rig(_store(tmp_path, "object"))
    rig.mkdir("e")
    await _flushed_view(rig)
    failing = {"on": True}
    _answer_lost_for_the_record_of(rig, "d", failing)
    rig.mkdir("d")
    await run_until_flushed(rig)
    failing["on"] = False
    rig.store.rename(ROOT, b"d", ROOT, b"e", RENAME_EXCHANGE)
    rig.store.rmdir(ROOT, b"d")  # e's directory, now at d
    assert await _flushed_view(rig) == {"e": ("dir", 0o755, rig.store.inode_at("e").mtime_ns, None)}
    assert set(await _restarted_view(tmp_path, _store(tmp_path, "object"))) == {"e"}


@pytest.mark.parametrize("kind", ["local", "object"])
@pytest.mark.parametrize("synced", [True, False], ids=["a recorded directory", "a new one"])
async def test_a_directory_renamed_over_an_empty_one_and_removed_leaves_no_record(tmp_path, kind, synced):
    """The empty directory a rename replaces had its record at the path the
    moved one takes; the moved one was taken for unrecorded there (its own
    written at the next sync). Removed (or moved on) before that sync, it
    left the replaced one's record: a restart showed the path again."""
    rig = Rig(_store(tmp_path, kind))
    rig.mkdir("x")
    if synced:
        rig.mkdir("y")
    await _flushed_view(rig)
    if not synced:
        rig.mkdir("y")
    rig.rename("y", "x")
    rig.store.rmdir(ROOT, b"x")
    assert await _flushed_view(rig) == {}
    assert await _restarted_view(tmp_path, None if kind == "local" else _store(tmp_path, kind)) == {}


DEEP = ["a", "b", "c"]


_SOUND = sorted({8, 16, 27, *range(int(os.environ.get("CKPTFS_CONVERGENCE_SEEDS", "6")) // 2)})
SPEEDUP = 4  # how much faster than real time the engine's timers and the workload's pauses pass


@pytest.mark.parametrize("kind", ["local", "object"])
@pytest.mark.parametrize("seed, faults", [(seed, 0.0) for seed in _SOUND] + [(seed, 0.2) for seed in (2, 15, 16, 18)])
async def test_directory_moves_among_syncs_converge(tmp_path, seed, faults, kind, monkeypatch, mock_clock):
    """Directories made, moved (into each other, back, over empty ones),
    removed and given modes and times, symlinks of few targets among them,
    with pauses long enough for the publisher's directory syncs to fall
    between the moves; on a sound store, and on one failing a fifth of its
    calls. (Sound, seeds 8, 16 and 27 found a directory moved away and back
    coming back at the name between after its removal, and a symlink made
    again where a directory moved from going; faulty, seeds 2, 15, 16 and
    18 found directories whose record sync failed coming back after their
    removal or move.) The pauses took 95% of the time: trio's clock runs
    `SPEEDUP` times faster through the workload, the engine's quiet
    period and retry delays with it, as over a store that slow."""
    mock_clock.rate = 1
    rig = await _started(tmp_path, kind, monkeypatch)
    if faults:
        rig.engine.backend = FaultyBackend(rig.backend, error_rate=faults, latency_s=0.001, seed=seed)
    t, rng = rig.store, random.Random(seed)

    def pick() -> str:
        return "/".join(rng.choice(DEEP) for _ in range(rng.randint(1, 3)))

    def at(path: str):
        d, _, name = path.rpartition("/")
        return (t.inode_at(d) if d else t.get(ROOT)), name.encode()

    async def body():
        mock_clock.rate = SPEEDUP
        try:
            await workload()
        finally:
            mock_clock.rate = 1  # the flush and the restart after it at real speed, within their bounds

    async def workload():
        for _ in range(300):
            path = pick()
            parent, name = at(path)
            if parent is None or not parent.is_dir:
                continue
            node, op = t.inode_at(path), rng.random()
            try:
                if op < 0.25:
                    t.mkdir(parent.ino, name, rng.choice([0o755, 0o700]), 0, 0)
                elif op < 0.45:
                    dparent, dname = at(pick())
                    if dparent is not None and dparent.is_dir:
                        t.rename(parent.ino, name, dparent.ino, dname, RENAME_EXCHANGE if rng.random() < 0.1 else 0)
                elif op < 0.55:
                    if node is not None:
                        (t.rmdir if node.is_dir else t.unlink)(parent.ino, name)
                elif op < 0.65:
                    t.symlink(parent.ino, name, rng.choice([b"t1", b"t2"]), 0, 0)
                elif op < 0.75:
                    h = t.create(parent.ino, name, 0o644, W | os.O_TRUNC, 0, 0)
                    t.write(h.fh, 0, os.urandom(rng.choice([0, 10, 3000])))
                    t.release(h.fh)
                elif op < 0.8 and node is not None:
                    t.setattr(node.ino, mode=rng.choice([0o700, 0o755, 0o711]))
                elif op < 0.82 and node is not None:
                    t.setattr(node.ino, mtime_ns=rng.randrange(1, 2**62))
                else:
                    await trio.sleep(rng.choice([0, 0.001, 0.02, 0.1, 0.3]))  # DIR_SYNC_QUIET_S is 0.2
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOENT, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR, errno.EINVAL, errno.EPERM,
                                     errno.EBUSY):
                    raise
            if rng.random() < 0.1:
                await trio.sleep(0)

    view = await _flushed_view(rig, body)
    await _assert_converged(rig, tmp_path, view)


class _Killable:
    """Makes every call of a backend raise once `kill()` is called, from any
    thread, mid-step too: a daemon killed at that moment makes no further
    store change, while a test's cancelled engine would let its abandoned
    threads finish their steps."""

    def __init__(self, backend) -> None:
        import threading

        self.dead = False
        self.running = 0  # calls under way
        self._lock = threading.Lock()
        for name in dir(type(backend)):
            attr = getattr(backend, name, None)
            if name.startswith("__") or not callable(attr) or isinstance(attr, type):
                continue
            setattr(backend, name, self._guard(attr))

    def _guard(self, fn):
        def call(*args, **kwargs):
            if self.dead:
                raise SystemExit("killed")
            with self._lock:
                self.running += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.running -= 1

        return call

    def kill(self) -> None:
        self.dead = True

    async def settled(self) -> None:
        """The calls under way when it was killed have ended, as requests a
        killed daemon had sent still land (and memory:// must not be used
        from two threads at once: a restart's listing would race them)."""
        with trio.fail_after(10):
            while self.running:
                await trio.sleep(0.001)


class _Marks:
    """Completion markers written now and then among a workload's steps,
    each with what it vouches for: the files sealed in its directory's tree
    then (C3). `look` after every step notes the mount's sealed files."""

    def __init__(self, rig: Rig, seed: int) -> None:
        self.rig, self.rng = rig, random.Random(seed * 13 + 5)
        self.looks: list[dict[str, tuple[int, bytes]]] = []  # path -> (inode, digest), one per look
        self.marks: list[tuple[int, str, bytes, dict[str, tuple[int, bytes]]]] = []  # look, path, digest, vouched for
        self._digests: dict[int, bytes] = {}  # an inode's digest when last resident (an evicted file's bytes stay)

    def look(self) -> None:
        sealed = {}
        for path, (kind, _, _, data) in _mount_view(self.rig.store, with_data=True).items():
            node = self.rig.store.inode_at(path)
            if kind != "file" or node.writers:
                continue
            if node.data.resident:
                self._digests[node.ino] = xxhash.xxh3_128_digest(data)
            if node.ino in self._digests:
                sealed[path] = (node.ino, self._digests[node.ino])
        self.looks.append(sealed)

    def maybe_write(self) -> None:
        d = self.rng.choice(DIRS)
        parent = self.rig.store.inode_at(d) if d else self.rig.store.get(ROOT)
        if self.rng.random() >= 0.08 or parent is None or not parent.is_dir:
            return
        path = f"{d}/commit_success.txt" if d else "commit_success.txt"
        body = b"marker %d" % len(self.marks)
        h = self.rig.store.create(parent.ino, b"commit_success.txt", 0o644, W | os.O_TRUNC, 0, 0)
        self.rig.store.write(h.fh, 0, body)
        self.rig.store.release(h.fh)
        self.look()
        vouched = {p: v for p, v in self.looks[-1].items() if p.startswith(f"{d}/" if d else "") and not p.endswith("commit_success.txt")}
        self.marks.append((len(self.looks) - 1, path, xxhash.xxh3_128_digest(body), vouched))

    def check(self, back: dict) -> None:
        """A marker shown after a restart comes with every file it vouched
        for that the mount left alone since, as it was then."""
        shown = {p: xxhash.xxh3_128_digest(v[3]) for p, v in back.items() if v[0] == "file"}
        for at, path, digest, vouched in self.marks:
            if shown.get(path) != digest:
                continue
            for p, (ino, d) in vouched.items():
                if all(look.get(p) == (ino, d) for look in self.looks[at:]):
                    assert shown.get(p) == d, f"{path} (marker {at}) is shown, and {p} is {'other bytes' if p in shown else 'missing'}"


@pytest.mark.parametrize("faults", [0.0, 0.2], ids=["sound store", "faulty store"])
@pytest.mark.parametrize("kind", ["local", "object"])
@pytest.mark.parametrize("seed", range(int(os.environ.get("CKPTFS_CONVERGENCE_SEEDS", "6"))))
async def test_after_a_kill_at_any_moment_a_restart_loads_every_file_it_shows(tmp_path, seed, kind, faults, monkeypatch):
    """A random workload, the daemon killed at a random moment (mid-step
    too), a restart over the store: every file it shows loads, verified,
    and verify is clean once it has claimed the store (C2, C6, C9); a
    completion marker written among the steps comes back only with the
    files it vouched for (C3)."""

    from ckptfs.writeback.backend import open_store

    rng = random.Random(seed * 7 + 1)
    rig = await _started(tmp_path, kind, monkeypatch)
    killable = _Killable(rig.backend)
    if faults:
        rig.engine.backend = FaultyBackend(rig.backend, error_rate=faults, latency_s=0.001, seed=seed)
    work = Workload(rig, seed, faulty=bool(faults))
    marks = _Marks(rig, seed)
    for d in DIRS[1:]:
        rig.mkdir(d)
    try:
        async with trio.open_nursery() as n:
            await n.start(rig.engine.run)
            for _ in range(rng.randrange(20, 400)):
                await work.step()
                marks.look()
                marks.maybe_write()
            await trio.sleep(rng.choice([0, 0.001, 0.005, 0.02]))
            killable.kill()
            n.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # killed in a call the engine made on its own thread (before the cancel reached it)
        _, rest = group.split(SystemExit)
        if rest is not None:
            raise
    await killable.settled()
    # it died: its heartbeat stops (the scan tells its leftovers by that)
    open_store(rig.url).put(f"{DAEMONS}/{rig.backend.daemon_id}", json.dumps({"time": time.time() - 3600, "pid": 1}).encode())
    marks.check(await _restarted_view(tmp_path, rig.url))


# -- the cases random workloads found, one by one ------------------------------------------------
def _symlink(rig: Rig, path: str, target: str):
    return rig.store.symlink(rig.dir_of(path).ino, os.path.basename(path).encode(), target.encode(), 0, 0)


async def test_a_symlink_renamed_over_a_published_file_removes_the_file_from_the_store(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.write("f", b"data" * 100)
    await _flushed_view(rig)
    _symlink(rig, "s", "elsewhere")
    rig.rename("s", "f")
    await _assert_converged(rig, tmp_path, await _flushed_view(rig))


async def test_an_exchange_with_a_name_the_store_never_had_takes_no_symlink_made_there_later(tmp_path):
    """`d/x` removed (held back behind `gate`, sealed before it and deleted
    after), a file made there and never sealed, exchanged with directory
    `d/s`; later `d` moved to `g` and a symlink made at a new `d/s`. At the
    exchange's turn its removal happened first, and the replica had nothing
    at `d/x`: the publisher took the symlink the live mount has at `d/s` now
    for one it had lost (as a node taking over can), exchanged it, and `d`'s
    move took its record to `g/s`, a symlink the mount never had there (a
    random workload found it, on any store)."""
    rig = Rig(tmp_path / "store")
    for d in ("d", "d/s", "d/x"):
        rig.mkdir(d)
    await _flushed_view(rig)
    rig.write("gate", b"sealed before the removal, deleted after it")
    rig.store.rmdir(rig.dir_of("d/x").ino, b"x")
    h = rig.write("d/x", b"never sealed", keep_open=True)
    d = rig.store.inode_at("d").ino
    rig.store.rename(d, b"s", d, b"x", RENAME_EXCHANGE)
    rig.unlink("d/s")
    rig.rename("d", "g")
    rig.mkdir("d")
    _symlink(rig, "d/s", "elsewhere")
    rig.unlink("gate")
    rig.store.release(h.fh)
    view = await _flushed_view(rig)
    assert sorted(view) == ["d", "d/s", "g", "g/x"]
    await _assert_converged(rig, tmp_path, view)


async def test_a_symlink_renamed_before_its_turn_is_recorded_under_its_new_name_with_its_times(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.mkdir("d")
    _symlink(rig, "d/s", "target")  # its mtime is its creation's
    rig.rename("d", "e")
    rig.rename("e/s", "s2")
    await _assert_converged(rig, tmp_path, await _flushed_view(rig))


async def test_a_file_renamed_over_a_symlink_before_its_first_turn_leaves_no_symlink_record(tmp_path):
    rig = Rig(tmp_path / "store")
    _symlink(rig, "s", "target")
    await _flushed_view(rig)
    h = rig.write("f", b"x", keep_open=True)
    rig.rename("f", "s")  # sealed only at its close, under its new name
    rig.unlink("s")
    rig.store.release(h.fh)
    await _assert_converged(rig, tmp_path, await _flushed_view(rig))


@pytest.mark.parametrize("other", ["file", "directory", "symlink", "nothing published"])
async def test_an_exchange_of_a_directory_swaps_whole_trees_in_the_store(tmp_path, other):
    rig = Rig(tmp_path / "store")
    rig.mkdir("a")
    rig.write("a/one", b"1" * 1000)
    rig.mkdir("a/empty")
    if other == "file":
        rig.write("b", b"2" * 2000)
    elif other == "directory":
        rig.mkdir("b")
        rig.write("b/two", b"2" * 2000)
    elif other == "symlink":
        _symlink(rig, "b", "a/one")
    await _flushed_view(rig)
    if other == "nothing published":
        rig.write("b", b"3" * 10, keep_open=True)
    rig.store.rename(ROOT, b"a", ROOT, b"b", RENAME_EXCHANGE)
    view = await _flushed_view(rig)
    assert view["b/one"][3] == b"1" * 1000
    for h in list(rig.store.handles):
        rig.store.release(h)
    await _assert_converged(rig, tmp_path, await _flushed_view(rig))


async def test_a_flush_records_directories_as_they_are(tmp_path):
    """Directories' records used to wait for a quiet queue: a flush, then a
    crash, brought a directory back 0755 and with another mtime."""
    rig = Rig(tmp_path / "store")
    d = rig.mkdir("d")
    rig.store.setattr(d.ino, mode=0o700, mtime_ns=987_654_321)
    view = await _flushed_view(rig)  # the engine stops right after: no quiet moment
    assert stat.S_IMODE(os.stat(rig.root / "d").st_mode) == 0o700
    await _assert_converged(rig, tmp_path, view)


@pytest.mark.parametrize("kind", ["local", "object"])
async def test_the_mount_roots_attributes_are_recorded_when_they_change(tmp_path, kind):
    """`chmod 700` (or chown) of the mount's root alone: the root's record
    kept its attributes of before (a change of attributes made its
    directories dirty by the replica's index of inodes, which never holds
    the root), and a restart brought the root back 0755, open to all."""
    rig = Rig(_store(tmp_path, kind))
    rig.write("f", b"x")
    await run_until_flushed(rig)
    rig.store.setattr(ROOT, mode=0o700, uid=1234)
    await run_until_flushed(rig)
    rec = manifest.read(rig.backend, "")
    assert (rec.meta.mode & 0o7777, rec.meta.uid) == (0o700, 1234)
    again = Rig(_store(tmp_path, kind), claim=False)
    await again.engine.scan()
    root = again.store.get(ROOT)
    assert (stat.S_IMODE(root.mode), root.uid) == (0o700, 1234)


@pytest.mark.parametrize("kind", ["local", "object"])
async def test_a_record_write_abandoned_then_landing_late_does_not_undo_a_newer_one(tmp_path, kind):
    """The root's record (its attributes, written while the queue is idle)
    hung past its deadline and was abandoned; its mode changed meanwhile,
    and the next write of the record went ahead, taken for a retry of the
    same step (same name, no op); then the late write landed: a restart
    brought the old mode back. Only a retry of the same call goes ahead
    of an abandoned try."""
    rig = Rig(_store(tmp_path, kind), deadlines=Deadlines(call_s=0.5, min_rate=1 << 40))
    rig.write("f", b"x")
    await run_until_flushed(rig)
    real, hanging = rig.backend.put, []

    def put(path, data):
        if path == manifest.record_path("") and not hanging:
            hanging.append(path)
            time.sleep(1.5)  # abandoned meanwhile (its deadline 0.5 s), then it lands
        return real(path, data)

    rig.backend.put = put

    async def settled():
        with trio.fail_after(10):
            while rig.engine.queue:
                await trio.sleep(0.01)

    async def body():
        rig.store.setattr(ROOT, mode=0o750)
        await settled()
        assert not await rig.engine.publisher.sync_dirs()  # its record's write abandoned
        rig.store.setattr(ROOT, mode=0o700)
        await settled()
        with trio.fail_after(10):
            while not await rig.engine.publisher.sync_dirs():
                await trio.sleep(0.01)

    await run_until_flushed(rig, body)
    assert hanging and rig.engine.calls.abandoned == 1
    deadline = time.monotonic() + 10
    while rig.engine.calls.stragglers() and time.monotonic() < deadline:  # the late write landed
        time.sleep(0.05)
    await run_until_flushed(rig)
    assert manifest.read(rig.backend, "").meta.mode & 0o7777 == 0o700


async def test_a_directory_made_in_a_directory_renamed_before_its_turn_exists_in_the_store(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.mkdir("a")
    await _flushed_view(rig)
    rig.mkdir("a/sub")
    rig.rename("a", "b")
    view = await _flushed_view(rig)
    assert os.path.isdir(rig.root / "b" / "sub")
    await _assert_converged(rig, tmp_path, view)


async def test_a_chmod_after_a_turn_that_held_the_file_reaches_the_store(tmp_path):
    rig = Rig(tmp_path / "store")
    h = rig.write("f", b"x" * 100)
    rig.rename("f", "g")  # the file's turn finds it gone from f, and the rename's from g: held
    rig.store.setattr(h.inode.ino, mode=0o600)  # whose turn comes while it is held
    rig.rename("g", "h")
    view = await _flushed_view(rig)
    assert stat.S_IMODE(os.stat(rig.root / "h").st_mode) == 0o600
    await _assert_converged(rig, tmp_path, view)


async def test_a_file_assembled_in_a_hidden_directory_takes_its_mode(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.mkdir("a")
    h = rig.write("a/f", b"x" * 100)
    rig.store.setattr(h.inode.ino, mode=0o640)
    rig.rename("a", "b")  # a directory the store never had: assembled hidden, then moved
    view = await _flushed_view(rig)
    assert stat.S_IMODE(os.stat(rig.root / "b" / "f").st_mode) == 0o640
    await _assert_converged(rig, tmp_path, view)


async def test_a_hard_link_made_then_moved_before_its_turn_is_in_the_store(tmp_path):
    rig = Rig(tmp_path / "store")
    rig.mkdir("a")
    h = rig.write("f", b"linked" * 100)
    await _flushed_view(rig)
    rig.store.link(h.inode.ino, rig.dir_of("a/l").ino, b"l")
    rig.rename("a", "b")
    view = await _flushed_view(rig)
    assert (rig.root / "b" / "l").read_bytes() == b"linked" * 100
    await _assert_converged(rig, tmp_path, view)


async def test_the_last_copy_of_a_file_replaced_while_its_hard_link_moved_is_not_lost(tmp_path):
    """A hard link made, its directory moved before the link's turn, and the
    published name replaced: the store's only copy went, and the file, evicted
    from RAM once published, read as EIO."""
    rig = Rig(tmp_path / "store")
    rig.mkdir("a")
    h = rig.write("a/y", b"only" * 1000)
    await _flushed_view(rig)
    assert rig.engine.evict(1 << 40) and not h.inode.data.resident
    rig.store.link(h.inode.ino, rig.dir_of("a/l").ino, b"l")
    rig.write("z", b"other")
    rig.rename("z", "a/y")
    rig.rename("a", "b")
    view = await _flushed_view(rig)
    assert view["b/l"][3] == b"only" * 1000
    await _assert_converged(rig, tmp_path, view)


async def test_a_hard_link_made_while_a_newer_generation_waits_shows_the_newer_bytes(tmp_path):
    rig = Rig(tmp_path / "store")
    h = rig.write("c", b"old" * 100)
    await _flushed_view(rig)
    rig.write("c", b"new" * 100)  # its turn finds c gone (renamed below): held
    rig.store.link(h.inode.ino, ROOT, b"y")  # the link's turn: y must get the new bytes, not c's old ones
    rig.rename("c", "z")
    view = await _flushed_view(rig)
    assert (rig.root / "y").read_bytes() == b"new" * 100
    await _assert_converged(rig, tmp_path, view)


async def test_a_hard_link_renamed_over_another_published_file_shows_its_own_bytes(tmp_path):
    """A hard link, renamed before its turn over a published file of another
    inode, took that file's place in the replica as if the store showed the
    link's bytes there: the store kept the other file's bytes at that name,
    and deleting the link's first name then deleted its last copy (EIO)."""
    rig = Rig(tmp_path / "store")
    h = rig.write("a", b"mine" * 1000)
    rig.write("t", b"theirs")
    await _flushed_view(rig)
    assert rig.engine.evict(1 << 40) and not h.inode.data.resident
    rig.store.link(h.inode.ino, ROOT, b"l")
    rig.rename("l", "t")  # the link's turn finds l gone: its rename's turn shows it at t
    rig.unlink("a")
    view = await _flushed_view(rig)
    assert view == {"t": ("file", 0o644, h.inode.mtime_ns, b"mine" * 1000)}
    await _assert_converged(rig, tmp_path, view)


async def test_a_hard_link_whose_generation_was_published_only_at_a_deleted_name_shows_the_file(tmp_path):
    """A rewrite published at x while its hard link l was not live (held
    there), x deleted, l renamed to x: the generation l held was shown
    nowhere any more, and its turn tried to publish it again from a
    snapshot let go once published, failing for ever (a flush never
    returned). The file is sealed again before its last copy goes."""
    rig = Rig(tmp_path / "store")
    h = rig.write("x", b"one" * 100)
    rig.store.link(h.inode.ino, ROOT, b"l")
    rig.write("x", b"two" * 100)  # sealed with the names x and l: l's turn finds l gone
    rig.unlink("x")
    rig.rename("l", "x")
    view = await _flushed_view(rig)
    assert view["x"][3] == b"two" * 100 and set(view) == {"x"}
    await _assert_converged(rig, tmp_path, view)


async def _crash_after(rig: Rig, call: str, before: bool = False, nth: int = 1) -> None:
    """Run the engine until the backend's `nth` `call` has changed the store
    (or, `before`, is about to), and stop it there, as a daemon killed then."""
    import threading

    done, never = threading.Event(), threading.Event()
    inner = getattr(rig.backend, call)
    calls = []

    def crash_after(*args):
        calls.append(args)
        if len(calls) < nth:
            return inner(*args)
        if not before:
            inner(*args)
        done.set()
        never.wait(5)
        raise SystemExit("killed")  # the rest of the step never runs (its thread is abandoned)

    setattr(rig.backend, call, crash_after)
    try:
        async with trio.open_nursery() as n:
            await n.start(rig.engine.run)
            with trio.fail_after(20):
                while not done.is_set():
                    await trio.sleep(0.005)
            n.cancel_scope.cancel()
    finally:
        never.set()


async def _restarted_view(tmp_path, store: str | None = None) -> dict:
    """A restart over the store (`tmp_path`/store, or the `store` URL): its
    view, every file loaded (verified); then a flush, and `verify` is clean."""
    again = Rig(store or tmp_path / "store", claim=False)
    async with trio.open_nursery() as n:
        await again.engine.scan()
        await again.engine.claim(new_daemon_id(), time.time())
        await n.start(again.engine.run)
        with trio.fail_after(60):
            await _load_all(again)
            await again.engine.flush()
        back = _mount_view(again.store, with_data=True)
        assert not again.engine.verify_failures
        n.cancel_scope.cancel()
    report = verify(again.backend)
    assert report.clean, report
    return back


@pytest.mark.parametrize("kind", ["files", "directories"])
async def test_a_crash_right_after_an_exchange_in_a_local_store_leaves_every_file_loadable(tmp_path, kind):
    """A local store swaps two names in one renameat2; the records followed
    after it. A crash in between left each name's bytes checked against the
    other's record: after a restart both read as EIO. The records now say
    what may be there (the bytes either side had) before the swap."""
    rig = Rig(tmp_path / "store")
    one, two = os.urandom(3000), os.urandom(5000)
    a, b = ("a", "b") if kind == "files" else ("a/f", "b/f")
    if kind == "directories":
        rig.mkdir("a")
        rig.mkdir("b")
    rig.write(a, one)
    rig.write(b, two)
    await _flushed_view(rig)
    rig.store.rename(ROOT, b"a", ROOT, b"b", RENAME_EXCHANGE)
    await _crash_after(rig, "exchange")
    back = await _restarted_view(tmp_path)
    assert (back[a][3], back[b][3]) == (two, one)  # the swap happened: the store shows it


@pytest.mark.parametrize(("kind", "call", "nth"), [(kind, call, n) for kind, most in (("files", 2), ("directories", 3), ("a directory and a file", 3))
                                                     for call in ("copy", "delete", "move") for n in range(1, most + 1)])
async def test_a_crash_in_an_exchange_on_an_object_store_is_finished_by_the_restart(tmp_path, kind, call, nth):
    """An object store exchanges two names file by file through hidden
    names. They moved a's files there first: a crash then left a with no
    file and b with its own, and the restart dropped a's record as a
    leftover, losing a's bytes. Then every file was copied to a hidden name
    first, and a restart finished the moves whose way was clear, which left
    an exchange cut short before all its copies were made halfway done:
    some files at their old names, some at their new. Now the store keeps
    the exchange's plan while it runs, and the restart finishes it from
    where it was: the store shows the exchange done. A file may take the
    name of a directory: nothing of the other side is in its way then."""
    url = f"memory://{tmp_path.name}/exchange"
    rig = Rig(url)
    one, two, three = os.urandom(3000), os.urandom(5000), os.urandom(700)
    paths = {"files": ("x", "y"), "directories": ("a/f", "b/f"), "a directory and a file": ("a/f", "b")}[kind]
    if kind != "files":
        rig.mkdir("a")
        rig.mkdir("a/g")
        rig.write("a/g/h", three)
    if kind == "directories":
        rig.mkdir("b")
    rig.write(paths[0], one)
    rig.write(paths[1], two)
    top = ("x", "y") if kind == "files" else ("a", "b")
    await _flushed_view(rig)
    before = _mount_view(rig.store, with_data=True)
    rig.store.rename(ROOT, top[0].encode(), ROOT, top[1].encode(), RENAME_EXCHANGE)
    after = _mount_view(rig.store, with_data=True)
    await _crash_after(rig, call, nth=nth)
    rig.backend.put(f"{DAEMONS}/{rig.backend.daemon_id}", json.dumps({"time": time.time() - 3600, "pid": 1}).encode())  # it died
    back = await _restarted_view(tmp_path, url)

    def files(view):  # path -> its bytes' hash (short, for a readable failure)
        return {p: xxhash.xxh3_64_hexdigest(v[3])[:8] for p, v in view.items() if v[0] == "file"}

    assert files(back) == files(after) != files(before)


@pytest.mark.parametrize("planted", ["ckptfs's own objects", "no digest", "a file that is gone"])
async def test_an_exchange_plan_planted_in_the_store_that_cannot_be_followed_is_not(tmp_path, planted):
    """The store keeps an exchange's plan while it runs, and a restart
    finishes a plan it finds: input, like the records. A plan whose steps
    name ckptfs's own objects (a record, to delete it) or a path out of the
    mount's names, or that is not well formed, is not followed; nor is one
    whose files are gone (changed without ckptfs since): the restart shows
    the store as it is, where a failing step would stop every mount."""
    url = f"memory://{tmp_path.name}/planted"
    rig = Rig(url)
    rig.write("a", b"one" * 1000)
    await _flushed_view(rig)
    steps = {"ckptfs's own objects": [[["delete", manifest.record_path("a")]], [["move", "a", "../b", None]], []],
             "no digest": [[], [["delete-file", "a", {"size": "big"}, [420, None, None, None]]], []],
             "a file that is gone": [[["copy", "gone", ".ckptfs/staging/d/x"]], [["delete", "a"]], []]}[planted]
    rig.backend.put(exchange.PLAN, exchange.Plan(7, "a and b", steps).encode())
    back = await _restarted_view(tmp_path, url)
    assert back["a"][3] == b"one" * 1000 and manifest.read(rig.backend, "a") is not None
    assert exchange.read(rig.backend) is None


async def test_a_hard_link_in_a_directory_moved_on_an_object_store_is_copied_from_where_its_file_went(tmp_path):
    """An object store moves a directory member by member; the directory
    takes its new name after. A hard link's copy, made after the file it
    shares bytes with had moved, was taken from that file's old path: gone,
    so the move was tried again for ever (or, had the old bytes still been
    there, copied them under the new bytes' record)."""
    rig = Rig(f"memory://{tmp_path.name}/objects")
    rig.mkdir("b")
    h = rig.write("b/c", b"one" * 1000)
    await _flushed_view(rig)
    rig.store.link(h.inode.ino, rig.dir_of("b/z").ino, b"z")
    rig.write("b/c", b"two" * 1000)  # sealed with the names c and z; both turns find b moved on: held
    rig.rename("b", "y")
    view = await _flushed_view(rig)
    assert view["y/c"][3] == view["y/z"][3] == b"two" * 1000
    await _assert_converged(rig, tmp_path, view)


async def test_a_member_not_shown_at_its_new_path_moves_with_its_directory_on_an_object_store(tmp_path, monkeypatch):
    """An object store moves a directory member by member. A member whose
    newer generation could not be shown at its new path (a failed try, and
    the mount had moved it on meanwhile) kept its older bytes at the old
    path, while the publisher took them to be at the new one: an object
    nothing showed stayed in the store, and the next move of the file
    failed for ever. Those bytes now move with the directory."""
    import threading

    from ckptfs.writeback import storeio

    rig = Rig(f"memory://{tmp_path.name}/objects")
    rig.mkdir("b")
    rig.write("b/c", b"one" * 1000)
    await _flushed_view(rig)
    rig.write("b/c", b"two" * 1000)  # its turn finds b moved on: held, shown at the directory's turn
    rig.rename("b", "y")
    trying, go_on = threading.Event(), threading.Event()
    real = storeio.publish

    def publish(backend, rec, staged, path, *args, **kwargs):
        if path == "y/c" and not go_on.is_set():
            trying.set()
            go_on.wait(10)
            raise ConnectionError("injected: the try fails while the mount moves the file on")
        return real(backend, rec, staged, path, *args, **kwargs)

    monkeypatch.setattr(storeio, "publish", publish)

    async def body():
        with trio.fail_after(10):
            while not trying.is_set():
                await trio.sleep(0.005)
        rig.rename("y/c", "w")
        go_on.set()

    view = await _flushed_view(rig, body)
    assert view["w"][3] == b"two" * 1000 and "y/c" not in view
    await _assert_converged(rig, tmp_path, view)


async def test_a_crash_in_an_exchange_of_a_symlink_and_a_directory_on_an_object_store_shows_the_files(tmp_path):
    """The directory's files were copied and deleted, the symlink's record
    not yet moved: the restart finished the files' moves under the
    symlink's path, and restored both a symlink and files under it (a file
    whose data was nowhere). A file under a symlink's record wins, as a
    directory the store lists does."""
    url = f"memory://{tmp_path.name}/exchange"
    rig = Rig(url)
    _symlink(rig, "x", "elsewhere")
    rig.mkdir("a")
    rig.write("a/b", b"moved" * 100)
    await _flushed_view(rig)
    rig.store.rename(ROOT, b"x", ROOT, b"a", RENAME_EXCHANGE)
    await _crash_after(rig, "delete", nth=1)
    rig.backend.put(f"{DAEMONS}/{rig.backend.daemon_id}", json.dumps({"time": time.time() - 3600, "pid": 1}).encode())  # it died
    back = await _restarted_view(tmp_path, url)
    assert back["x/b"][3] == b"moved" * 100


async def test_a_record_naming_a_visible_file_as_hidden_copy_moves_nothing(tmp_path):
    """A restart finishes only moves out of hidden names: a record is
    input, and one planted with a user's file as its hidden copy must not
    move that file."""
    url = f"memory://{tmp_path.name}/planted"
    rig = Rig(url)
    rig.write("victim", b"stays" * 100)
    await _flushed_view(rig)
    kept = manifest.read(rig.backend, "victim")
    manifest.write(rig.backend, Record.of("x", "file", Meta(), current=kept.current, source="hidden:victim victim"))
    back = await _restarted_view(tmp_path, url)
    assert back["victim"][3] == b"stays" * 100 and "x" not in back


@pytest.mark.parametrize("how", ["rename", "hard link"])
async def test_a_crash_before_a_file_moves_or_is_copied_over_another_leaves_the_other_loadable(tmp_path, how):
    """The record at the destination is written before the store moves (or
    copies) the file there: a crash between left the bytes still there
    checked against the incoming file's record (EIO after a restart). The
    record names them as its previous bytes."""
    rig = Rig(tmp_path / "store")
    rig.write("a", b"incoming" * 100)
    rig.write("b", b"replaced")
    await _flushed_view(rig)
    if how == "rename":
        rig.rename("a", "b")
    else:  # a hard link renamed over b before its turn: b keeps the replaced bytes until the copy
        rig.store.link(rig.store.inode_at("a").ino, ROOT, b"l")
        rig.rename("l", "b")
    await _crash_after(rig, "move" if how == "rename" else "copy", before=True)
    back = await _restarted_view(tmp_path)
    assert back["b"][3] == b"replaced"


async def test_a_crash_after_an_exchange_moved_a_file_and_made_a_directory_at_its_old_name_is_finished_by_the_restart(tmp_path):
    """A file `a` exchanged with a directory `b` the store never had (made
    and exchanged before its turn): the plan's second phase moves `a` to
    `b`, then makes the directory at `a`. A crash after both, before the
    phase was kept as done: the restart did the phase again, the move found
    a directory at `a` (ENOTDIR), and every restart failed there (found by
    the takeover explorer, seed 1223)."""
    rig = Rig(tmp_path / "store")
    rig.write("a", b"file a")
    await _flushed_view(rig)
    rig.mkdir("b")
    rig.store.rename(ROOT, b"a", ROOT, b"b", RENAME_EXCHANGE)
    await _crash_after(rig, "mkdir")
    back = await _restarted_view(tmp_path)
    assert back["b"][3] == b"file a" and back["a"][0] == "dir"


@pytest.mark.parametrize("moved", [False, True])
async def test_a_crash_in_a_directory_move_on_a_local_store_shows_it_at_one_name(tmp_path, moved):
    """A local store moves a directory in one rename(2), its records written
    before at the new names and deleted after at the old ones. A symlink's
    or a directory's record has no bytes to tell which name the crash left
    it at: a restart showed the symlink at both names, under the directory
    at its old name and at its new one (a name the mount never had it at
    together with the other), and, after the move, the directory and the
    one in it again at the old name, empty."""
    rig = Rig(tmp_path / "store")
    rig.mkdir("a")
    rig.write("a/f", b"data" * 100)
    rig.store.symlink(rig.store.inode_at("a").ino, b"s", b"target", 0, 0)
    rig.mkdir("a/sub")
    view = await _flushed_view(rig)
    rig.rename("a", "x")
    await _crash_after(rig, "move_dir", before=not moved)
    back = await _restarted_view(tmp_path)
    assert back == ({"x" + p[1:]: v for p, v in view.items()} if moved else view)
    kept = ["x", "x/sub", "x/s"] if moved else ["a", "a/sub", "a/s"]
    assert [manifest.read(rig.backend, p).source for p in kept] == ["", "", ""]  # the move settled: its records no longer name it


@pytest.mark.parametrize("call, nth", [("delete", 1), ("delete", 2), ("delete", 3), ("delete", 4), ("publish_group", 2)])
async def test_a_crash_after_a_directory_move_on_a_local_store_before_its_records_settle(tmp_path, call, nth):
    """After the move: the old names' records go (a store call each), then
    the new names' symlink and directory records are written again without
    the move in their source. A crash anywhere between shows the tree at
    its new name only, and the restart settles the records as the move
    would have."""
    rig = Rig(tmp_path / "store")
    rig.mkdir("a")
    rig.write("a/f", b"data" * 100)
    _symlink(rig, "a/s", "target")
    rig.mkdir("a/sub")
    view = await _flushed_view(rig)
    rig.rename("a", "x")
    await _crash_after(rig, call, nth=nth, before=call == "publish_group")
    assert await _restarted_view(tmp_path) == {"x" + p[1:]: v for p, v in view.items()}
    assert [manifest.read(rig.backend, p).source for p in ("x", "x/sub", "x/s")] == ["", "", ""]


async def test_symlink_records_naming_a_directory_move_ckptfs_never_wrote_do_not_stop_a_restart(tmp_path, caplog):
    """Sources cut short or naming paths no file system has are left alone;
    two records naming one old record (`a/s`, where the store has no
    directory `a`) take it away once."""
    rig = Rig(tmp_path / "store")
    rig.mkdir("x")
    rig.mkdir("y")
    await _flushed_view(rig)
    for path, source in [("p", "dirmove:"), ("q", "dirmove:../up\0a/s\0x"), ("x/s", "dirmove:a\0a/s\0x"), ("y/s", "dirmove:a\0a/s\0y"),
                         ("a/s", "")]:
        manifest.write(rig.backend, Record.of(path, "symlink", Meta(0o777, 0, 0, 1), target="t", source=source))
    back = await _restarted_view(tmp_path)
    assert {p for p, v in back.items() if v[0] == "symlink"} == {"p", "q", "x/s", "y/s"}
    assert "scan the store failed" not in caplog.text


async def test_a_symlink_made_again_where_a_directory_move_took_one_from_comes_back_at_both_names(tmp_path):
    """What a crash in a directory move leaves (a symlink's record at its old
    and its new name) is also what a finished move and the same symlink made
    again at the old name leave: with a directory at both names, both stay."""
    rig = Rig(tmp_path / "store")
    for step in range(2):
        rig.mkdir("a")
        rig.store.symlink(rig.store.inode_at("a").ino, b"s", b"target", 0, 0)
        if step == 0:
            await _flushed_view(rig)
            rig.rename("a", "x")
    view = await _flushed_view(rig)
    assert {p for p, v in view.items() if v[0] == "symlink"} == {"a/s", "x/s"}
    await _assert_converged(rig, tmp_path, view)


@pytest.mark.parametrize("kind", ["local", "object"])
async def test_a_directory_moved_away_and_back_then_removed_does_not_come_back_at_the_name_between(tmp_path, kind, caplog):
    """A local store's directory move writes the directories' records at the
    new names before the move; the publisher then took the moved ones for
    unrecorded. Moved again before its next sync, a directory left its
    record at the name between, and removed later, it came back there at
    the next restart (under a warning that blamed a crash)."""
    rig = Rig(_store(tmp_path, kind))
    rig.mkdir("d0")
    rig.mkdir("d0/sub")
    await _flushed_view(rig)
    rig.rename("d0", "d2")
    rig.rename("d2", "d0")
    view = await _flushed_view(rig)
    assert manifest.read(rig.backend, "d2") is None and manifest.read(rig.backend, "d2/sub") is None
    assert manifest.read(rig.backend, "d0/sub").source == ""  # written again, plain
    rig.store.rmdir(rig.dir_of("d0/sub").ino, b"sub")
    rig.store.rmdir(ROOT, b"d0")
    view = await _flushed_view(rig)
    assert view == {}
    assert await _restarted_view(tmp_path, None if kind == "local" else _store(tmp_path, kind)) == {}
    assert "both names" not in caplog.text


async def test_a_symlink_made_again_where_a_directory_moved_from_before_the_store_had_it_stays(tmp_path):
    """A directory the store never had is assembled in a hidden directory and
    moved from there; its symlink's record at the new name named the move
    for good. The same symlink made again at the old name then read, at the
    next restart, as what a crash in that move leaves: its record went."""
    rig = Rig(tmp_path / "store")
    for _ in range(2):  # the first moved before its Mkdir's turn: the store never has it at `a`
        rig.mkdir("a")
        _symlink(rig, "a/s", "target")
        if not rig.store.inode_at("x"):
            rig.rename("a", "x")
    view = await _flushed_view(rig)
    assert {p for p, v in view.items() if v[0] == "symlink"} == {"a/s", "x/s"}
    await _assert_converged(rig, tmp_path, view)


async def test_a_crash_right_after_an_exchange_moved_one_side_leaves_no_record_without_its_file(tmp_path):
    """Only one side in the store: it moves, then the records follow. A
    crash before the old paths' records went left them with no file
    (verify: missing), and, before that, the moved files with no record."""
    rig = Rig(tmp_path / "store")
    rig.mkdir("a")
    rig.write("a/f", b"moved" * 100)
    await _flushed_view(rig)
    rig.mkdir("b")  # its Mkdir's turn finds b exchanged away: the store never has it
    rig.store.rename(ROOT, b"a", ROOT, b"b", RENAME_EXCHANGE)
    await _crash_after(rig, "move_dir")
    back = await _restarted_view(tmp_path)
    assert back["b/f"][3] == b"moved" * 100 and "a/f" not in back


@pytest.mark.parametrize("where", ["at a directory", "under a file", "under a symlink"])
async def test_a_stale_symlink_record_where_the_store_has_other_entries_does_not_break_a_restart(tmp_path, where):
    """A crash between a store move and the record changes after it can
    leave a symlink's record where the store now has a directory, or under
    a file: the restart raised (a file as a parent) or showed the symlink
    over the directory, whose files then read as EIO. The store's files win."""
    rig = Rig(tmp_path / "store")
    rig.mkdir("d")
    rig.write("d/f", b"kept")
    rig.write("g", b"also kept")
    _symlink(rig, "s", "elsewhere")
    await _flushed_view(rig)
    stale = {"at a directory": "d", "under a file": "g/x", "under a symlink": "s/x"}[where]
    manifest.write(rig.backend, Record.of(stale, "symlink", Meta(mode=0o777), target="t"))
    back = await _restarted_view(tmp_path)
    assert back["d/f"][3] == b"kept" and back["g"][3] == b"also kept" and back["s"][3] == b"elsewhere"
    left = manifest.read(rig.backend, stale)
    assert left is None or (stale == "d" and left.kind == "dir")  # the directory's own record, written after the restart


async def test_a_hard_link_renamed_over_a_file_then_moved_with_its_directory_shows_its_own_bytes(tmp_path):
    """The link's rename over t found t gone already (its directory moved):
    t kept the replaced file's bytes, and the directory's move showed them
    as the link's."""
    rig = Rig(tmp_path / "store")
    rig.mkdir("d")
    rig.write("d/t", b"theirs")
    h = rig.write("f", b"mine" * 500)
    await _flushed_view(rig)
    rig.store.link(h.inode.ino, rig.dir_of("d/l").ino, b"l")
    rig.rename("d/l", "d/t")
    rig.rename("d", "e")
    view = await _flushed_view(rig)
    assert view["e/t"][3] == b"mine" * 500
    await _assert_converged(rig, tmp_path, view)


async def test_hard_links_in_a_directory_the_store_never_had_moved_before_their_turn_are_all_shown(tmp_path):
    """Both names held, their directory moved: assembled in a hidden
    directory, the second name's copy was taken from the first name's old
    path, which the store never had; the move was retried for ever."""
    rig = Rig(tmp_path / "store")
    rig.mkdir("a")
    h = rig.write("a/c", b"both" * 300, keep_open=True)
    rig.store.link(h.inode.ino, rig.dir_of("a/z").ino, b"z")
    rig.store.release(h.fh)  # sealed with both names
    rig.rename("a", "y")
    view = await _flushed_view(rig)
    assert view["y/c"][3] == view["y/z"][3] == b"both" * 300
    await _assert_converged(rig, tmp_path, view)


async def test_an_exchange_of_files_the_store_does_not_have_does_not_mark_their_directory_made(tmp_path):
    """An exchange of two files held (renamed out before their turns) marked
    their directory as in the store, which never had it; its rename then
    found nothing to move, and the empty directory the mount has never
    reached the store."""
    rig = Rig(tmp_path / "store")
    rig.mkdir("d")
    rig.write("d/a", b"one")
    rig.write("d/b", b"two")
    rig.store.rename(rig.dir_of("d/a").ino, b"a", rig.dir_of("d/b").ino, b"b", RENAME_EXCHANGE)
    rig.rename("d/a", "x")
    rig.rename("d/b", "w")
    rig.rename("d", "e")  # d's Mkdir finds it gone: the store never has d
    view = await _flushed_view(rig)
    assert view["e"][0] == "dir" and view["x"][3] == b"two" and view["w"][3] == b"one"
    await _assert_converged(rig, tmp_path, view)
