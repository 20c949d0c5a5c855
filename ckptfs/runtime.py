"""Where a running daemon leaves its details, outside the mount.

Anything that touches a hung FUSE mount blocks in the kernel, so tools find a
daemon (its pid, store URL, log) from a per-mount directory under the runtime
directory instead: `/run/ckptfs` for root, `$XDG_RUNTIME_DIR/ckptfs` or
`/tmp/ckptfs-<uid>` otherwise. Each mount's directory is named by a hash of
its absolute path and is private to the mounting user (0700).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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
    key = hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:16]
    return runtime_root() / key


@dataclass(frozen=True)
class MountInfo:
    mountpoint: str
    store_url: str
    pid: int
    log_file: str
    started: float
    version: int = FORMAT_VERSION

    def write(self) -> Path:
        d = mount_dir(self.mountpoint)
        d.parent.mkdir(parents=True, exist_ok=True)
        d.mkdir(mode=0o700, exist_ok=True)
        path = d / "mount.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, mountpoint: str | os.PathLike[str]) -> MountInfo | None:
        try:
            data = json.loads((mount_dir(mountpoint) / "mount.json").read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None

    @classmethod
    def new(cls, mountpoint: str, store_url: str, log_file: str) -> MountInfo:
        return cls(os.path.abspath(mountpoint), store_url, os.getpid(), log_file, time.time())


def remove(mountpoint: str | os.PathLike[str]) -> None:
    for name in ("mount.json", "control.sock"):
        with contextlib.suppress(FileNotFoundError):
            (mount_dir(mountpoint) / name).unlink()
    with contextlib.suppress(OSError):  # unless a log or exit report is still there
        mount_dir(mountpoint).rmdir()


def write_exit_report(mountpoint: str | os.PathLike[str], unpublished: list[str]) -> None:
    """What a daemon left unpublished when it exited, for `ckptfs umount`."""
    d = mount_dir(mountpoint)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    (d / "exit.json").write_text(json.dumps({"version": FORMAT_VERSION, "unpublished": unpublished}))


def take_exit_report(mountpoint: str | os.PathLike[str]) -> list[str] | None:
    path = mount_dir(mountpoint) / "exit.json"
    try:
        data = json.loads(path.read_text())
        path.unlink()
        return list(data["unpublished"])
    except (OSError, ValueError, KeyError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def control_socket(mountpoint: str | os.PathLike[str]) -> Path:
    """The daemon's control socket (see ckptfs.client)."""
    return mount_dir(mountpoint) / "control.sock"


def _ckptfs_mount_entries() -> list[tuple[str, str]]:
    found = []
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4 and fields[2] == "fuse.ckptfs":
                found.append((fields[1].replace("\\040", " "), fields[3]))
    return found


def ckptfs_mounts() -> list[str]:
    """Mountpoints of every ckptfs mount on this machine, from /proc/mounts."""
    return [mp for mp, _ in _ckptfs_mount_entries()]


def mount_owner(mountpoint: str) -> int | None:
    """The uid that mounted `mountpoint` (FUSE's user_id= option)."""
    for mp, options in _ckptfs_mount_entries():
        if mp == mountpoint:
            for opt in options.split(","):
                if opt.startswith("user_id="):
                    return int(opt.removeprefix("user_id="))
    return None
