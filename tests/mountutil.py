"""Start and stop real ckptfs mounts for tests.

Teardown always runs the same escalation, whatever state the daemon is in:
lazy unmount (never blocks on a hung daemon), then SIGTERM, then SIGKILL of
the daemon we started, by pid.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptfs import runtime

START_TIMEOUT_S = 30.0


def fuse_usable() -> bool:
    return os.path.exists("/dev/fuse") and subprocess.run(["which", "fusermount3"], capture_output=True).returncode == 0


def is_mounted(path: Path | str) -> bool:
    return str(path) in runtime.all_mountpoints()


def run_cli(*args: str, timeout: float = 120, env: dict | None = None, user: int | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptfs.tools.cli", *args],
        capture_output=True, text=True, timeout=timeout, env=env,
        user=user, cwd=cwd,
    )


@dataclass
class Mount:
    mountpoint: Path
    store: Path
    log: Path
    proc: subprocess.Popen
    allowed_log_errors: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def path(self, *parts: str) -> Path:
        return self.mountpoint.joinpath(*parts)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def unexpected_log_errors(self) -> list[str]:
        bad = []
        for line in self.log_text().splitlines():
            if (" ERROR " in line or "Traceback" in line or " WARNING " in line) and not any(
                a in line for a in self.allowed_log_errors
            ):
                bad.append(line)
        return bad


def start_mount(base: Path, memory_limit: str = "4G", extra: tuple[str, ...] = (), env: dict | None = None,
                store: Path | None = None, open_files: int | None = None) -> Mount:
    """A daemon in the foreground; `open_files`: its descriptor limit, soft and hard."""
    mountpoint = base / "mnt"
    store = store or base / "store"
    mountpoint.mkdir(parents=True, exist_ok=True)
    log = base / "daemon.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptfs.tools.cli", "mount", str(mountpoint), "--store", str(store),
         "--memory-limit", memory_limit, "--foreground", "--log-file", str(log),
         "--log-level", os.environ.get("CKPTFS_TEST_LOG_LEVEL", "INFO"), *extra],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(base / "daemon.stderr", "wb"),
        env=None if env is None else {**os.environ, **env},
        preexec_fn=None if open_files is None else lambda: limit_open_files(open_files),
    )
    m = Mount(mountpoint, store, log, proc)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if is_mounted(mountpoint):
            try:
                os.stat(mountpoint)
                return m
            except OSError:
                pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_mount(m)
            raise RuntimeError(f"mount did not come up: {(base / 'daemon.stderr').read_text()} {m.log_text()}")
        time.sleep(0.05)


def limit_open_files(n: int) -> None:
    """This process's descriptor limit, soft and hard (it cannot raise it)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


_libc = ctypes.CDLL(None, use_errno=True)
MNT_DETACH = 2


def lazy_unmount(mp: Path | str) -> None:
    """`umount -l` of `mp`, done by this process itself (the tests run as
    root): a child process forked while a thread of this one holds files of
    a hung mount open would hang, uninterruptibly, closing its copies of
    them before its exec (each close is a FLUSH the kernel waits on, even
    past SIGKILL), and the test run with it. Not mounted: nothing to do."""
    if _libc.umount2(os.fsencode(mp), MNT_DETACH) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
        return
    subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True, timeout=20)  # not root after all


def stop_mount(m: Mount) -> None:
    """Unmount and reap the daemon; works when it hangs or died."""
    try:
        if is_mounted(m.mountpoint):
            lazy_unmount(m.mountpoint)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if m.proc.poll() is None:
            m.proc.send_signal(signal.SIGTERM)
            try:
                m.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait(timeout=10)
        if is_mounted(m.mountpoint):  # the daemon died before unmounting
            lazy_unmount(m.mountpoint)


def stop_background_mount(mp: Path) -> None:
    """Unmount what `ckptfs mount` (its daemon in the background) left at
    `mp`, if anything, and reap that daemon by pid: lazy unmount, then
    terminate, then kill."""
    info = runtime.MountInfo.read(mp)
    if is_mounted(mp):
        lazy_unmount(mp)
    if info is None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not runtime.pid_alive(info.pid):
            return
        os.kill(info.pid, sig)
        deadline = time.monotonic() + 5
        while runtime.pid_alive(info.pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def drop_caches() -> None:
    """Make the next reads go through the daemon, not the page cache."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def read_uncached(path: Path | str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def signal_and_wait(p: subprocess.Popen, sig: int, timeout: float = 60) -> tuple[str, str]:
    """Send `sig` to a child started with pipes; its output once it exits
    (killed, and the test failing, if it does not within `timeout`)."""
    try:
        p.send_signal(sig)
        return p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
