"""Every user mistake gets one clear line: `ckptfs: error: ...` on stderr, an
exit status that says what kind of failure it was, and no traceback; and
nothing is created or mounted on the way. Plus the mistakes that need a
running daemon or a special mount point to make."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ckptfs.writeback.backend import META

from ckptfs import runtime
from ckptfs.client import Client, RequestFailed
from tests.mountutil import is_mounted, lazy_unmount, run_cli, start_mount, stop_background_mount, stop_mount
from tests.storeutil import begin_outage, end_outage, store_outage

# (name, argv with {placeholders}, extra environment, exit status, a word the one stderr line must hold)
CASES = [
    ("mount without arguments", ["mount"], {}, 2, "MOUNTPOINT"),
    ("mount without --store", ["mount", "{mp}"], {}, 2, "--store"),
    ("unknown option", ["mount", "{mp}", "--store", "{store}", "--bogus"], {}, 2, "--bogus"),
    ("unknown command", ["nosuch"], {}, 2, "nosuch"),
    ("store option: value then a key under it", ["mount", "{mp}", "--store", "{store}", "--store-option", "a=1", "--store-option", "a.b=2"],
     {}, 2, "conflicts"),
    ("store option: keys then a value over them", ["mount", "{mp}", "--store", "{store}", "--store-option", "a.b=2", "--store-option", "a=1"],
     {}, 2, "conflicts"),
    ("store option without =", ["mount", "{mp}", "--store", "{store}", "--store-option", "novalue"], {}, 2, "KEY=VALUE"),
    ("store option with an empty key part", ["mount", "{mp}", "--store", "{store}", "--store-option", "a..b=1"], {}, 2, "KEY=VALUE"),
    ("bad JSON in CKPTFS_STORE_OPTIONS", ["mount", "{mp}", "--store", "{store}"], {"CKPTFS_STORE_OPTIONS": "{bad"}, 2,
     "CKPTFS_STORE_OPTIONS"),
    ("CKPTFS_STORE_OPTIONS not an object", ["mount", "{mp}", "--store", "{store}"], {"CKPTFS_STORE_OPTIONS": "[1]"}, 2,
     "CKPTFS_STORE_OPTIONS"),
    ("log file in a missing directory", ["mount", "{mp}", "--store", "{store}", "--log-file", "{tmp}/nope/daemon.log"], {}, 2, "--log-file"),
    ("log file where nothing can be written", ["mount", "{mp}", "--store", "{store}", "--log-file", "/proc/ckptfs.log"], {}, 2, "--log-file"),
    ("log file in the mount point", ["mount", "{mp}", "--store", "{store}", "--log-file", "{mp}/daemon.log"], {}, 2, "inside the mount point"),
    ("log file in the store", ["mount", "{mp}", "--store", "{store}", "--log-file", "{store}/daemon.log"], {}, 2, "inside the store"),
    ("log file in the foreground too", ["mount", "{mp}", "--store", "{store}", "-f", "--log-file", "{tmp}/nope/daemon.log"], {}, 2,
     "--log-file"),
    ("memory limit of 107 bytes", ["mount", "{mp}", "--store", "{store}", "--memory-limit", "0.0000001G"], {}, 2, "--memory-limit"),
    ("reuse-ram that is no size", ["mount", "{mp}", "--store", "{store}", "--reuse-ram", "lots"], {}, 2, "--reuse-ram"),
    ("reuse-ram of 120 percent", ["mount", "{mp}", "--store", "{store}", "--reuse-ram", "120%"], {}, 2, "--reuse-ram"),
    ("negative drain timeout", ["mount", "{mp}", "--store", "{store}", "--drain-timeout", "-5"], {}, 2, "--drain-timeout"),
    ("drain timeout nan", ["mount", "{mp}", "--store", "{store}", "--drain-timeout", "nan"], {}, 2, "--drain-timeout"),
    ("store timeout 0", ["mount", "{mp}", "--store", "{store}", "--store-timeout", "0"], {}, 2, "--store-timeout"),
    ("marker that is a path", ["mount", "{mp}", "--store", "{store}", "--marker", "ckpt/done"], {}, 2, "not a file's name"),
    ("marker that is empty", ["mount", "{mp}", "--store", "{store}", "--marker", ""], {}, 2, "--marker"),
    ("store is the mount point", ["mount", "{mp}", "--store", "{mp}"], {}, 2, "inside the mount point"),
    ("store under the mount point", ["mount", "{mp}", "--store", "{mp}/store"], {}, 2, "inside the mount point"),
    ("store under the mount point, as a URL", ["mount", "{mp}", "--store", "file://{mp}/store"], {}, 2, "inside the mount point"),
    ("store reached through a symlink into the mount point", ["mount", "{mp}", "--store", "{tmp}/link/store"], {}, 2,
     "inside the mount point"),
    ("mount point inside the store", ["mount", "{tmp}/outer/mnt", "--store", "{tmp}/outer"], {}, 2, "inside the store"),
    ("store inside another ckptfs mount", ["mount", "{mp}", "--store", "{ckptfs}/store"], {}, 2, "ckptfs mount"),
    ("spill directory inside the mount point", ["mount", "{mp}", "--store", "{store}", "--spill-dir", "{mp}"], {}, 2, "inside the mount"),
    ("s3 URL without a bucket", ["mount", "{mp}", "--store", "s3://"], {}, 2, "bucket"),
    ("a store in the daemon's own memory", ["mount", "{mp}", "--store", "memory://ckpt"], {}, 2, "durable storage"),
    ("a Redis password in the cluster URL", ["mount", "{mp}", "--store", "{store}", "--cluster", "redis://:hunter2@127.0.0.1:1/0"], {}, 2,
     "CKPTFS_REDIS_PASSWORD"),
    ("a Redis user and password in the cluster URL", ["mount", "{mp}", "--store", "{store}", "--cluster", "rediss://default:hunter2@h:6380/0"],
     {}, 2, "password"),
    ("a cluster node's name without --cluster", ["mount", "{mp}", "--store", "{store}", "--node", "a"], {}, 2, "--node is for cluster mode"),
    ("cluster options without --cluster", ["mount", "{mp}", "--store", "{store}", "--cluster-patience", "10", "--cluster-snapshot-every", "5",
                                           "--cluster-password-file", "{tmp}/pw"], {}, 2,
     "--cluster-password-file, --cluster-patience, --cluster-snapshot-every are for cluster mode"),
    ("status --timeout zero", ["status", "--timeout", "0"], {}, 2, "--timeout"),
    ("status --interval negative", ["status", "--watch", "--interval", "-1"], {}, 2, "--interval"),
    ("status --interval nan", ["status", "--watch", "--interval", "nan"], {}, 2, "--interval"),
    ("flush --timeout negative", ["flush", "{ckptfs}", "--timeout", "-1"], {}, 2, "--timeout"),
    ("flush --timeout nan", ["flush", "{ckptfs}", "--timeout", "nan"], {}, 2, "--timeout"),
    ("advise: save time that overflows", ["advise", "--save-seconds", "1e308", "--mtbf-hours", "1"], {}, 2, "--save-seconds"),
    ("advise: an MTBF of nothing", ["advise", "--save-seconds", "10", "--mtbf-hours", "1e-300"], {}, 2, "--mtbf-hours"),
    ("advise: nan", ["advise", "--save-seconds", "nan", "--mtbf-hours", "1"], {}, 2, "--save-seconds"),
    ("advise: inf", ["advise", "--save-seconds", "10", "--mtbf-hours", "inf"], {}, 2, "--mtbf-hours"),
    ("advise: restart time nan", ["advise", "--save-seconds", "10", "--mtbf-hours", "1", "--restart-seconds", "nan"], {}, 2,
     "--restart-seconds"),
    ("store that is a dangling symlink", ["mount", "{mp}", "--store", "{tmp}/dangling"], {}, 2, "which does not exist"),
    ("verify a store that does not exist", ["verify", "{tmp}/nostore"], {}, 2, "does not exist"),
    ("verify a directory that is no store", ["verify", "{mp}"], {}, 2, "not a ckptfs store"),
    ("verify a path that is not there", ["verify", "{ckptfs}", "no/such/path"], {}, 2, "no such"),
    ("verify a path above the store", ["verify", "{ckptfs}", "../.."], {}, 2, "cannot go up"),
    ("verify a path that goes up inside it", ["verify", "{ckptfs}", "a/./../b"], {}, 2, "cannot go up"),
    ("umount of a directory that is no mount", ["umount", "{mp}"], {}, 2, "not a ckptfs mount"),
]


@pytest.fixture
def places(tmp_path: Path, shared_mount) -> dict[str, str]:
    mp = tmp_path / "mnt"
    mp.mkdir()
    (tmp_path / "outer" / "mnt").mkdir(parents=True)
    (tmp_path / "link").symlink_to(mp)
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    return {"mp": str(mp), "store": str(tmp_path / "store"), "tmp": str(tmp_path), "ckptfs": str(shared_mount.mountpoint)}


def assert_one_line(r: subprocess.CompletedProcess, code: int, word: str) -> None:
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ckptfs: error: "), lines[0]
    assert word in lines[0], lines[0]
    assert r.returncode == code, (r.returncode, r.stderr)


@pytest.mark.parametrize(("argv", "env", "code", "word"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line(places, argv, env, code, word):
    before = sorted(os.listdir(places["tmp"]))
    try:
        r = run_cli(*(a.format(**places) for a in argv), env={**os.environ, **env} if env else None, timeout=60)
        assert_one_line(r, code, word)
        assert not is_mounted(places["mp"]) and os.listdir(places["mp"]) == []
        assert sorted(os.listdir(places["tmp"])) == before  # no store, log or mount point was created
    finally:  # a mistake that was accepted mounted something: stop it
        for mp in (Path(places["mp"]), Path(places["tmp"], "outer", "mnt")):
            _cleanup_background(mp)


EMPTY = [
    ["mount", "", "--store", "{store}"],
    ["mount", "{mp}", "--store", ""],
    ["mount", "{mp}", "--store", "file://"],
    ["mount", "{mp}", "--store", "{store}", "--spill-dir", ""],
    ["mount", "{mp}", "--store", "{store}", "--log-file", ""],
    ["umount", ""],
    ["status", ""],
    ["flush", ""],
    ["prefetch", ""],
    ["evict", ""],
    ["verify", ""],
    ["verify", "file://"],
]


@pytest.mark.parametrize("argv", EMPTY, ids=[" ".join(a or "''" for a in argv) for argv in EMPTY])
def test_an_empty_path_or_store_is_refused_not_taken_for_the_current_directory(tmp_path, argv):
    """What `"$MNT"` or `"$STORE"` gives when the variable is unset: the
    current directory would become a store (its files shown in the mount,
    and the mount's written into it) or a mount point."""
    cwd, mp = tmp_path / "cwd", tmp_path / "mnt"
    cwd.mkdir()
    mp.mkdir()
    (cwd / "notes.txt").write_text("the user's own file\n")
    try:
        r = run_cli(*(a.format(mp=mp, store=tmp_path / "store") for a in argv), cwd=cwd, timeout=60)
        assert_one_line(r, 2, "unset shell variable" if "file://" not in argv else "names no directory")
        assert sorted(os.listdir(cwd)) == ["notes.txt"] and not is_mounted(cwd)
        assert sorted(os.listdir(tmp_path)) == ["cwd", "mnt"] and not is_mounted(mp)
    finally:
        for where in (cwd, mp):
            _cleanup_background(where)


SHORT_URLS = [("s3:/bucket", "s3://bucket"), ("s3:bucket/ckpt", "s3://bucket/ckpt"), ("gs:/b", "gs://b"), ("file:/x/y", "file:///x/y")]


@pytest.mark.parametrize("command", ["mount", "verify"])
@pytest.mark.parametrize(("url", "meant"), SHORT_URLS, ids=[u for u, _ in SHORT_URLS])
def test_a_store_url_with_a_slash_missing_is_refused_not_made_a_directory_here(tmp_path, command, url, meant):
    """`--store s3:/bucket` (one slash) was a plain path: the mount made a
    directory `s3:` in the current one and put every checkpoint there,
    with nothing said. A local directory of that name that is there
    already is still one (`./s3:/bucket` makes a new one)."""
    cwd, mp = tmp_path / "cwd", tmp_path / "mnt"
    cwd.mkdir()
    mp.mkdir()
    argv = ["mount", str(mp), "--store", url] if command == "mount" else ["verify", url]
    try:
        r = run_cli(*argv, cwd=cwd, timeout=60)
        assert_one_line(r, 2, f"slash missing: write {meant} ")
        assert os.listdir(cwd) == [] and not is_mounted(mp)
        (cwd / url).mkdir(parents=True)  # there already: the user's own directory
        (cwd / url / META).mkdir()
        if command == "verify":
            r = run_cli(*argv, cwd=cwd, timeout=60)
            assert r.returncode == 0 and "0 ok" in r.stdout, r.stderr
        else:
            r = run_cli(*argv, cwd=cwd, timeout=60)
            assert r.returncode == 0 and is_mounted(mp), r.stderr
            (mp / "f").write_bytes(b"x")
            assert run_cli("umount", str(mp), timeout=120).returncode == 0
            assert (cwd / url / "f").read_bytes() == b"x"
    finally:
        _cleanup_background(mp)


def test_a_spill_directory_that_cannot_hold_files_is_refused_at_mount(tmp_path):
    """--spill-dir on a read-only file system (a container's /var/tmp is
    often one) was accepted: the first save larger than the RAM budget then
    failed with EROFS, mid-training. It is refused at mount."""
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(ro), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        (tmp_path / "mnt").mkdir()
        r = run_cli("mount", str(tmp_path / "mnt"), "--store", str(tmp_path / "store"), "--spill-dir", str(ro))
        assert r.returncode == 2 and "cannot hold files (Read-only file system)" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not is_mounted(tmp_path / "mnt")
    finally:
        stop_background_mount(tmp_path / "mnt")  # had the mount not been refused
        subprocess.run(["umount", str(ro)], check=True)


def test_a_default_spill_directory_that_cannot_hold_files_is_warned_of(tmp_path):
    """The default, /var/tmp, read-only (here in a private mount namespace,
    as in a container with a read-only root): the mount goes on, and says
    on stderr and in its log that a save larger than the budget would fail."""
    ro, mp = tmp_path / "ro", tmp_path / "mnt"
    ro.mkdir()
    mp.mkdir()
    log = tmp_path / "daemon.log"
    script = (f"mount --make-rprivate / && mount --bind {ro} /var/tmp && mount -o remount,bind,ro /var/tmp && "
              f"{sys.executable} -m ckptfs.tools.cli mount {mp} --store {tmp_path / 'store'} --log-file {log} && "
              f"{sys.executable} -m ckptfs.tools.cli umount {mp}")
    r = subprocess.run(["unshare", "-m", "bash", "-c", script], capture_output=True, text=True, timeout=120)
    try:
        assert r.returncode == 0, r.stderr
        warning = "the spill directory /var/tmp: it cannot hold files (Read-only file system)"
        assert warning in r.stderr and "--spill-dir" in r.stderr and warning in log.read_text()
    finally:
        for pid in re.findall(r"pid (\d+)", r.stdout):  # the daemon lives in that namespace: stopped by pid if umount failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_a_store_inside_another_store_is_refused(tmp_path):
    """A job mounting a store inside another one's (store=/ckpt/run2 while
    /ckpt is a store): the outer mount would take the inner files, and the
    inner `.ckptfs/`, for its own after a restart, and delete them with a
    directory of its mount. Refused, while the outer one runs and after."""
    outer = start_mount(tmp_path / "outer")
    try:
        outer.path("f").write_bytes(b"x")
        (tmp_path / "mnt").mkdir()
        for _ in range(2):
            r = run_cli("mount", str(tmp_path / "mnt"), "--store", str(outer.store / "run2"))
            assert r.returncode == 2 and f"is inside the ckptfs store {outer.store}" in r.stderr and "Traceback" not in r.stderr, r.stderr
            assert not is_mounted(tmp_path / "mnt")
            run_cli("umount", str(outer.mountpoint))
    finally:
        stop_background_mount(tmp_path / "mnt")
        stop_mount(outer)
    assert not (outer.store / "run2").exists()


def test_a_store_that_holds_another_store_is_refused(tmp_path):
    """The converse: mounting /ckpt while /ckpt/run2 is a store. The mount
    showed run2's records, index and staging as files of its own, and would
    publish into run2 behind its daemon's back, or delete it, metadata and
    all, with `rm -r run2`. Refused at once (not retried), saying where."""
    outer = tmp_path / "outer"
    inner = start_mount(tmp_path / "inner", store=outer / "run2")
    try:
        inner.path("f").write_bytes(b"x")
        run_cli("flush", str(inner.mountpoint))
        (tmp_path / "mnt").mkdir()
        try:
            r = run_cli("mount", str(tmp_path / "mnt"), "--store", str(outer))
            assert r.returncode != 0 and f"holds another ckptfs store at run2 (run2/{META}/)" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr and "failed 6 times" not in r.stderr
            assert not is_mounted(tmp_path / "mnt")
        finally:
            stop_background_mount(tmp_path / "mnt")
    finally:
        stop_mount(inner)
    assert (inner.store / "f").read_bytes() == b"x"


def test_help_and_version_still_work():
    r = run_cli("--help")
    assert r.returncode == 0 and "mount" in r.stdout
    r = run_cli("mount", "--help")
    assert r.returncode == 0 and "--store" in r.stdout
    r = run_cli("--version")
    assert r.returncode == 0 and "ckptfs" in r.stdout


def test_a_bad_flush_timeout_from_a_client_is_refused_by_the_daemon(shared_mount):
    # Not only the command line: the daemon itself answers a bad request with an error, not an internal one.
    for bad in (-1, float("nan")):
        with pytest.raises(RequestFailed, match="timeout"):
            Client(shared_mount.mountpoint).flush(timeout=bad)
    with pytest.raises(RequestFailed, match="timeout"):
        Client(shared_mount.mountpoint).call("flush", path="", timeout="soon")
    assert "internal error" not in shared_mount.log_text()


def test_a_relative_store_is_recorded_absolute(tmp_path):
    (tmp_path / "mnt").mkdir()
    r = subprocess.run([sys.executable, "-m", "ckptfs.tools.cli", "mount", "mnt", "--store", "store", "--memory-limit", "256M"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    mp = tmp_path / "mnt"
    try:
        assert r.returncode == 0, r.stderr
        info = runtime.MountInfo.read(mp)
        assert info is not None and info.store_url == str(tmp_path / "store")
        (mp / "f").write_bytes(b"data")
        assert run_cli("flush", str(mp), "--timeout", "60").returncode == 0
        # verify by mount point, from another directory: the store is found where it is
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        v = subprocess.run([sys.executable, "-m", "ckptfs.tools.cli", "verify", str(mp)], cwd=elsewhere, capture_output=True, text=True,
                           timeout=120)
        assert v.returncode == 0 and v.stdout.startswith("1 ok"), v.stdout + v.stderr
        assert os.listdir(elsewhere) == []
        assert run_cli("umount", str(mp)).returncode == 0
    finally:
        _cleanup_background(mp)


@pytest.mark.parametrize("name", ["new\nline", "tab\there", "back\\slash", "sp ace\\040x", os.fsdecode(b"not-utf8-\xff")])
def test_mount_points_with_escaped_names(tmp_path, name):
    mp = tmp_path / name
    mp.mkdir()
    r = run_cli("mount", str(mp), "--store", str(tmp_path / "store"), "--memory-limit", "256M")
    try:
        assert r.returncode == 0, r.stderr
        assert str(mp) in runtime.ckptfs_mounts()
        (mp / "f").write_bytes(b"x")
        s = run_cli("status", str(mp), "--json")
        assert s.returncode == 0, s.stderr
        assert json.loads(s.stdout)["mount"]["mountpoint"] == str(mp)
        u = run_cli("umount", str(mp))
        assert u.returncode == 0 and "everything is published" in u.stdout, u.stdout + u.stderr
        assert not is_mounted(mp)
    finally:
        _cleanup_background(mp)


def test_a_second_daemon_is_refused_while_the_first_still_drains(tmp_path):
    m = start_mount(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    try:
        m.allowed_log_errors += ["failed (try", "Errno 20", "Not a directory", "NotADirectoryError", "FileExistsError", "NOT PUBLISHED",
                                 "not published"]
        with store_outage(m.store):
            (m.mountpoint / "pending").write_bytes(b"p" * 1000)
            r = run_cli("umount", str(m.mountpoint), "--timeout", "1")
            assert r.returncode == 1 and "gave up waiting after 1s" in r.stderr, r.stderr
            assert runtime.pid_alive(m.pid) and not is_mounted(m.mountpoint)  # unmounted, still draining to the store
            # the same mount point again
            assert_one_line(run_cli("mount", str(m.mountpoint), "--store", str(m.store)), 2, "still running")
            # another mount point, the same store
            assert_one_line(run_cli("mount", str(other), "--store", str(m.store)), 2, "in use")
            assert not is_mounted(other) and runtime.MountInfo.read(m.mountpoint).pid == m.pid  # the draining daemon's details stay
        assert m.proc.wait(timeout=60) == 0  # the store came back: it published and exited
        assert (m.store / "pending").read_bytes() == b"p" * 1000
    finally:
        stop_mount(m)
        for mp in (m.mountpoint, other):  # a second daemon, had it been let in
            if runtime.MountInfo.read(mp) is not None and runtime.MountInfo.read(mp).pid != m.pid:
                _cleanup_background(mp)


def test_names_that_would_forge_log_lines_or_table_rows(fresh_mount):
    m = fresh_mount
    raw = b"bad\xff\nERROR forged line\tend"
    name = os.fsdecode(raw)
    with open(os.path.join(os.fsencode(m.mountpoint), raw), "wb") as f:
        f.write(b"payload")
    assert run_cli("flush", str(m.mountpoint), "--timeout", "60").returncode == 0
    assert (m.store / name).read_bytes() == b"payload"
    log = m.log.read_bytes()
    assert b"Traceback" not in log and b"UnicodeEncodeError" not in log
    assert not any(line.startswith(b"ERROR forged") for line in log.splitlines())
    assert b"published bad\\xff\\nERROR forged line\\tend" in log
    # the table: one row, escaped; JSON: the exact name
    r = run_cli("status", str(m.mountpoint), "--files")
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if "bad" in ln]
    assert len(rows) == 1 and "bad\\xff\\nERROR forged line\\tend" in rows[0], r.stdout
    j = json.loads(run_cli("status", str(m.mountpoint), "--files", "--json").stdout)
    assert [f["path"] for f in j["files"]] == [name]


def test_no_access_to_dev_fuse_names_the_fix(tmp_path):
    """A user who may not open /dev/fuse: one line naming the fix, exit 2
    (a private mount namespace gets a /dev/fuse only root may open; the
    command runs as nobody)."""
    (tmp_path / "mnt").mkdir()
    os.chmod(tmp_path, 0o755)
    node = tmp_path / "fuse"
    script = (f"mknod {node} c 10 229 && chmod 0600 {node} && mount --bind {node} /dev/fuse && "
              f"exec setpriv --reuid=65534 --regid=65534 --clear-groups {sys.executable} -m ckptfs.tools.cli "
              f"mount {tmp_path / 'mnt'} --store {tmp_path / 'store'}")
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60, cwd="/")
    assert_one_line(r, 2, "/dev/fuse")
    assert "chmod" in r.stderr


def test_the_mount_command_waits_for_an_exiting_daemon(tmp_path):
    """A daemon that closes its end of the pipe and exits a moment later is
    reported as exited (with its error), not as "did not mount in time"."""
    assert _ready_of("os.close({w}); time.sleep(1.0)") == b""
    assert _ready_of("os.write({w}, b'ok'); time.sleep(30)") == b"ok"


def test_the_mount_command_hears_why_the_daemon_would_not_mount(tmp_path):
    """The spawned daemon checks the store and the cluster (once, not in
    the command as well) and says why it would not mount on the pipe."""
    assert _ready_of("os.write({w}, b'2 the store '); time.sleep(0.5); os.write({w}, b'is bad\\n'); os.close({w}); time.sleep(1.0)") \
        == b"2 the store is bad\n"


def _ready_of(child: str) -> bytes | None:
    """What `wait_ready` says of a child process running `child` ({w}: its end of the pipe)."""
    from ckptfs.tools.cli import wait_ready

    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", "import os, time; " + child.format(w=w)], pass_fds=(w,))
    os.close(w)
    try:
        return wait_ready(proc.pid, r, timeout=20)
    finally:
        os.close(r)
        proc.kill()
        proc.wait()


def _cleanup_background(mp: Path) -> None:
    """Unmount and stop a daemon the background `ckptfs mount` started."""
    info = runtime.MountInfo.read(mp)
    if is_mounted(mp):
        lazy_unmount(mp)
    if info is not None and runtime.pid_alive(info.pid):
        os.kill(info.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while runtime.pid_alive(info.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if runtime.pid_alive(info.pid):
            os.kill(info.pid, signal.SIGKILL)


def test_a_store_that_fails_its_first_calls_is_waited_for_at_startup(tmp_path):
    """A store can fail its first requests (a server still starting, a disk
    briefly full): the daemon retries the calls it cannot start without
    (scan, claim) with backoff, and the mount comes up once the store
    answers, instead of dying with a traceback."""
    mp, store = tmp_path / "mnt", tmp_path / "store"
    mp.mkdir()
    (store / ".ckptfs").mkdir(parents=True)
    begin_outage(store)  # claiming the store (clearing dead daemons' staging) fails
    timer = threading.Timer(3.0, end_outage, (store,))
    timer.start()
    try:
        r = run_cli("mount", str(mp), "--store", str(store), timeout=90)
        assert r.returncode == 0, r.stderr
        (mp / "x").write_bytes(b"x")
        assert run_cli("umount", str(mp)).returncode == 0
        assert (store / "x").read_bytes() == b"x"
    finally:
        timer.cancel()
        timer.join()
        _cleanup_background(mp)


def test_a_store_that_stays_unusable_at_startup_is_one_clear_error(tmp_path):
    mp, store = tmp_path / "mnt", tmp_path / "store"
    mp.mkdir()
    (store / ".ckptfs").mkdir(parents=True)
    begin_outage(store)
    try:
        r = run_cli("mount", str(mp), "--store", str(store), timeout=120)
        assert_one_line(r, 1, "claim the store")
        assert not is_mounted(mp)
    finally:
        _cleanup_background(mp)


def test_verify_by_a_user_who_may_not_read_the_store_names_the_fix(tmp_path):
    """`ckptfs verify` run by a user who may not read a local store (its
    records are the daemon's user's, 0600 in a 0700 directory): one line
    saying so and who may, exit 1."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="ckptfs-verify-"))  # nobody must reach it: not under the test's 0700 tmp_path
    try:
        os.chmod(root, 0o755)
        m = start_mount(tmp_path, store=root / "store")
        try:
            (m.mountpoint / "weights").write_bytes(b"w")
            assert run_cli("flush", str(m.mountpoint), "--timeout", "60").returncode == 0
        finally:
            stop_mount(m)
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "ckptfs.tools.cli",
                            "verify", str(root / "store")], capture_output=True, text=True, timeout=60, cwd="/")
        assert_one_line(r, 1, "Permission denied")
        assert "verify as the user the daemon runs as, or as root" in r.stderr
        assert run_cli("verify", str(root / "store")).returncode == 0
    finally:
        shutil.rmtree(root)
