"""Where a running daemon leaves its details, outside the mount.

Anything that touches a hung FUSE mount blocks in the kernel, so tools find a
daemon (its pid, store URL, log) from a per-mount directory under the runtime
directory instead: `/run/ckptfs` for root, `$XDG_RUNTIME_DIR/ckptfs` or
`/tmp/ckptfs-<uid>` otherwise. Each mount's directory is named by a hash of
its absolute path and is private to the mounting user (0700).

`/tmp` is shared: another user could create `/tmp/ckptfs-<uid>/...` first,
with `daemon.log` a symlink to a file of the victim's. So a runtime directory
is used only if it is a real directory (not a symlink) owned by the user and
writable by no one else (`private_dir`); readers trust nothing else either.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import resource
import stat
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

FORMAT_VERSION = 1


def runtime_root() -> Path:
    if override := os.environ.get("CKPTFS_RUNTIME_DIR"):
        return Path(override)
    if os.getuid() == 0:
        return Path("/run/ckptfs")
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / "ckptfs"
    return Path(f"/tmp/ckptfs-{os.getuid()}")


def mount_dir(mountpoint: str | os.PathLike[str]) -> Path:
    key = hashlib.sha256(os.fsencode(os.path.abspath(mountpoint))).hexdigest()[:16]
    return runtime_root() / key


class RuntimeDirError(Exception):
    """A runtime directory that is not private to the user: refused."""


def _check_private(path: Path, tighten: bool) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"runtime directory {path} is not a directory (a symlink?): refusing it; remove it")
    if st.st_uid != os.getuid():
        raise RuntimeDirError(f"runtime directory {path} belongs to uid {st.st_uid}, not to uid {os.getuid()}: refusing it "
                              "(someone may have made it to catch ckptfs's files); remove it, or set XDG_RUNTIME_DIR")
    if st.st_mode & 0o022:
        raise RuntimeDirError(f"runtime directory {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
                              "refusing it; remove it")
    if tighten and st.st_mode & 0o077:
        os.chmod(path, 0o700)


def private_dir(mountpoint: str | os.PathLike[str]) -> Path:
    """The mount's runtime directory, made 0700 if missing; it and the
    runtime root checked to be the user's own and private. RuntimeDirError
    if not."""
    root, d = runtime_root(), mount_dir(mountpoint)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        for path in (root, d):
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
            _check_private(path, tighten=True)
    except OSError as exc:  # a place this user may not write (CKPTFS_RUNTIME_DIR set to one): said, not a traceback
        raise RuntimeDirError(f"cannot make the runtime directory {d}: {exc.strerror} ({exc.filename}); "
                              "set CKPTFS_RUNTIME_DIR to a directory of yours") from None
    return d


def trusted_dir(mountpoint: str | os.PathLike[str]) -> Path | None:
    """The mount's runtime directory if it exists and is private to the user; else None."""
    d = mount_dir(mountpoint)
    try:
        _check_private(runtime_root(), tighten=False)
        _check_private(d, tighten=False)
    except (OSError, RuntimeDirError):
        return None
    return d


class MountpointBusy(Exception):
    """Another daemon of this user holds the mount point."""


