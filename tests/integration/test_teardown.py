"""The test harness's teardown works whatever state the daemon is in."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from tests.mountutil import is_mounted, start_mount, stop_mount


def _assert_gone(m) -> None:
    assert not is_mounted(m.mountpoint)
    assert m.proc.poll() is not None
    assert os.listdir(m.mountpoint) == []  # the bare directory again


def test_teardown_of_a_healthy_daemon(tmp_path):
    m = start_mount(tmp_path)
    m.path("f").write_bytes(b"x")
    stop_mount(m)
    _assert_gone(m)


def test_sigterm_after_an_external_unmount_drains_and_exits_cleanly(tmp_path):
    """`fusermount3 -u` first, SIGTERM right after (what stop_mount and many
    job schedulers do): the daemon must not touch the closed FUSE session
    (pyfuse3.terminate() on it crashed the daemon with SIGSEGV, mid-drain)."""
    m = start_mount(tmp_path)
    try:
        m.path("f").write_bytes(b"x" * 1000)
        subprocess.run(["fusermount3", "-u", "-z", str(m.mountpoint)], check=True)
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(timeout=60) == 0
        assert (m.store / "f").read_bytes() == b"x" * 1000
    finally:
        stop_mount(m)


def test_sigterm_while_requests_stream_in_ends_every_worker_of_the_fuse_loop(tmp_path):
    """The daemon's own wait for FUSE requests (daemon/fuseloop.py) is in
    use, and a SIGTERM while threads keep the mount busy ends pyfuse3's loop
    (every worker task: those parked for their turn, the one on the device,
    the ones handling a request), then drains and exits 0."""
    import threading

    m = start_mount(tmp_path)
    m.path("keep").write_bytes(b"k" * 100)
    stop = threading.Event()
    errors = []

    def busy(k: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                m.path(f"f{k}.{i % 50}").write_bytes(b"y" * 100)
                os.stat(m.path(f"f{k}.{i % 50}"))
            except OSError as exc:  # (the mount goes away under it)
                errors.append(exc.errno)
                return
            i += 1

    threads = [threading.Thread(target=busy, args=(k,)) for k in range(8)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        assert "read without waiting on the event loop" in m.log_text()
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(timeout=60) == 0
    finally:
        stop.set()
        stop_mount(m)  # first: a thread in a request of a hung mount returns only once it is gone
        for t in threads:
            t.join(timeout=30)
    assert (m.store / "keep").read_bytes() == b"k" * 100
    # Each thread may have been between a file's open (O_TRUNC) and its write
    # when the signal came: that file is sealed as it was (empty) and
    # published; every other one holds what was written.
    stored = {p.name: p.read_bytes() for p in m.store.glob("f*.*")}
    assert len(stored) >= 8
    assert set(stored.values()) <= {b"", b"y" * 100}
    cut_short = [name.split(".")[0] for name, v in stored.items() if v == b""]
    assert len(cut_short) == len(set(cut_short))  # one file per thread at most


async def test_a_mount_unmounted_before_it_was_live_is_not_a_crash(tmp_path):
    """The daemon checks that its mount answers (a `stat` in a child) before
    it tunes it and reports it live; an unmount just then (`fusermount3 -u`
    as soon as the mount appears) made that check raise, and the daemon died
    with a traceback instead of draining."""
    from ckptfs.daemon.mount import _when_live

    live = []
    await _when_live(str(tmp_path / "gone"), lambda: live.append(True))
    assert live == []


def test_teardown_when_the_daemon_hangs(tmp_path):
    m = start_mount(tmp_path)
    os.kill(m.pid, signal.SIGSTOP)  # any access to the mount would now block
    t0 = time.monotonic()
    stop_mount(m)
    assert time.monotonic() - t0 < 60
    _assert_gone(m)


def test_teardown_when_the_daemon_died(tmp_path):
    m = start_mount(tmp_path)
    os.kill(m.pid, signal.SIGKILL)
    m.proc.wait()
    assert is_mounted(m.mountpoint)  # a dead mount entry is left behind
    stop_mount(m)
    _assert_gone(m)


def test_teardown_when_the_daemon_ignores_sigterm(tmp_path):
    m = start_mount(tmp_path)
    os.kill(m.pid, signal.SIGSTOP)  # SIGTERM stays pending: only SIGKILL works
    stop_mount(m)
    assert m.proc.returncode == -signal.SIGKILL
    _assert_gone(m)


def test_teardown_while_this_process_holds_a_file_of_a_frozen_daemon_open(tmp_path):
    """A hung daemon, and a file of its mount open in the test process (a
    test thread stuck on it): teardown still ends. Unmounting by running
    `fusermount3` forked a child that closed its copy of that descriptor
    before its exec, a FLUSH to the frozen daemon that the kernel waits on
    even past SIGKILL: the child, and the test run, hung for good."""
    import threading

    m = start_mount(tmp_path)
    fd = os.open(m.path("held"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.kill(m.proc.pid, signal.SIGSTOP)  # frozen: every request to it waits
    stopper = threading.Thread(target=stop_mount, args=(m,), daemon=True)
    try:
        stopper.start()
        stopper.join(60)
        assert not stopper.is_alive(), "teardown hung"
        _assert_gone(m)
    finally:
        if m.proc.poll() is None:
            m.proc.kill()
        with contextlib.suppress(OSError):
            os.close(fd)  # (the connection is gone: the FLUSH fails at once)
