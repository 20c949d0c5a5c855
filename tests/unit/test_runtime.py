"""What the tools find out about mounts without a daemon: paths resolved up
to a mount point."""

import os
import subprocess
import sys
import time

from ckptfs import runtime
from ckptfs.runtime import resolved_to_mount


def test_links_are_followed_up_to_a_mount_point_and_no_further(tmp_path):
    (tmp_path / "real" / "mnt").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "rel").symlink_to("link/mnt")
    (tmp_path / "real" / "mnt" / "inside").symlink_to("/elsewhere")  # under the mount point: the daemon's to follow
    mounts = [str(tmp_path / "real" / "mnt")]
    mp = str(tmp_path / "real" / "mnt")
    assert resolved_to_mount(tmp_path / "link" / "mnt", mounts) == mp
    assert resolved_to_mount(f"{tmp_path}/link/mnt/", mounts) == mp
    assert resolved_to_mount(tmp_path / "rel" / "a" / "b", mounts) == f"{mp}/a/b"
    assert resolved_to_mount(tmp_path / "link" / "mnt" / "inside" / "x", mounts) == f"{mp}/inside/x"
    assert resolved_to_mount(tmp_path / "link" / "none", mounts) == str(tmp_path / "real" / "none")  # not there: as it is
    assert resolved_to_mount(tmp_path / "link" / "mnt", []) == mp  # no mount: every link followed


def test_a_loop_of_links_gives_the_path_as_it_was(tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    assert resolved_to_mount(tmp_path / "a" / "x", []) == os.path.join(tmp_path, "a", "x")


def test_a_process_whose_main_thread_exited_while_another_still_runs_is_alive():
    """`ckptfs umount` waits until the daemon is gone: its main thread is a
    zombie as soon as it has exited, while another thread may still be
    exiting, holding the mount point's lock (an immediate `ckptfs mount`
    was refused: "another ckptfs daemon ... one daemon per mount point")."""
    script = ("import ctypes, sys, threading, time\n"
              "threading.Thread(target=lambda: (print('up', flush=True), sys.stdin.read())).start()\n"
              "ctypes.CDLL(None).pthread_exit(None)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"up\n"
        deadline = time.monotonic() + 20
        while _state(proc.pid) != "Z":  # the main thread is gone
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert runtime.pid_alive(proc.pid)
        proc.stdin.close()  # the other thread ends, and with it the process
        proc.wait(timeout=20)
        assert not runtime.pid_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