def hold_mountpoint(mountpoint: str | os.PathLike[str]) -> int:
    """An exclusive lock on `mountpoint` among this user's daemons, for the
    daemon's life: its descriptor is never closed, and the kernel drops the
    lock when the process ends, however it ends. Two `ckptfs mount` of one
    mount point at once (a launch script run by every rank of a node) both
    passed the checks, stacked two mounts and ran two daemons on one store.
    MountpointBusy if another daemon holds it."""
    fd = os.open(private_dir(mountpoint) / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise MountpointBusy(f"another ckptfs daemon is mounting {os.path.abspath(mountpoint)}, or serving it, or still "
                             "publishing after its unmount: one daemon per mount point") from None
    return fd


@dataclass(frozen=True)
class MountInfo:
    mountpoint: str
    store_url: str
    pid: int
    log_file: str
    started: float
    version: int = FORMAT_VERSION
    # how long the daemon drains after its unmount (--drain-timeout), and a store call's
    # deadline (--store-timeout): how long `ckptfs umount` may have to wait (these defaults:
    # a mount.json of a daemon of before, which did not say)
    drain_timeout: float = 600.0
    store_timeout: float = 60.0

    def write(self) -> Path:
        d = private_dir(self.mountpoint)
        path = d / "mount.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, mountpoint: str | os.PathLike[str]) -> MountInfo | None:
        d = trusted_dir(mountpoint)
        if d is None:
            return None
        try:
            data = json.loads((d / "mount.json").read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None

    @classmethod
    def new(cls, mountpoint: str, store_url: str, log_file: str, drain_timeout: float, store_timeout: float) -> MountInfo:
        return cls(os.path.abspath(mountpoint), store_url, os.getpid(), log_file, time.time(),
                   drain_timeout=drain_timeout, store_timeout=store_timeout)


def remove(mountpoint: str | os.PathLike[str], pid: int | None = None) -> None:
    """Forget the mount's details. With `pid`: only if they are that
    daemon's (a daemon exiting must not remove a newer daemon's socket)."""
    if pid is not None:
        info = MountInfo.read(mountpoint)
        if info is not None and info.pid != pid:
            return
    d = trusted_dir(mountpoint)
    if d is None:
        return
    for name in ("mount.json", "control.sock"):
        with contextlib.suppress(FileNotFoundError):
            (d / name).unlink()
    with contextlib.suppress(OSError):  # unless a log or exit report is still there
        d.rmdir()


def remove_stale(mountpoint: str) -> str | None:
    """Remove the mount entry a dead daemon left at `mountpoint` (every
    access to it fails with ENOTCONN; its RAM is gone with the daemon, so
    nothing is lost) and forget its details. None, or why it stays."""
    r = subprocess.run(["fusermount3", "-u", "-z", mountpoint], check=False, capture_output=True, text=True)
    if r.returncode != 0 and mountpoint in all_mountpoints():
        return r.stderr.strip() or f"fusermount3 exited with status {r.returncode}"
    remove(mountpoint)
    return None


class ExitReport(NamedTuple):
    """What a daemon left unpublished when it exited (one line a change),
    when, and whether an `umount` or a `mount` has said so already."""

    unpublished: list[str]
    exited: float | None  # None: a report of a daemon of before, which did not say
    shown: bool = False


def write_exit_report(mountpoint: str | os.PathLike[str], unpublished: list[str]) -> None:
    """What a daemon left unpublished when it exited, for `ckptfs umount`
    (every one waiting for it, or the next one, if none waited to the end)."""
    _write_report(private_dir(mountpoint), ExitReport(unpublished, time.time()))


def _write_report(d: Path, report: ExitReport) -> None:
    tmp = d / "exit.json.tmp"
    tmp.write_text(json.dumps({"version": FORMAT_VERSION, **report._asdict()}))
    os.replace(tmp, d / "exit.json")  # whole, for a reader at any moment


def read_exit_report(mountpoint: str | os.PathLike[str]) -> ExitReport | None:
    """The report the mount's last daemon left; None if there is none (it
    never exited, or was killed: a daemon that exits writes one). It stays:
    every `umount` waiting for that daemon (every rank of a node may run
    one) reads it; `mark_shown` once said."""
    d = trusted_dir(mountpoint)
    if d is None:
        return None
    try:
        data = json.loads((d / "exit.json").read_text())
        exited = data.get("exited")
        return ExitReport([str(line) for line in data["unpublished"]], float(exited) if isinstance(exited, int | float) else None,
                          data.get("shown") is True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def exit_report_of(daemon: MountInfo) -> ExitReport | None:
    """The report `daemon` left at its exit; None if it left none (it was
    killed, or has not exited): an earlier daemon's is not its."""
    report = read_exit_report(daemon.mountpoint)
    if report is None or (report.exited is not None and report.exited < daemon.started):
        return None
    return report


def mark_shown(mountpoint: str | os.PathLike[str], report: ExitReport) -> None:
    """`report` has been said: later commands need not say it again."""
    d = trusted_dir(mountpoint)
    if d is not None and not report.shown:
        with contextlib.suppress(OSError):
            _write_report(d, report._replace(shown=True))


def discard_exit_report(mountpoint: str | os.PathLike[str]) -> None:
    """Before a new daemon serves the mount point: an earlier daemon's
    report is not its."""
    d = trusted_dir(mountpoint)
    if d is not None:
        with contextlib.suppress(FileNotFoundError):
            (d / "exit.json").unlink()


def raise_open_files_limit() -> None:
    """Up to the hard limit: the soft one (often 1,024) is a limit for
    programs that leak descriptors, and a store walk holds one per level of
    depth, an upload or a load several (what Go programs do at start)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def pid_alive(pid: int) -> bool:
    """Whether the process `pid` runs: any of its threads (a zombie, exited
    but not yet reaped, does not). Not its main thread alone: that one is a
    zombie as soon as it has exited, while the others may still be exiting,
    with the process's descriptors (a daemon's lock on its mount point)
    and its memory (gigabytes take a while to give back)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            return True
    return False


def control_socket(mountpoint: str | os.PathLike[str]) -> Path:
    """The daemon's control socket (see ckptfs.client)."""
    return mount_dir(mountpoint) / "control.sock"


_ESCAPE = re.compile(rb"\\([0-7]{3})")


def unescape_mount_field(field: bytes) -> str:
    """A path as /proc/mounts and mountinfo write it (space, tab, newline and
    backslash as octal escapes), back to the name, decoded as os.fsdecode does."""
    return os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def mount_table(path: str = "/proc/mounts") -> list[list[str]]:
    """The mount table's lines as fields, paths decoded (bytes: names need not be UTF-8)."""
    with open(path, "rb") as f:
        return [[unescape_mount_field(x) for x in line.split()] for line in f if line.strip()]


def all_mountpoints() -> set[str]:
    return {fields[1] for fields in mount_table() if len(fields) >= 2}


def _ckptfs_mount_entries() -> list[tuple[str, str]]:
    return [(fields[1], fields[3]) for fields in mount_table() if len(fields) >= 4 and fields[2] == "fuse.ckptfs"]


def ckptfs_mounts() -> list[str]:
    """Mountpoints of every ckptfs mount on this machine, from /proc/mounts."""
    return [mp for mp, _ in _ckptfs_mount_entries()]


def unmounted_daemons() -> list[MountInfo]:
    """This user's daemons that are unmounted and still run: draining what
    they hold after an unmount (`mountpoint` no longer in the mount table),
    from their runtime directories."""
    mounted = set(ckptfs_mounts())
    try:
        names = sorted(os.listdir(runtime_root()))
    except OSError:
        return []
    out = []
    for name in names:
        try:
            mountpoint = json.loads((runtime_root() / name / "mount.json").read_text())["mountpoint"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not isinstance(mountpoint, str) or mountpoint in mounted or mount_dir(mountpoint).name != name:
            continue
        info = MountInfo.read(mountpoint)  # in a directory private to the user, or not at all
        if info is not None and pid_alive(info.pid):
            out.append(info)
    return out


def resolved_to_mount(path: str | os.PathLike[str], mounts: list[str] | None = None) -> str:
    """`path`, absolute, with the symlinks on its way followed up to the
    first ckptfs mount point it reaches (`/scratch/ckpt` where `/scratch`
    links to the file system the mount is on), and no further: nothing at
    or under a mount point is touched, so a hung daemon cannot block this
    (links inside a mount are the daemon's to follow)."""
    mounts = set(ckptfs_mounts() if mounts is None else mounts)
    todo = [p for p in os.path.abspath(path).split("/") if p][::-1]  # the components left, the next last
    here, hops = "/", 0
    while todo:
        part = todo.pop()
        there = os.path.join(here, part)
        if there in mounts:
            return os.path.join(there, *reversed(todo))
        try:
            link = os.readlink(there)
        except OSError:  # not a symlink, or not there: taken as it is
            here = there
            continue
        hops += 1
        if hops > 40:
            return os.path.abspath(path)
        todo.extend(p for p in reversed(os.path.normpath(os.path.join(here, link)).split("/")) if p)
        here = "/"
    return here


def mount_owner(mountpoint: str) -> int | None:
    """The uid that mounted `mountpoint` (FUSE's user_id= option)."""
    for mp, options in _ckptfs_mount_entries():
        if mp == mountpoint:
            for opt in options.split(","):
                if opt.startswith("user_id="):
                    return int(opt.removeprefix("user_id="))
    return None
