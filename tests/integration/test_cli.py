"""`ckptfs mount` / `ckptfs umount` as a user runs them, errors included."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckptfs.tools import cli

from ckptfs import runtime
from tests.mountutil import is_mounted, lazy_unmount, run_cli, start_mount, stop_background_mount, stop_mount
from tests.storeutil import begin_outage, end_outage, store_outage, wait_until


def assert_clean_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    mp = tmp_path / "mnt"
    mp.mkdir()
    try:
        yield mp, tmp_path / "store"
    finally:  # a mount that should have been refused was made
        stop_background_mount(mp)


def test_background_mount_and_umount(dirs):
    mp, store = dirs
    r = run_cli("mount", str(mp), "--store", str(store), "--memory-limit", "1G")
    try:
        assert r.returncode == 0, r.stderr
        assert is_mounted(mp)  # live when the command returns
        (mp / "f").write_bytes(b"x")
        info = runtime.MountInfo.read(mp)
        assert info is not None and info.store_url == str(store) and runtime.pid_alive(info.pid)
        assert os.statvfs(mp).f_blocks * os.statvfs(mp).f_frsize == 1 << 30
        r = run_cli("umount", str(mp))
        assert r.returncode == 0, r.stderr
        assert not is_mounted(mp) and not runtime.pid_alive(info.pid)
        assert runtime.MountInfo.read(mp) is None
    finally:
        if is_mounted(mp):
            lazy_unmount(mp)
            info = runtime.MountInfo.read(mp)
            if info:
                os.kill(info.pid, signal.SIGKILL)


def test_umount_of_a_dead_daemon_cleans_up(tmp_path):
    m = start_mount(tmp_path)
    try:
        os.kill(m.pid, signal.SIGKILL)
        m.proc.wait()
        r = run_cli("umount", str(m.mountpoint))
        assert r.returncode == 0, r.stderr
        assert "not running" in r.stdout
        assert not is_mounted(m.mountpoint)
    finally:
        stop_mount(m)


def test_a_mount_over_the_stale_mount_of_a_killed_daemon_replaces_it(tmp_path):
    """After a kill -9 of the daemon, its mount entry answers ENOTCONN; the
    next `ckptfs mount` there (a restarted job) removes it, with a word, and
    shows what the store holds. A live daemon's mount is never touched."""
    m = start_mount(tmp_path)
    try:
        m.path("f").write_bytes(b"published")
        assert run_cli("flush", str(m.mountpoint)).returncode == 0
        os.kill(m.pid, signal.SIGKILL)
        m.proc.wait()
        assert is_mounted(m.mountpoint)
        r = run_cli("mount", str(m.mountpoint), "--store", str(m.store))
        try:
            assert r.returncode == 0, r.stderr
            assert "removed the stale mount" in r.stderr
            assert m.path("f").read_bytes() == b"published"
            again = run_cli("mount", str(m.mountpoint), "--store", str(m.store))
            assert again.returncode == 2 and "already a mount point" in again.stderr, again.stderr
        finally:
            info = runtime.MountInfo.read(m.mountpoint)
            if run_cli("umount", str(m.mountpoint)).returncode != 0:
                lazy_unmount(m.mountpoint)
                if info is not None and runtime.pid_alive(info.pid):
                    os.kill(info.pid, signal.SIGKILL)
    finally:
        stop_mount(m)


def test_a_live_mount_whose_daemon_details_are_lost_is_never_taken_for_stale(tmp_path):
    """Its daemon's details gone (a cleaner of /tmp, say) prove nothing:
    `mount` there refuses, and the live mount stays."""
    m = start_mount(tmp_path)
    try:
        (runtime.mount_dir(m.mountpoint) / "mount.json").unlink()
        r = run_cli("mount", str(m.mountpoint), "--store", str(tmp_path / "other"))
        assert r.returncode == 2 and "already a mount point" in r.stderr, r.stderr
        m.path("still").write_bytes(b"live")
        assert m.path("still").read_bytes() == b"live" and m.proc.poll() is None
    finally:
        stop_mount(m)
        if is_mounted(m.mountpoint):  # a second daemon, mounted where it must not be
            lazy_unmount(m.mountpoint)


