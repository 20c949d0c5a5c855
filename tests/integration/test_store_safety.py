"""What is planted in a local store cannot turn ckptfs against its host: no
symlink in the store is ever followed, for reading or for writing."""

from __future__ import annotations

import errno
import os
import time

import pytest

from tests.mountutil import run_cli, start_mount, stop_mount


def test_symlinks_planted_in_the_store_are_never_followed(tmp_path):
    store = tmp_path / "store"
    secret = tmp_path / "secret"
    secret.write_bytes(b"root's secret")
    secret.chmod(0o600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store.mkdir()
    (store / "x").symlink_to(secret)  # would show the secret as a file in the mount
    (store / "d").symlink_to(elsewhere)  # would make a publish write outside the store
    (store / "ok").mkdir()
    (store / "ok" / "link").symlink_to(elsewhere)

    m = start_mount(tmp_path)
    try:
        m.allowed_log_errors += ["symlink in the store", "failed (try", "failed for good", "cannot be applied"]
        assert sorted(os.listdir(m.mountpoint)) == ["ok"]  # neither symlink is shown
        assert os.listdir(m.mountpoint / "ok") == []
        (m.mountpoint / "d").mkdir()
        (m.mountpoint / "d" / "f").write_bytes(b"must not leave the store")
        (m.mountpoint / "ok" / "link").mkdir()
        (m.mountpoint / "ok" / "link" / "g").write_bytes(b"nor this")
        (m.mountpoint / "fine").write_bytes(b"published")
        deadline = time.monotonic() + 60
        while not (store / "fine").exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # the two files under planted symlinks are parked (status says so), never written through them
        deadline = time.monotonic() + 60
        while "failed for good" not in m.log_text() or m.log_text().count("parked") < 2:
            assert time.monotonic() < deadline, m.log_text()[-3000:]
            time.sleep(0.2)
        assert list(elsewhere.iterdir()) == []
        assert secret.read_bytes() == b"root's secret"
        r = run_cli("status", str(m.mountpoint), "--json")
        assert '"failed"' in r.stdout
    finally:
        stop_mount(m)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("many", [False, True], ids=["in the daemon", "aside"])
def test_a_walk_of_the_whole_store_lists_its_files_and_directories_and_follows_no_symlink(tmp_path, many, caplog):
    """A restart lists a big store in a process of its own (`listing.Aside`):
    it finds what the walk in the daemon finds, in the same order, and
    never follows a symlink either. A fifo another tool made in the store
    is left out with a warning (it was left out without a word)."""
    from ckptfs.writeback.localstore import LocalBackend

    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    (elsewhere / "deep").mkdir(parents=True)
    (elsewhere / "deep" / "secret").write_bytes(b"not the store's")
    for d in ("a/b/c", "a/e", ".ckptfs/files", "z"):
        (store / d).mkdir(parents=True)
    for f, n in (("top", 1), ("a/one", 22), ("a/b/c/deep", 333), ("a/e/.ckptfs", 4), (".ckptfs/files/rec", 5), ("z/\udcff-not-utf8", 6)):
        (store / f).write_bytes(b"x" * n)
    (store / "link").symlink_to(elsewhere / "deep" / "secret")
    (store / "a" / "dir-link").symlink_to(elsewhere)
    os.mkfifo(store / "a" / "fifo")
    b = LocalBackend(str(store), f"file://{store}")
    with b.walking(many=many) as listed:
        found = listed()
    assert [r.getMessage() for r in caplog.records] == ["left out of the store's listing: a/fifo: not a file, a directory or a symlink "
                                                        "(a fifo, a socket or a device node another tool made?): not shown, never read"]
    assert found == list(b.walk())
    assert sorted((e.path, e.size, e.is_dir) for e in found) == [
        ("a", 0, True), ("a/b", 0, True), ("a/b/c", 0, True), ("a/b/c/deep", 333, False), ("a/e", 0, True), ("a/e/.ckptfs", 4, False),
        ("a/one", 22, False), ("top", 1, False), ("z", 0, True), ("z/\udcff-not-utf8", 6, False)]


def test_a_walk_aside_that_fails_raises_as_the_walk_in_the_daemon_would(tmp_path):
    """The process listing a store aside says why it failed: the restart
    gets the error (and tries again, as for any store failure), not a
    listing cut short."""
    import errno

    from ckptfs.writeback import listing

    (tmp_path / "f").write_bytes(b"a file where a directory was opened")
    aside = listing.Aside("", os.open(tmp_path / "f", os.O_RDONLY | os.O_CLOEXEC), "")
    try:
        with pytest.raises(OSError) as got:
            aside.result(lambda path, why: None)
        assert got.value.errno == errno.ENOTDIR
    finally:
        aside.close()


def test_a_directory_of_the_store_the_daemon_cannot_read_is_left_out_with_a_warning():
    """A daemon run by a user who cannot list one directory of a local store
    shows the rest of the store; that directory is named in a warning."""
    import shutil
    import subprocess
    import sys
    import tempfile

    root = tempfile.mkdtemp(prefix="ckptfs-unreadable-")  # nobody must reach it: not under the test's 0700 tmp_path
    try:
        os.chmod(root, 0o755)
        for d, mode in (("a", 0o755), ("secret", 0o700), ("b", 0o755)):
            os.mkdir(os.path.join(root, d))
            with open(os.path.join(root, d, "f"), "wb") as f:
                f.write(b"x" * len(d))
            os.chmod(os.path.join(root, d, "f"), 0o644)
            os.chmod(os.path.join(root, d), mode)
        code = ("import logging; logging.basicConfig(); from ckptfs.writeback.localstore import LocalBackend; "
                f"print(sorted((e.path, e.size, e.is_dir) for e in LocalBackend({root!r}, 'file://' + {root!r}).walk()))")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=60, cwd="/")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str([("a", 0, True), ("a/f", 1, False), ("b", 0, True), ("b/f", 1, False)])
        assert "left out of the store's listing: secret: cannot list it (Permission denied)" in r.stderr
    finally:
        shutil.rmtree(root)


