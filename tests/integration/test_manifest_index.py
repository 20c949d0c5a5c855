"""The manifest index: a daemon that exits cleanly leaves every record in one
object, and the next mount reads it instead of one record per file. It must
never stand in for records that changed after it was written."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from ckptfs.writeback import manifest, storeio
from ckptfs.writeback.backend import IMAGE, open_store
from ckptfs.writeback.engine import IMAGE_EVERY

from tests.mountutil import run_cli, start_mount, stop_mount
from tests.storeutil import image_in, verify_store, wait_until


def _session(tmp_path, body, clean: bool = True):
    """One mount over tmp_path's store: `body(mount)`, then a clean unmount
    (or, if not `clean`, kill -9 of the daemon once `body` returns)."""
    m = start_mount(tmp_path)
    try:
        body(m)
        if clean:
            r = run_cli("umount", str(m.mountpoint), timeout=120)
            assert r.returncode == 0, r.stderr
        else:
            os.kill(m.pid, signal.SIGKILL)
            m.proc.wait(timeout=30)
    finally:
        stop_mount(m)
    return m


def _flush(m) -> None:
    r = run_cli("flush", str(m.mountpoint), timeout=120)
    assert r.returncode == 0, r.stderr


def _records(store) -> list:
    return sorted((store / manifest.PREFIX).rglob("*.json"))


def test_a_clean_exit_leaves_the_index_and_the_next_mount_reads_it(tmp_path):
    """Every record object is garbled after a clean exit: the next mount
    still shows and verifies every file, so it read the index, not them;
    nor does a read of a file whose bytes match the index's record."""

    def write(m):
        m.path("ck").mkdir()
        for i in range(20):
            m.path("ck", f"f{i}").write_bytes(bytes([i]) * (1000 + i))
        os.chmod(m.path("ck", "f3"), 0o600)

    m = _session(tmp_path, write)
    assert (m.store / manifest.INDEX).is_file()
    for rec in _records(m.store):
        rec.write_bytes(b"garbled")
    again = start_mount(tmp_path)
    try:
        assert sorted(os.listdir(again.path("ck"))) == sorted(f"f{i}" for i in range(20))
        assert all(again.path("ck", f"f{i}").read_bytes() == bytes([i]) * (1000 + i) for i in range(20))
        assert again.path("ck", "f3").stat().st_mode & 0o777 == 0o600
        assert "cannot be verified" not in again.log_text()
        # the bytes matched the index's records: a read waited for no record object (it used to read each
        # file's again before its first byte, and warned here that it could not)
        assert "cannot read the record" not in again.log_text()
        assert not (again.store / manifest.INDEX).exists()  # claimed: records change from now on
    finally:
        stop_mount(again)


def test_a_store_whose_index_is_big_is_listed_aside_and_scanned_the_same(tmp_path, monkeypatch):
    """A restart over a store whose index holds many records lists the
    store in a process of its own while it decodes them (`listing.Aside`):
    what it finds is what the listing in the daemon finds."""
    from ckptfs.writeback import listing

    def write(m):
        for d in ("ck/a", "ck/b/c", "empty"):
            m.path(*d.split("/")).mkdir(parents=True)
        for i in range(30):
            m.path("ck", "abc"[i % 3] if i % 3 < 2 else "b/c", f"f{i}").write_bytes(bytes([i]) * (10 + i))
        os.symlink("a/f0", m.path("ck", "latest"))

    m = _session(tmp_path, write)
    backend = open_store(str(m.store), None)
    in_daemon = storeio.scan(backend)
    started = []
    real = listing.Aside.__init__

    def counted(self, *args):
        started.append(args)
        real(self, *args)

    monkeypatch.setattr(listing.Aside, "__init__", counted)
    monkeypatch.setattr(storeio, "MANY_PACKED", 0)
    aside = storeio.scan(backend)
    assert len(started) == 1
    assert aside.entries == in_daemon.entries and len(aside.entries) == 30 + 5
    assert aside.records == in_daemon.records and aside.indexed


