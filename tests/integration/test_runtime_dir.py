"""The runtime directory (the daemon's details, log and control socket) is
used only when it is the user's own and private: a directory someone else
made first (in a shared /tmp) is refused, never written through."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckptfs import runtime
from tests.mountutil import is_mounted, lazy_unmount, run_cli, start_mount, stop_mount

NOBODY = 65534


def one_line_error(r: subprocess.CompletedProcess, code: int, word: str) -> None:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("ckptfs: error: ") and word in lines[0], lines[0]


@pytest.fixture
def dirs(tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("the victim's file\n")
    return mp, tmp_path / "store", tmp_path / "rt", victim


def mount_with(mp, store, rt) -> subprocess.CompletedProcess:
    return run_cli("mount", str(mp), "--store", str(store), "--memory-limit", "256M", env={**os.environ, "CKPTFS_RUNTIME_DIR": str(rt)})


def test_a_runtime_root_owned_by_someone_else_is_refused(dirs):
    mp, store, rt, _ = dirs
    rt.mkdir(mode=0o700)
    os.chown(rt, NOBODY, NOBODY)
    one_line_error(mount_with(mp, store, rt), 2, f"belongs to uid {NOBODY}")
    assert not is_mounted(mp) and os.listdir(rt) == []


def test_a_squatted_mount_directory_with_a_planted_log_is_refused(dirs):
    """/tmp/ckptfs-<uid>/<hash>/daemon.log -> a file of the victim's: the
    daemon would have appended to it."""
    mp, store, rt, victim = dirs
    rt.mkdir(mode=0o700)
    squat = rt / runtime.mount_dir(mp).name
    squat.mkdir(mode=0o777)
    (squat / "daemon.log").symlink_to(victim)
    os.chown(squat, NOBODY, NOBODY)
    one_line_error(mount_with(mp, store, rt), 2, "refusing")
    assert victim.read_text() == "the victim's file\n" and not is_mounted(mp)


def test_a_runtime_root_that_cannot_be_made_is_one_line(dirs):
    """CKPTFS_RUNTIME_DIR where this user cannot make it (here below a
    file; for a user, a directory of someone else's): a one-line error
    naming the fix, not a traceback."""
    mp, store, _, victim = dirs
    one_line_error(mount_with(mp, store, victim / "rt"), 2, "set CKPTFS_RUNTIME_DIR")
    assert not is_mounted(mp)


def test_a_runtime_root_others_can_write_is_refused(dirs):
    mp, store, rt, _ = dirs
    rt.mkdir()
    rt.chmod(0o777)
    one_line_error(mount_with(mp, store, rt), 2, "writable by others")
    assert not is_mounted(mp)


def test_an_own_runtime_root_readable_by_others_is_made_private(dirs):
    mp, store, rt, _ = dirs
    rt.mkdir()
    rt.chmod(0o755)  # as ckptfs before 0.1 made /run/ckptfs
    r = mount_with(mp, store, rt)
    try:
        assert r.returncode == 0, r.stderr
        assert rt.stat().st_mode & 0o777 == 0o700
    finally:
        run_cli("umount", str(mp), env={**os.environ, "CKPTFS_RUNTIME_DIR": str(rt)})
        if is_mounted(mp):
            lazy_unmount(mp)


def test_the_client_talks_only_to_a_socket_of_its_user(tmp_path):
    m = start_mount(tmp_path)
    try:
        sock = runtime.control_socket(m.mountpoint)
        os.chown(sock, NOBODY, NOBODY, follow_symlinks=False)
        one_line_error(run_cli("status", str(m.mountpoint)), 2, "not a socket of uid 0")
        os.chown(sock, 0, 0, follow_symlinks=False)
        assert run_cli("status", str(m.mountpoint)).returncode == 0
    finally:
        stop_mount(m)


def test_only_the_owner_can_unmount(tmp_path):
    m = start_mount(tmp_path)
    try:
        r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                            sys.executable, "-m", "ckptfs.tools.cli", "umount", str(m.mountpoint)],
                           capture_output=True, text=True, timeout=60, cwd="/", env={**os.environ, "CKPTFS_RUNTIME_DIR": "/nonexistent"})
        one_line_error(r, 2, "mounted by uid 0")
        assert is_mounted(m.mountpoint) and m.proc.poll() is None  # untouched
    finally:
        stop_mount(m)


def test_another_users_mount_is_named_as_such_and_fails_no_listing(tmp_path):
    """`ckptfs status` lists every ckptfs mount on the machine: another
    user's is shown as such ("mounted by uid 0"), not as unavailable, and
    does not make the listing fail (exit 3); asked for by name, it is a
    clear error. (It said "its daemon is not running (stale mount?)": a
    daemon running as another user keeps its details where this user's
    ckptfs does not look.)"""
    import json

    m = start_mount(tmp_path)
    try:
        def as_nobody(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                   sys.executable, "-m", "ckptfs.tools.cli", *args],
                                  capture_output=True, text=True, timeout=60, cwd="/", env={**os.environ, "CKPTFS_RUNTIME_DIR": "/nonexistent"})

        r = as_nobody("status", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        listed = {x["mount"]["mountpoint"]: x for x in json.loads(r.stdout)["mounts"]}
        assert listed[str(m.mountpoint)]["denied"] and "mounted by uid 0" in listed[str(m.mountpoint)]["error"], r.stdout
        assert all(x.get("denied") for x in listed.values()), r.stdout  # (every mount here is root's)
        r = as_nobody("status")
        assert r.returncode == 0 and f"{m.mountpoint}: another user's: " in r.stdout and "stale" not in r.stdout, r.stdout + r.stderr
        one_line_error(as_nobody("status", str(m.mountpoint)), 2, "mounted by uid 0")
    finally:
        stop_mount(m)