def test_no_store_call_reaches_above_the_store_root(tmp_path):
    """`verify STORE ../..` walked and reported the store's parent's parent
    (openat2 refuses `..` beneath the root, and the walk by components
    that redoes what it refuses followed it). No path given to a store
    may hold `.` or `..`: every call refuses it (EINVAL), whatever the
    caller."""
    import errno

    from ckptfs.writeback.localstore import LocalBackend

    (tmp_path / "outside").write_bytes(b"not the store's")
    store = tmp_path / "a" / "store"
    store.mkdir(parents=True)
    (store / "f").write_bytes(b"the store's")
    b = LocalBackend(str(store), f"file://{store}")
    for call in (lambda: list(b.walk("../..")), lambda: b.find(".."), lambda: b.read_all("../../outside"),
                 lambda: b.exists("./f"), lambda: b.put("../escaped", b"x"), lambda: b.delete("../../outside"),
                 lambda: list(b.read_many(["../../outside"]))):
        with pytest.raises(OSError) as got:
            call()
        assert got.value.errno == errno.EINVAL
    assert (tmp_path / "outside").read_bytes() == b"not the store's" and not (tmp_path / "a" / "escaped").exists()
    assert b.read_all("f") == b"the store's"
    assert run_cli("verify", str(store), "../..").returncode == 2