def test_changes_of_a_session_reach_the_index_it_leaves(tmp_path):
    """Rewritten, deleted and re-moded files: the index the second session
    leaves has their records as they are now (a stale one would fail the
    rewritten file's verification: EIO)."""

    def first(m):
        for name in ("a", "b", "c"):
            m.path(name).write_bytes(name.encode() * 5000)

    def second(m):
        assert m.path("a").read_bytes() == b"a" * 5000
        m.path("a").write_bytes(b"A" * 7000)
        m.path("b").unlink()
        os.chmod(m.path("c"), 0o640)
        m.path("d").write_bytes(b"d" * 100)

    _session(tmp_path, first)
    m = _session(tmp_path, second)
    assert verify_store(m.store).clean
    third = start_mount(tmp_path)
    try:
        assert sorted(os.listdir(third.mountpoint)) == ["a", "c", "d"]
        assert third.path("a").read_bytes() == b"A" * 7000
        assert third.path("c").stat().st_mode & 0o777 == 0o640
        assert third.path("d").read_bytes() == b"d" * 100
    finally:
        stop_mount(third)


def test_after_a_crash_the_index_of_an_earlier_exit_is_not_used(tmp_path):
    """A clean exit leaves an index; the next daemon rewrites a file,
    publishes it and is killed: the mount after it reads every record (a
    stale index would fail the rewritten file's verification: EIO)."""

    def first(m):
        m.path("a").write_bytes(b"1" * 9000)

    def rewrite(m):
        m.path("a").write_bytes(b"2" * 9000)
        _flush(m)

    _session(tmp_path, first)
    m = _session(tmp_path, rewrite, clean=False)
    assert not (m.store / manifest.INDEX).exists()
    again = start_mount(tmp_path)
    again.allowed_log_errors.append("heartbeat")
    try:
        assert again.path("a").read_bytes() == b"2" * 9000
    finally:
        stop_mount(again)


def test_a_write_straight_to_the_store_makes_the_next_mount_read_every_record(tmp_path):
    """The torch helpers write straight to the store when the daemon cannot
    serve (C7). Done between two mounts, it changes a record the index holds:
    the next mount must not trust the index, and reads the new bytes,
    verified. The mark it left is cleared once every record was read."""

    def first(m):
        m.path("model.pt").write_bytes(b"old" * 3000)

    m = _session(tmp_path, first)
    assert (m.store / manifest.INDEX).is_file()
    storeio.write_file(open_store(str(m.store)), "model.pt", b"new" * 4000)
    assert list((m.store / manifest.OUTSIDE).iterdir())
    again = start_mount(tmp_path)
    try:
        assert again.path("model.pt").read_bytes() == b"new" * 4000
        wait_until(lambda: not list((again.store / manifest.OUTSIDE).iterdir()), 10, "the mark to be cleared")
    finally:
        stop_mount(again)


@pytest.mark.parametrize("new", [b"new" * 4000, b"new" * 3000, b"old" * 3000 + b"new" * 4000 * 6000], ids=["resized", "same-size", "large"])
def test_a_stale_index_costs_a_lookup_not_a_false_eio(tmp_path, new):
    """A write straight to the store can race a mount's start (its mark
    read and cleared by that mount's claim before its record lands): the
    index then holds an old record. A load whose bytes do not match the
    index's record reads the record the store holds then, and loads again
    against it, so the new bytes read back, verified."""

    def first(m):
        m.path("model.pt").write_bytes(b"old" * 3000)

    m = _session(tmp_path, first)
    storeio.write_file(open_store(str(m.store)), "model.pt", new)
    for mark in (m.store / manifest.OUTSIDE).iterdir():
        mark.unlink()  # as if the claim had cleared it before the record was written
    again = start_mount(tmp_path)
    try:
        assert again.path("model.pt").read_bytes() == new
        wait_until(lambda: "verified" in again.log_text(), 10, "the load logged")  # the bytes are served before the load says so
        assert "ERROR" not in again.log_text()
    finally:
        stop_mount(again)


