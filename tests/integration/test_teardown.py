"""The test harness's teardown works whatever state the daemon is in."""

from __future__ import annotations

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