def test_umount_says_what_is_left_while_a_failing_store_holds_the_drain(tmp_path):
    """`umount` waits for the drain; while a store outage holds it, a line
    every few seconds says what is left and why (silence looked hung)."""
    m = start_mount(tmp_path)
    m.allowed_log_errors += ["failed (try", "retrying"]
    try:
        begin_outage(m.store)
        try:
            m.path("model.pt").write_bytes(b"m" * 100_000)
            wait_until(lambda: "failed (try" in m.log_text(), 30, "a failed publication")
            umount = subprocess.Popen([sys.executable, "-m", "ckptfs.tools.cli", "umount", str(m.mountpoint)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                lines: list[str] = []
                deadline = time.monotonic() + 30
                while not any("still publishing: 1 file" in ln for ln in lines):
                    assert select.select([umount.stderr], [], [], max(0.0, deadline - time.monotonic()))[0], \
                        f"umount said nothing of what is left within 30 s: {lines}"
                    ln = umount.stderr.readline()
                    assert ln, f"umount ended before saying what is left: {lines}"
                    lines.append(ln)
            finally:
                end_outage(m.store)
            out, err = umount.communicate(timeout=120)
        finally:
            if umount.poll() is None:
                umount.kill()
                umount.wait()
        assert umount.returncode == 0, err
        assert "failing:" in " ".join(lines) and "everything is published" in out
        said = next(ln for ln in lines if "still publishing" in ln)
        assert "; the daemon gives up on it in " in said and said.rstrip().endswith(" min"), said  # its --drain-timeout, 600 s
    finally:
        stop_mount(m)


def test_umount_says_when_only_the_daemons_last_store_calls_are_left(tmp_path):
    """Everything published, the store frozen: the daemon's exit still makes
    its last store calls (the manifest index, its retirement), each up to
    --store-timeout. `umount` said "still publishing: 0 namespace changes
    left; the daemon gives up on it in 9.9 min" meanwhile."""
    from tests.gcsserver import start_gcs

    gcs = start_gcs(tmp_path / "gcs")  # a store of this test's own, to freeze (SIGSTOP)
    m = start_mount(tmp_path, extra=("--store", gcs.bucket("frozen"), *gcs.cli_options(), "--store-timeout", "6"))
    m.allowed_log_errors += ["gave no answer", "cannot write this daemon's heartbeat", "cannot leave the manifest index"]
    try:
        m.path("model.pt").write_bytes(b"m" * 1000)
        assert run_cli("flush", str(m.mountpoint)).returncode == 0
        os.killpg(gcs.proc.pid, signal.SIGSTOP)
        try:
            r = run_cli("umount", str(m.mountpoint))
        finally:
            os.killpg(gcs.proc.pid, signal.SIGCONT)
        assert r.returncode == 0 and "everything is published" in r.stdout, r.stdout + r.stderr
        assert "umount: everything is published; the daemon's last store calls (the manifest index, its retirement) are under way, " \
               "each given at most 6s" in r.stderr, r.stderr
        assert "still publishing" not in r.stderr, r.stderr
    finally:
        stop_mount(m)
        gcs.stop()


def test_umount_again_after_an_interrupted_one_waits_for_the_drain(tmp_path):
    """An umount cut short (^C, a lost session, its --timeout) leaves the
    daemon unmounted and publishing what it holds. Running umount again
    waits for that drain and says how it ended: "not a ckptfs mount" made it
    look done while files were not in the store yet (and a second SIGTERM
    would stop the drain)."""
    m = start_mount(tmp_path)
    m.allowed_log_errors += ["failed (try", "retrying"]
    again = None
    try:
        begin_outage(m.store)
        try:
            m.path("model.pt").write_bytes(b"m" * 100_000)
            wait_until(lambda: "failed (try" in m.log_text(), 30, "a failed publication")
            r = run_cli("umount", str(m.mountpoint), "--timeout", "1")
            assert r.returncode != 0 and "gave up waiting after 1s: 1 file" in r.stderr, r.stderr
            assert not is_mounted(m.mountpoint) and m.proc.poll() is None  # unmounted, draining
            assert_clean_error(run_cli("mount", str(m.mountpoint), "--store", str(m.store)), "still publishing", f"ckptfs umount {m.mountpoint}")
            # status and flush of the mount point reach the draining daemon (they said "not on a ckptfs mount")
            r = run_cli("status", str(m.mountpoint), "--json")
            assert r.returncode == 0 and "is unmounted; its daemon" in r.stderr, r.stderr
            assert json.loads(r.stdout)["totals"]["queue"] == 1
            assert time.time() < json.loads(r.stdout)["mount"]["draining_until"] <= time.time() + 600
            r = run_cli("status", str(m.mountpoint), "--files")
            assert r.returncode == 0 and "model.pt" in r.stdout, r.stdout + r.stderr
            assert "draining" in r.stdout and "gives up in " in r.stdout, r.stdout
            # and among every mount's, with no MOUNTPOINT (it was left out: unmounted)
            r = run_cli("status", "--json")
            mounts = json.loads(r.stdout)["mounts"]
            listed = [x for x in mounts if x["mount"]["mountpoint"] == str(m.mountpoint)]
            assert len(listed) == 1 and listed[0]["totals"]["queue"] == 1 and listed[0]["mount"]["draining_until"], r.stdout
            unreachable = any("error" in x and not x.get("denied") for x in mounts)  # (another mount of the machine's, out of its runtime directory)
            assert r.returncode == (3 if unreachable else 0), r.stdout + r.stderr
            r = run_cli("status")
            assert r.returncode == (3 if unreachable else 0) and str(m.mountpoint) in r.stdout and "draining" in r.stdout, r.stdout + r.stderr
            r = run_cli("flush", str(m.mountpoint), "--timeout", "1")
            assert r.returncode == 1 and "is unmounted; its daemon" in r.stderr and "not published after 1s" in r.stderr, r.stderr
            again = subprocess.Popen([sys.executable, "-m", "ckptfs.tools.cli", "umount", str(m.mountpoint)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                time.sleep(1)
                assert again.poll() is None, again.communicate()  # waiting, not "not a ckptfs mount"
            finally:
                end_outage(m.store)
            out, err = again.communicate(timeout=120)
        finally:
            if again is not None and again.poll() is None:
                again.kill()
                again.wait()
        assert again.returncode == 0, err
        assert "still publishing" in out and "everything is published" in out, out
        assert (m.store / "model.pt").read_bytes() == b"m" * 100_000
        assert m.proc.wait(timeout=10) == 0
        assert run_cli("umount", str(m.mountpoint)).returncode == 2  # nothing there now
    finally:
        stop_mount(m)


def test_umount_says_how_a_drain_it_gave_up_on_ended(tmp_path):
    """The drain outlives an umount's wait and ends with a file not
    published (the store failing past --drain-timeout): the next umount says
    so, where it said "not a ckptfs mount" and the only word of the lost
    file was in the daemon's log. An umount waits, by default, as long as
    the daemon may drain and exit: it gave up after 600 s, when the default
    drain did, just before the daemon said what it left."""
    m = start_mount(tmp_path, extra=("--drain-timeout", "3", "--store-timeout", "7"))
    m.allowed_log_errors += ["failed (try", "retrying", "NOT PUBLISHED", "changes not published"]
    try:
        info = runtime.MountInfo.read(m.mountpoint)
        assert info is not None and (info.drain_timeout, info.store_timeout) == (3, 7)
        assert cli.exit_wait(info) >= 3 + cli.EXIT_STORE_CALLS * 7
        begin_outage(m.store)
        m.path("model.pt").write_bytes(b"m" * 100_000)
        wait_until(lambda: "failed (try" in m.log_text(), 30, "a failed publication")
        r = run_cli("umount", str(m.mountpoint), "--timeout", "0.5")
        assert r.returncode == 1 and "gave up waiting after 0.5s: 1 file" in r.stderr and "--drain-timeout" in r.stderr, r.stderr
        assert m.proc.wait(timeout=60) == 1  # its drain over, model.pt not published
        r = run_cli("umount", str(m.mountpoint))
        assert r.returncode == 1, r.stdout + r.stderr
        assert "1 file was NOT published" in r.stderr and "not waited for by an umount" in r.stderr, r.stderr
        assert "model.pt" in r.stderr
        assert_clean_error(run_cli("umount", str(m.mountpoint)), "not a ckptfs mount")  # said once
    finally:
        stop_mount(m)


def test_umounts_at_once_each_say_what_the_drain_left(tmp_path):
    """Every rank of a node runs `ckptfs umount` at once, and the drain ends
    with a file not published: each of them says so and exits 1 (the first
    to read the daemon's report took it, and the others said "everything is
    published")."""
    m = start_mount(tmp_path, extra=("--drain-timeout", "3"))
    m.allowed_log_errors += ["failed (try", "retrying", "NOT PUBLISHED", "changes not published"]
    umounts: list[subprocess.Popen] = []
    try:
        begin_outage(m.store)
        m.path("model.pt").write_bytes(b"m" * 100_000)
        wait_until(lambda: "failed (try" in m.log_text(), 30, "a failed publication")
        umounts = [subprocess.Popen([sys.executable, "-m", "ckptfs.tools.cli", "umount", str(m.mountpoint)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
        for u in umounts:
            out, err = u.communicate(timeout=120)
            assert u.returncode == 1 and "1 file was NOT published" in err and "model.pt" in err, out + err
    finally:
        for u in umounts:
            if u.poll() is None:
                u.kill()
                u.wait()
        stop_mount(m)


def test_umount_of_a_daemon_killed_while_it_drains_says_so(tmp_path):
    """The daemon is killed while `umount` waits for its drain (the OOM
    killer, a job's kill -9): `umount` says what it cannot know, that what
    was not published is lost, and exits 1; it said "everything is
    published"."""
    m = start_mount(tmp_path)
    m.allowed_log_errors += ["failed (try", "retrying"]
    umount = None
    try:
        begin_outage(m.store)
        m.path("model.pt").write_bytes(b"m" * 100_000)
        wait_until(lambda: "failed (try" in m.log_text(), 30, "a failed publication")
        umount = subprocess.Popen([sys.executable, "-m", "ckptfs.tools.cli", "umount", str(m.mountpoint)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: not is_mounted(m.mountpoint), 30, "the unmount")
        m.proc.kill()
        out, err = umount.communicate(timeout=60)
        assert umount.returncode == 1 and "exited without saying what it published" in err, out + err
        assert "everything is published" not in out
    finally:
        if umount is not None and umount.poll() is None:
            umount.kill()
            umount.wait()
        stop_mount(m)


def test_a_mount_warns_of_files_its_last_daemon_left_unpublished(tmp_path):
    """A daemon told to stop by a signal alone (a job's end) whose drain
    ends with files not published: the next `ckptfs mount` there says so,
    once; a clean exit leaves nothing to say."""
    m = start_mount(tmp_path, extra=("--drain-timeout", "2"))
    m.allowed_log_errors += ["failed (try", "retrying", "NOT PUBLISHED", "changes not published"]
    try:
        begin_outage(m.store)
        for i in range(12):
            m.path(f"f{i:02}.pt").write_bytes(b"f" * 1000)
        wait_until(lambda: "failed (try" in m.log_text(), 30, "a failed publication")
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(timeout=60) == 1
    finally:
        stop_mount(m)
    end_outage(m.store)
    try:
        r = run_cli("mount", str(m.mountpoint), "--store", str(m.store))
        assert r.returncode == 0, r.stderr
        assert "warning: the last daemon of" in r.stderr and "with 12 files NOT published" in r.stderr, r.stderr
        named = [ln for ln in r.stderr.splitlines() if ln.startswith("  f") and ".pt (" in ln]
        assert len(named) == 10 and "  and 2 more" in r.stderr, r.stderr  # the first ten named
        assert run_cli("umount", str(m.mountpoint)).returncode == 0
        r = run_cli("mount", str(m.mountpoint), "--store", str(m.store))
        assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
        assert run_cli("umount", str(m.mountpoint)).returncode == 0
    finally:
        stop_background_mount(m.mountpoint)


def test_signals_at_once_are_one_request_and_a_later_one_stops_the_drain(tmp_path):
    """`ckptfs umount` run by every rank of a node at once sends a SIGTERM
    each: the second stopped the drain, and what was not yet published was
    lost. Signals within 2 s of the first are the same request; one later
    (a person pressing ^C again) stops waiting for the store."""

    def draining(m, gaps: list[float]) -> None:
        """Signals `m`'s daemon, `gaps` seconds apart, while a store outage holds a file back."""
        m.allowed_log_errors += ["failed (try", "retrying", "NOT PUBLISHED", "not published", "any longer"]
        m.path("model.pt").write_bytes(b"m" * 100_000)
        wait_until(lambda: "failed (try" in m.log_text(), 30, "a failed publication")
        for gap in [*gaps, 0]:
            m.proc.send_signal(signal.SIGTERM)
            time.sleep(gap)

    m = start_mount(tmp_path)
    try:
        with store_outage(m.store):
            draining(m, [0.3, 0.3])  # apart: a signal sent while one is pending merges with it
            wait_until(lambda: not is_mounted(m.mountpoint), 30, "the unmount")
            time.sleep(1)
            assert m.proc.poll() is None and "the same request" in m.log_text()  # still draining
        assert m.proc.wait(timeout=120) == 0
        assert (m.store / "model.pt").read_bytes() == b"m" * 100_000
    finally:
        stop_mount(m)
    again = start_mount(tmp_path / "again")
    try:
        with store_outage(again.store):
            draining(again, [2.5])
            assert again.proc.wait(timeout=60) == 1  # stopped waiting: reported as not published
            assert "not waiting for write-back any longer" in again.log_text()
    finally:
        stop_mount(again)


def test_the_unmount_report_names_a_file_by_its_name_now(tmp_path):
    """A file renamed after its close (write to a temporary name, then
    rename: what every framework does) and not published when the drain is
    given up: the report named it by the temporary name, one the user never
    sees in the mount."""
    m = start_mount(tmp_path)
    m.allowed_log_errors += ["failed (try", "retrying", "NOT PUBLISHED", "not published", "any longer"]
    try:
        with store_outage(m.store):
            m.path("model.pt.tmp").write_bytes(b"m" * 100_000)
            os.rename(m.path("model.pt.tmp"), m.path("model.pt"))
            wait_until(lambda: "failed (try" in m.log_text(), 30, "a failed publication")
            m.proc.send_signal(signal.SIGTERM)
            time.sleep(2.5)
            m.proc.send_signal(signal.SIGTERM)  # stop waiting for the store
            assert m.proc.wait(timeout=60) == 1
        assert "NOT PUBLISHED: model.pt (100000 bytes" in m.log_text(), m.log_text()[-2000:]
    finally:
        stop_mount(m)


def test_sigterm_unmounts(tmp_path):
    m = start_mount(tmp_path)
    try:
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(timeout=30) == 0
        assert not is_mounted(m.mountpoint)
    finally:
        stop_mount(m)


@pytest.mark.parametrize("name", ["José ü", "comma,x", "bytes-\udcff"])  # the last: the byte 0xff, not UTF-8
def test_a_mount_point_and_store_of_any_name(tmp_path, name):
    """pyfuse3 encodes mount options as ASCII: the store's path, in the
    file system's name, failed every mount at /data/José (a traceback from
    the daemon)."""
    mp, store = tmp_path / f"mnt {name}", tmp_path / f"store {name}"
    mp.mkdir()
    try:
        r = run_cli("mount", str(mp), "--store", str(store))
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        (mp / "model.pt").write_bytes(b"m")
        assert run_cli("umount", str(mp)).returncode == 0
        assert (store / "model.pt").read_bytes() == b"m"
    finally:
        stop_background_mount(mp)


def test_the_daemon_keeps_none_of_the_descriptors_its_caller_passed(dirs):
    """The daemon is forked by `ckptfs mount`: it must not keep what the
    command inherited (a pipe its caller reads to its end, as a shell's
    command substitution or a job runner does), or the caller hangs as long
    as the mount lives."""
    mp, store = dirs
    r, w = os.pipe()
    try:
        proc = subprocess.run([sys.executable, "-m", "ckptfs.tools.cli", "mount", str(mp), "--store", str(store)],
                              pass_fds=(w,), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        os.close(w)
        w = -1
        assert select.select([r], [], [], 10)[0] and os.read(r, 1) == b"", "the daemon holds the caller's pipe"
        assert run_cli("umount", str(mp)).returncode == 0
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


@pytest.mark.parametrize("closed", [">&-", "<&- >&- 2>&-"], ids=["stdout", "all three"])
def test_a_mount_command_started_with_its_standard_descriptors_closed_mounts(dirs, closed):
    """A command started by a supervisor or a script with stdout closed
    (`>&-`): the daemon it forks must still report ready on its own pipe
    and log to its own file (a pipe taking fd 1 would be lost to them)."""
    mp, store = dirs
    r = subprocess.run(["bash", "-c", f'exec "$0" -m ckptfs.tools.cli mount "$1" --store "$2" {closed}', sys.executable, str(mp), str(store)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert is_mounted(mp)
    (mp / "f").write_bytes(b"x")
    assert run_cli("umount", str(mp)).returncode == 0
    assert (store / "f").read_bytes() == b"x"


def test_mounts_of_one_mount_point_at_once_make_one_mount(dirs):
    """A launch script run by every rank of a node mounts the same path at
    once: each `ckptfs mount` passed the checks before any had mounted, so
    mounts stacked up and several daemons served one store. One wins; each
    other one is refused with a one-line error."""
    mp, store = dirs
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "ckptfs.tools.cli", "mount", str(mp), "--store", str(store)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
        results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
        assert sorted(code for code, _, _ in results) == [0, 2, 2, 2], results
        for code, _, err in results:
            if code:
                assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert _mounts_at(mp) == 1
        assert len(_daemons_of(mp)) == 1
        assert run_cli("umount", str(mp)).returncode == 0
    finally:  # however many there are
        for pid in _daemons_of(mp):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while _mounts_at(mp):
            lazy_unmount(mp)


def test_foreground_mounts_of_one_mount_point_by_two_spellings_make_one_mount(dirs, tmp_path):
    """The lock is on the mount point itself, whichever way it is spelled
    (here through a symlink), for `mount -f` run directly too."""
    mp, store = dirs
    (tmp_path / "link").symlink_to(mp)
    procs = [subprocess.Popen([sys.executable, "-m", "ckptfs.tools.cli", "mount", str(where), "--store", str(store), "-f"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for where in (mp, tmp_path / "link")]
    try:
        wait_until(lambda: sum(p.poll() is not None for p in procs) == 1 and _mounts_at(mp) == 1, 60, "one mount, one refusal")
        refused = next(p for p in procs if p.poll() is not None)
        assert refused.returncode == 2 and "one daemon per mount point" in refused.stderr.read()
        time.sleep(1)
        assert _mounts_at(mp) == 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        while _mounts_at(mp):
            lazy_unmount(mp)


def _mounts_at(mp: Path) -> int:
    return [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()].count(str(mp))


def _daemons_of(mp: Path) -> list[int]:
    """The pids of the daemons serving `mp` (forked by `ckptfs mount`, with
    its command line), and of `ckptfs mount` commands still running."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = [os.fsdecode(a) for a in (proc / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if proc.name.isdigit() and argv[3:6] == ["mount", str(mp), "--store"]:
            found.append(int(proc.name))
    return found


def test_a_mount_reached_through_a_symlink(tmp_path):
    """`/scratch` a link to the file system holding the mount point (common
    on clusters): `status`, `flush`, `evict` and `umount` through the link
    said "not a ckptfs mount". Links up to the mount point are followed,
    without touching anything under it (a hung daemon must not block)."""
    real, link, store = tmp_path / "real", tmp_path / "link", tmp_path / "store"
    (real / "mnt").mkdir(parents=True)
    link.symlink_to(real)
    mp = link / "mnt"
    try:
        assert run_cli("mount", str(mp), "--store", str(store)).returncode == 0
        (mp / "model.pt").write_bytes(b"m")
        for args in (["status", str(mp)], ["flush", str(mp)], ["evict", str(mp / "model.pt")], ["status", str(mp), "--files"]):
            r = run_cli(*args)
            assert r.returncode == 0, (args, r.stderr)
        assert "model.pt" in run_cli("status", str(mp), "--files").stdout
        r = run_cli("umount", str(mp))
        assert r.returncode == 0 and "everything is published" in r.stdout, r.stderr
        assert not is_mounted(real / "mnt")
    finally:
        stop_background_mount(real / "mnt")


def test_mountpoint_missing(tmp_path):
    assert_clean_error(run_cli("mount", str(tmp_path / "nope"), "--store", str(tmp_path / "s")), "does not exist")


def test_mountpoint_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("")
    assert_clean_error(run_cli("mount", str(tmp_path / "file"), "--store", str(tmp_path / "s")), "not a directory")


def test_mountpoint_not_empty(dirs):
    mp, store = dirs
    (mp / "x").write_text("")
    assert_clean_error(run_cli("mount", str(mp), "--store", str(store)), "not empty")


def test_mountpoint_already_mounted(tmp_path):
    m = start_mount(tmp_path)
    try:
        r = run_cli("mount", str(m.mountpoint), "--store", str(tmp_path / "s2"))
        assert_clean_error(r, "already a mount point")
    finally:
        stop_mount(m)


@pytest.mark.parametrize("size", ["lots", "-1G", "0", "12Q", "150%", "1000T"])
def test_bad_memory_limit(dirs, size):
    mp, store = dirs
    assert_clean_error(run_cli("mount", str(mp), "--store", str(store), "--memory-limit", size), "--memory-limit")


@pytest.mark.parametrize("given, expected", [(None, -500), ("300", 300), ("-1000", -1000)])
def test_the_daemon_asks_the_oom_killer_to_pick_it_last(dirs, given, expected):
    """Out of memory, the kernel kills the process it scores highest, and the
    daemon holding the RAM budget is the biggest: killed, every file it has
    not published is gone, while a trainer killed instead restarts from its
    RAM. The daemon lowers its score (--oom-score-adj, default -500). Where
    the kernel refuses (lowering needs CAP_SYS_RESOURCE; some sandboxes
    refuse any negative value), the daemon says so in its log and goes on."""
    mp, store = dirs
    r = run_cli("mount", str(mp), "--store", str(store), *(["--oom-score-adj", given] if given else []))
    assert r.returncode == 0, r.stderr
    info = runtime.MountInfo.read(mp)
    assert info is not None
    now = int(Path(f"/proc/{info.pid}/oom_score_adj").read_text())
    if now != expected:
        assert expected < 0 and now == int(Path("/proc/self/oom_score_adj").read_text())  # as inherited
        assert f"oom_score_adj stays as inherited, not {expected}" in Path(info.log_file).read_text()
    assert run_cli("umount", str(mp)).returncode == 0


def test_the_daemon_raises_its_descriptor_limit_to_the_hard_one(dirs):
    """A soft limit of 1,024 descriptors (a common default) is for programs
    that leak them; the daemon's store walks and uploads may need more."""
    mp, store = dirs

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))

    r = subprocess.run([sys.executable, "-m", "ckptfs.tools.cli", "mount", str(mp), "--store", str(store)],
                       capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert r.returncode == 0, r.stderr
    info = runtime.MountInfo.read(mp)
    assert info is not None
    line = next(ln for ln in Path(f"/proc/{info.pid}/limits").read_text().splitlines() if ln.startswith("Max open files"))
    assert line.split()[3:5] == ["4096", "4096"], line
    assert run_cli("umount", str(mp)).returncode == 0


@pytest.mark.parametrize("value", ["-1001", "1001", "low"])
def test_bad_oom_score_adj(dirs, value):
    mp, store = dirs
    assert_clean_error(run_cli("mount", str(mp), "--store", str(store), "--oom-score-adj", value), "--oom-score-adj")


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A real memory cgroup (v1 or v2) capped at `limit` bytes, as a
    container's is; its cgroup.procs is yielded, and it is removed after."""
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    name = f"ckptfs-test-{uuid.uuid4().hex[:8]}"
    if (v1 / "memory.limit_in_bytes").exists():
        group, knob = v1 / name, "memory.limit_in_bytes"
    elif (v2 / "cgroup.subtree_control").exists() and "memory" in (v2 / "cgroup.subtree_control").read_text().split():
        group, knob = v2 / name, "memory.max"
    else:
        pytest.skip("no memory cgroup controller this test can use")
    group.mkdir()
    try:
        (group / knob).write_text(str(limit))
        yield group / "cgroup.procs"
    finally:
        deadline = time.monotonic() + 10
        while True:  # empty once the processes started in it have exited
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def test_memory_limit_is_of_the_cgroups_memory(dirs):
    """In a container, the machine's RAM is not what the daemon may use: a
    budget of half the host's RAM in a pod capped far lower gets the daemon
    killed for memory, with every file not yet published. A percentage is of
    the cgroup's limit, and a size over it is refused."""
    mp, store = dirs

    def in_cgroup(procs: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", sys.executable, "-m", "ckptfs.tools.cli", *args],
                              capture_output=True, text=True, timeout=120)

    with memory_cgroup(1 << 30) as procs:
        try:
            assert_clean_error(in_cgroup(procs, "mount", str(mp), "--store", str(store), "--memory-limit", "2G"), "--memory-limit 2G", "cgroup")
            r = in_cgroup(procs, "mount", str(mp), "--store", str(store))  # the default: 50%
            assert r.returncode == 0, r.stderr
            assert os.statvfs(mp).f_blocks * os.statvfs(mp).f_frsize == 512 << 20
        finally:
            stop_background_mount(mp)  # its daemon gone, the cgroup can go


@pytest.mark.parametrize(("option", "value"), [("--cluster-snapshot-every", v) for v in ("0", "-5", "many")]
                         + [("--cluster-patience", v) for v in ("-1", "forever", "1e9")])
def test_bad_cluster_option(dirs, option, value):
    mp, store = dirs
    r = run_cli("mount", str(mp), "--store", str(store), "--cluster", "redis://127.0.0.1:1/0", option, value)
    assert_clean_error(r, option)
    assert r.returncode == 2


def test_unknown_store_protocol(dirs):
    mp, _ = dirs
    assert_clean_error(run_cli("mount", str(mp), "--store", "nosuch://bucket/x"), "unknown store protocol", "nosuch")


def test_store_protocol_package_missing(dirs):
    mp, _ = dirs
    pytest.importorskip("fsspec")
    try:
        import adlfs  # noqa: F401
        pytest.skip("adlfs is installed")
    except ImportError:
        pass
    assert_clean_error(run_cli("mount", str(mp), "--store", "abfs://container/x"), "adlfs")


def test_store_path_is_a_file(dirs, tmp_path):
    mp, _ = dirs
    (tmp_path / "afile").write_text("")
    assert_clean_error(run_cli("mount", str(mp), "--store", str(tmp_path / "afile")), "not a directory")


def test_fusermount3_missing(dirs, tmp_path):
    mp, store = dirs
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(sys.executable, bindir / "python")
    env = dict(os.environ, PATH=str(bindir))
    assert_clean_error(run_cli("mount", str(mp), "--store", str(store), env=env), "fuse3")


def test_dev_fuse_missing(dirs):
    mp, store = dirs
    # In a private mount namespace, hide /dev behind an empty tmpfs.
    script = f"mount -t tmpfs none /dev && exec {sys.executable} -m ckptfs.tools.cli mount {mp} --store {store}"
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert_clean_error(r, "/dev/fuse")


def test_umount_not_a_ckptfs_mount(tmp_path):
    assert_clean_error(run_cli("umount", str(tmp_path)), "not a ckptfs mount")


def test_help_texts():
    for args in (["--help"], ["mount", "--help"], ["umount", "--help"]):
        r = run_cli(*args)
        assert r.returncode == 0 and "Usage:" in r.stdout


def test_verify_against_a_store_url_and_a_mountpoint(tmp_path):
    m = start_mount(tmp_path)
    try:
        m.path("ckpt").mkdir()
        for name in ("a.pt", "b.pt", "c.pt"):
            m.path("ckpt", name).write_bytes(name.encode() * 1000)
        r = run_cli("umount", str(m.mountpoint))
        assert r.returncode == 0, r.stderr
    finally:
        stop_mount(m)
    r = run_cli("verify", str(m.store))
    assert r.returncode == 0 and "3 ok, 0 corrupt, 0 missing, 0 extra" in r.stdout
    (m.store / "ckpt" / "a.pt").write_bytes(b"X" * 4000)  # bit rot
    (m.store / "ckpt" / "b.pt").unlink()  # lost
    (m.store / "ckpt" / "stray.bin").write_bytes(b"?")  # not ours
    r = run_cli("verify", str(m.store))
    assert r.returncode == 8 + 16 + 32, r.stdout + r.stderr
    assert "CORRUPT  ckpt/a.pt" in r.stdout and "MISSING  ckpt/b.pt" in r.stdout and "EXTRA    ckpt/stray.bin" in r.stdout
    r = run_cli("verify", str(m.store), "ckpt/c.pt")
    assert r.returncode == 0 and "1 ok" in r.stdout
    again = start_mount(tmp_path)  # through the mountpoint: the store is found from the daemon's details
    again.allowed_log_errors.append("checksum mismatch")
    try:
        r = run_cli("verify", str(again.mountpoint))
        assert r.returncode == 8 + 16 + 32 and "CORRUPT  ckpt/a.pt" in r.stdout
    finally:
        stop_mount(again)


def test_verify_bad_input():
    assert_clean_error(run_cli("verify", "nosuch://x"), "unknown store protocol")