def test_an_index_short_of_a_record_restores_the_file_it_left_out_with_its_record(tmp_path):
    """A daemon could leave an index short of records (exiting while it
    saved its image; fixed since), and every clean exit after kept it so:
    a restart showed such a file with no record, mode and time lost, and
    served its bytes unverified. On a local store the scan reads the
    records the index left out; the next exit's index has them again."""
    import errno

    def first(m):
        m.path("a.pt").write_bytes(b"a" * 5000)
        m.path("b.pt").write_bytes(b"b" * 5000)
        os.chmod(m.path("b.pt"), 0o600)
        os.utime(m.path("b.pt"), ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))

    m = _session(tmp_path, first)
    backend = open_store(str(m.store))
    index = image_in(backend)
    index.forget([manifest.record_path("b.pt")])
    backend.put(manifest.INDEX, index.packed())  # as the faulty exit left it: b's record object is there, its row is not
    (m.store / "b.pt").write_bytes(b"B" * 5000)  # and the store's copy went bad since

    def second(again):
        again.allowed_log_errors += ["b.pt"]
        st = again.path("b.pt").stat()
        assert (st.st_mode & 0o777, st.st_mtime_ns) == (0o600, 1_600_000_000_123_456_789)
        assert again.path("a.pt").read_bytes() == b"a" * 5000
        try:
            again.path("b.pt").read_bytes()
            raise AssertionError("damaged bytes were served")
        except OSError as exc:
            assert exc.errno == errno.EIO

    again = _session(tmp_path, second)
    assert manifest.record_path("b.pt") in image_in(open_store(str(again.store))).objects


def test_after_a_crash_the_next_mount_reads_only_the_records_changed_since_the_image(tmp_path):
    """A clean exit leaves the index; the next daemon's claim turns it into a
    manifest image, that daemon changes a few files and is killed: the mount after
    it reads only their records (the store's times tell which), and shows
    every change."""

    def first(m):
        # The first image (an empty store's scan has no time) before the files:
        # saved just after them, it would be the index, and they would be read again.
        wait_until(lambda: "saved the manifest image" in m.log_text(), 30, "the first image")
        m.path("ck").mkdir()
        for i in range(40):
            m.path("ck", f"f{i}").write_bytes(bytes([i]) * (1000 + i))
        _flush(m)
        time.sleep(manifest.CLOCK_MARGIN_S + 0.5)  # the records are older than the index, by more than the margin

    def change(m):
        m.path("ck", "f1").write_bytes(b"new" * 700)
        m.path("ck", "f2").unlink()
        os.chmod(m.path("ck", "f3"), 0o600)
        os.rename(m.path("ck", "f4"), m.path("ck", "g4"))
        _flush(m)

    _session(tmp_path, first)
    m = _session(tmp_path, change, clean=False)
    assert (m.store / IMAGE).is_file() and not (m.store / manifest.INDEX).exists()
    again = start_mount(tmp_path)
    again.allowed_log_errors.append("heartbeat")
    try:
        found = re.search(r"reading (\d+) of (\d+) records", again.log_text())
        assert found is not None and int(found[1]) <= 5 and int(found[2]) >= 40, found  # f1, f3, g4 and ck's record
        assert sorted(os.listdir(again.path("ck"))) == sorted({f"f{i}" for i in range(40)} - {"f2", "f4"} | {"g4"})
        assert again.path("ck", "f1").read_bytes() == b"new" * 700
        assert again.path("ck", "f3").stat().st_mode & 0o777 == 0o600
        assert again.path("ck", "g4").read_bytes() == bytes([4]) * 1004
        assert all(again.path("ck", f"f{i}").read_bytes() == bytes([i]) * (1000 + i) for i in range(5, 40))
        assert "cannot be verified" not in again.log_text() and "checksum mismatch" not in again.log_text()
    finally:
        stop_mount(again)


def test_a_running_daemon_saves_its_manifest_image_so_a_restart_after_a_crash_need_not_read_every_record(tmp_path):
    """No clean exit at all: the first daemon over an empty store writes
    more than IMAGE_EVERY files and is killed; it had saved its image,
    and the mount after it checks that against the store's times."""

    def write(m):
        for d in range(3):
            m.path(f"d{d}").mkdir()
            for i in range(IMAGE_EVERY // 2):
                fd = os.open(m.path(f"d{d}", f"f{i}"), os.O_WRONLY | os.O_CREAT, 0o644)
                os.write(fd, f"{d}/{i}".encode())
                os.close(fd)
        _flush(m)
        wait_until(lambda: "saved the manifest image" in m.log_text(), 30, "a save of the image")

    m = _session(tmp_path, write, clean=False)
    assert (m.store / IMAGE).is_file()
    again = start_mount(tmp_path)
    again.allowed_log_errors.append("heartbeat")
    try:
        assert re.search(r"reading \d+ of \d+ records: changed since the manifest image", again.log_text())
        for d in range(3):
            names = os.listdir(again.path(f"d{d}"))
            assert len(names) == IMAGE_EVERY // 2
        assert again.path("d2", "f7").read_bytes() == b"2/7"
        assert "cannot be verified" not in again.log_text()
    finally:
        stop_mount(again)
