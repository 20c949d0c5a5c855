"""Where a save should go when the mount may not be able to take it (C7).

Any process that touches a hung FUSE mount blocks in the kernel, so the
decision is made without touching the mount: /proc/mounts says whether the
path is on a ckptfs mount, the daemon's control socket (with a timeout) says
whether it answers, and the mount's runtime record (`ckptfs.runtime`, kept
outside the mount, left behind when a daemon dies) gives the store URL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptfs import runtime
from ckptfs.client import CkptfsError, Client, find_mount


@dataclass(frozen=True)
class Route:
    kind: str  # "mount": the daemon answers; "store": write/read the store directly; "plain": not ckptfs at all
    path: str  # the absolute path asked for
    relpath: str = ""  # relative to the mountpoint (= the path in the store)
    store_url: str = ""
    reason: str = ""  # why not the mount


class NoStore(CkptfsError):
    """The mount cannot serve and its store is unknown."""


def route(path: str | os.PathLike[str], deadline_s: float = 5.0) -> Route:
    p = os.path.abspath(path)
    try:
        mountpoint, rel = find_mount(p)
        mounted = True
    except CkptfsError:
        found = _former_mount(p)
        if found is None:
            return Route("plain", p)
        mountpoint, rel = found
        mounted = False
    if mounted:
        try:
            Client(mountpoint, timeout=deadline_s).ping()
            return Route("mount", p, rel)
        except CkptfsError as exc:
            reason = str(exc)
    else:
        reason = f"{mountpoint} is no longer mounted"
    info = runtime.MountInfo.read(mountpoint)
    if info is None:
        raise NoStore(f"cannot save {p}: {reason}, and the store behind {mountpoint} is unknown")
    return Route("store", p, rel, info.store_url, reason)


def _former_mount(path: str) -> tuple[str, str] | None:
    """A directory above `path` that a ckptfs daemon served and left a record for."""
    d = path
    while True:
        info = runtime.MountInfo.read(d)
        if info is not None and info.mountpoint == d:
            return d, os.path.relpath(path, d).replace(os.sep, "/").removeprefix(".").strip("/")
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def open_route_store(r: Route, storage_options: dict | None = None):
    """The store behind a "store" route ($CKPTFS_STORE_OPTIONS for credentials)."""
    from ckptfs.config import parse_store_options
    from ckptfs.writeback.backend import open_store

    options = storage_options if storage_options is not None else parse_store_options([], os.environ.get("CKPTFS_STORE_OPTIONS"))
    return open_store(r.store_url, options)