def test_what_is_planted_in_the_way_of_a_file_parks_it_and_leaves_no_record_of_it(tmp_path):
    """A directory made in the store where the mount has a file, or a file
    where it has a directory: publishing there fails until someone moves
    them (ENOTEMPTY, ENOTDIR). Those files used to be retried for ever, every
    file after them held back (C3) and nothing else published. They are
    parked, and the files after them go on. A try writes a file's record
    before its bytes: at a clean exit the records of parked files the store
    never showed go (verify called them missing, the next mount warned of a
    loss), and so do those of parked files deleted in the mount since (their
    removal waits behind the parked files, C3)."""
    from ckptfs.writeback.backend import open_store
    from ckptfs.writeback.verify import verify

    store = tmp_path / "store"
    m = start_mount(tmp_path)
    m.allowed_log_errors += ["failed (try", "failed for good", "NOT PUBLISHED", "not published", "cannot be applied"]
    try:
        (m.mountpoint / "solo").mkdir()
        (store / "solo" / "g" / "x").mkdir(parents=True)
        (m.mountpoint / "solo" / "g").write_bytes(b"parked, then deleted")
        deadline = time.monotonic() + 60
        while "failed for good" not in m.log_text():
            assert time.monotonic() < deadline, m.log_text()[-3000:]
            time.sleep(0.1)
        (m.mountpoint / "solo" / "g").unlink()
        assert run_cli("flush", str(m.mountpoint)).returncode == 0
        assert [p for p in verify(open_store(str(store))).missing] == []
        (store / "conflict" / "sub").mkdir(parents=True)
        (store / "d2").write_bytes(b"planted")
        (m.mountpoint / "conflict").write_bytes(b"a")
        (m.mountpoint / "d2").mkdir()
        (m.mountpoint / "d2" / "f").write_bytes(b"c")
        (m.mountpoint / "gone").mkdir()
        (store / "gone" / "g").mkdir(parents=True)
        (store / "gone" / "g" / "x").write_bytes(b"planted")
        (m.mountpoint / "gone" / "g").write_bytes(b"deleted while parked")
        (m.mountpoint / "after").write_bytes(b"b")
        deadline = time.monotonic() + 60
        while not (store / "after").exists() or m.log_text().count("failed for good") < 4:
            assert time.monotonic() < deadline, m.log_text()[-3000:]
            time.sleep(0.1)
        (m.mountpoint / "gone" / "g").unlink()
        r = run_cli("umount", str(m.mountpoint))
        assert r.returncode == 1 and "conflict" in r.stderr and "d2/f" in r.stderr and "gone/g (remove not applied)" in r.stderr, r.stderr
    finally:
        stop_mount(m)
    backend = open_store(str(store))
    report = verify(backend)
    assert (report.missing, sorted(report.extra), report.corrupt) == ([], ["d2", "gone/g/x"], []), report
    # a file in the way is, for anything but a publication, nothing there (as any ENOTDIR)
    assert not backend.exists("d2/f")
    backend.delete("d2/f")
    assert (store / "after").read_bytes() == b"b" and (store / "d2").read_bytes() == b"planted"


def test_a_record_object_holding_garbage_or_another_paths_record_fails_only_its_file(tmp_path):
    """A record object whose bytes are not the record of the path its name
    is made from (garbage; another file's record; a record of a path with
    `..` in it, copied or planted there) is that file's record unreadable:
    its loads fail, `verify` reports it and goes on to the rest (it stopped
    at the `..` path: "the store failed while it was verified")."""
    from ckptfs.writeback import manifest, storeio
    from ckptfs.writeback.backend import open_store

    root = tmp_path / "store"
    store = open_store(str(root))
    for name in ("garbage.bin", "other.bin", "dots.bin", "fine.bin"):
        storeio.write_file(store, name, name.encode() * 1000)

    def slot(path: str):
        return root / manifest.record_path(path)

    slot("garbage.bin").write_bytes(b'{"kind": "file", "path": ')
    slot("other.bin").write_bytes(slot("fine.bin").read_bytes())
    planted = manifest.read(store, "dots.bin")._replace(path="../../etc/passwd")
    slot("dots.bin").write_bytes(planted.encode())

    r = run_cli("verify", str(root))
    assert r.returncode == 8, (r.stdout, r.stderr)  # corrupt files found
    assert "Traceback" not in r.stderr and "failed while it was verified" not in r.stderr, r.stderr
    for name in ("garbage.bin", "other.bin", "dots.bin"):
        assert f"{name}: its record cannot be read" in r.stdout, r.stdout
    assert "1 ok, 3 corrupt, 0 missing, 0 extra" in r.stdout, r.stdout

    m = start_mount(tmp_path)
    try:
        m.allowed_log_errors += ["cannot load"]
        assert sorted(os.listdir(m.mountpoint)) == ["dots.bin", "fine.bin", "garbage.bin", "other.bin"]
        assert (m.mountpoint / "fine.bin").read_bytes() == b"fine.bin" * 1000
        for name in ("garbage.bin", "other.bin", "dots.bin"):
            with pytest.raises(OSError) as failed:
                (m.mountpoint / name).read_bytes()
            assert failed.value.errno == errno.EIO, name
            assert f"cannot load {name} from the store: its record in the store cannot be read" in m.log_text()
    finally:
        stop_mount(m)
