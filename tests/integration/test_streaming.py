"""A file is staged while it is written (writeback/streaming.py), on a real
mount over a local store: the store gets its bytes before the close, and
publishes it whole, at its close, with the bytes it has then."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
from pathlib import Path

import pytest

from tests.mountutil import run_cli, start_mount, stop_mount
from tests.storeutil import store_files, verify_store, wait_until

MiB = 1 << 20


@pytest.fixture
def m(fresh_mount):
    return fresh_mount


def staged_bytes(store: Path) -> int:
    """Bytes in the store's staging area (uploads not visible yet)."""
    staging = store / ".ckptfs" / "staging"
    return sum(p.stat().st_size for p in staging.rglob("*") if p.is_file()) if staging.exists() else 0


def write_sequentially(f, data: bytes) -> None:
    view = memoryview(data)
    for off in range(0, len(view), MiB):
        f.write(view[off : off + MiB])
    f.flush()


def flush(m) -> None:
    r = run_cli("flush", str(m.mountpoint), timeout=300)
    assert r.returncode == 0, r.stderr


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_file_is_staged_while_it_is_written_and_published_whole_at_its_close(m):
    data = os.urandom(160 * MiB)
    with open(m.path("shard.bin"), "wb") as f:
        write_sequentially(f, data)
        # Still open: its bytes reach the store's staging area, and nothing is visible.
        wait_until(lambda: staged_bytes(m.store) >= 128 * MiB, timeout=60, what="the open file staged")
        assert not (m.store / "shard.bin").exists()
        f.write(b"the end")
    flush(m)
    assert digest((m.store / "shard.bin").read_bytes()) == digest(data + b"the end")
    assert verify_store(m.store).ok == ["shard.bin"]
    assert staged_bytes(m.store) == 0
    assert "staged while it was written" in m.log_text()
    r = run_cli("status", str(m.mountpoint), "--json")
    assert json.loads(r.stdout)["totals"]["counters"]["staged_while_written"] == 1


@pytest.mark.parametrize("change", ["rewrite the start", "truncate and write again", "truncate and extend"])
def test_a_change_below_what_was_staged_is_what_the_store_gets(m, change):
    data = bytearray(os.urandom(128 * MiB))
    fd = os.open(m.path("ckpt.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with os.fdopen(os.dup(fd), "wb", buffering=0) as f:
            write_sequentially(f, bytes(data))
        wait_until(lambda: staged_bytes(m.store) >= 96 * MiB, timeout=60, what="the open file staged")
        if change == "rewrite the start":
            os.pwrite(fd, b"header, written last", 0)  # as a format that fills in its header at the end
            data[:20] = b"header, written last"
        elif change == "truncate and write again":
            os.ftruncate(fd, 40 * MiB)
            del data[40 * MiB :]
            tail = os.urandom(80 * MiB)
            os.pwrite(fd, tail, 40 * MiB)
            data += tail
        else:  # no write below what was staged: the truncation alone must count
            os.ftruncate(fd, 40 * MiB)
            os.ftruncate(fd, 130 * MiB)
            data[40 * MiB :] = bytes(90 * MiB)
    finally:
        os.close(fd)
    flush(m)
    assert digest((m.store / "ckpt.bin").read_bytes()) == digest(bytes(data))
    assert verify_store(m.store).ok == ["ckpt.bin"]
    assert staged_bytes(m.store) == 0


def test_a_file_deleted_while_it_is_written_leaves_nothing_in_the_store(m):
    with open(m.path("doomed.bin"), "wb") as f:
        write_sequentially(f, os.urandom(96 * MiB))
        wait_until(lambda: staged_bytes(m.store) >= 64 * MiB, timeout=60, what="the open file staged")
        os.unlink(m.path("doomed.bin"))
        write_sequentially(f, os.urandom(32 * MiB))
    m.path("after.bin").write_bytes(b"next")
    flush(m)
    wait_until(lambda: staged_bytes(m.store) == 0, timeout=30, what="the staging removed")
    assert store_files(m.store) == {"after.bin": b"next"}


def test_kill9_while_a_file_is_staged_as_it_is_written_leaves_nothing_half_done(tmp_path):
    """A daemon killed while it stages a file still being written: the store
    shows only what was published before, whole and verified, and the next
    daemon clears the half-staged upload."""
    m = start_mount(tmp_path)
    try:
        m.path("done.bin").write_bytes(b"d" * 100_000)
        wait_until(lambda: (m.store / "done.bin").exists(), 30, "the first file published")
        f = open(m.path("open.bin"), "wb")
        write_sequentially(f, os.urandom(96 * MiB))
        wait_until(lambda: staged_bytes(m.store) >= 64 * MiB, timeout=60, what="the open file staged")
        os.kill(m.pid, signal.SIGKILL)
        m.proc.wait(timeout=30)
        with contextlib.suppress(OSError):  # the daemon is gone: ENOTCONN
            f.close()
    finally:
        stop_mount(m)
    assert store_files(m.store) == {"done.bin": b"d" * 100_000}
    report = verify_store(m.store)
    assert report.ok == ["done.bin"] and report.clean
    again = start_mount(tmp_path)
    try:
        assert os.listdir(again.mountpoint) == ["done.bin"]
        wait_until(lambda: staged_bytes(m.store) == 0, 30, "the dead daemon's staging cleared")
    finally:
        stop_mount(again)


def test_a_file_sized_first_then_filled_in_order_is_staged_while_it_is_written(m):
    """safetensors sizes a temporary file with ftruncate, fills it in order,
    then renames it into place."""
    data = os.urandom(128 * MiB)
    fd = os.open(m.path(".tmpXq3"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, len(data))
        with os.fdopen(os.dup(fd), "wb", buffering=0) as f:
            write_sequentially(f, data)
        wait_until(lambda: staged_bytes(m.store) >= 96 * MiB, timeout=60, what="the open file staged")
    finally:
        os.close(fd)
    os.rename(m.path(".tmpXq3"), m.path("model.safetensors"))
    flush(m)
    assert digest((m.store / "model.safetensors").read_bytes()) == digest(data)
    assert ".tmpXq3: staged while it was written" in m.log_text()
