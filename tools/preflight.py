"""Checks run before mounting, each failing with a message for the user."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ckptfs import runtime


class PreflightError(Exception):
    pass


def check_fuse() -> None:
    if not os.path.exists("/dev/fuse"):
        raise PreflightError("/dev/fuse is missing: load the fuse module (modprobe fuse) or, in a container, pass --device /dev/fuse")
    if shutil.which("fusermount3") is None:
        raise PreflightError("fusermount3 not found: install the fuse3 package (apt-get install fuse3)")
    try:
        import pyfuse3  # noqa: F401
    except ImportError as exc:
        raise PreflightError(f"pyfuse3 cannot be imported ({exc}): pip install pyfuse3 (it builds against libfuse3-dev)") from None


def check_mountpoint(path: str) -> Path:
    mp = Path(os.path.realpath(path))
    # /proc/mounts first: stat() on a hung FUSE mount would block forever.
    if str(mp) in _all_mountpoints():
        raise PreflightError(f"{mp} is already a mount point")
    if not mp.exists():
        raise PreflightError(f"mount point {mp} does not exist")
    if not mp.is_dir():
        raise PreflightError(f"mount point {mp} is not a directory")
    try:
        if any(mp.iterdir()):
            raise PreflightError(f"mount point {mp} is not empty")
    except PermissionError:
        raise PreflightError(f"mount point {mp} cannot be read (permission denied)") from None
    return mp


def check_mounted_ckptfs(path: str) -> str:
    mp = os.path.abspath(path)
    if mp not in runtime.ckptfs_mounts():
        raise PreflightError(f"{mp} is not a ckptfs mount")
    return mp


def check_port(host: str, port: int) -> None:
    """Fail early (before the daemon starts) if the metrics port is taken."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PreflightError(f"--metrics-host {host}: {exc.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise PreflightError(f"--metrics-port {port}: cannot listen on {host}:{port}: {exc.strerror}") from None


def _all_mountpoints() -> set[str]:
    with open("/proc/mounts") as f:
        return {line.split()[1].replace("\\040", " ") for line in f if line.strip()}
