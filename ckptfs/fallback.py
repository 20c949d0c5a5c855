"""Where a save should go when the mount may not be able to take it (C7).

Any process that touches a hung FUSE mount blocks in the kernel, so the
decision is made without touching the mount: /proc/mounts says whether the
path is on a ckptfs mount, the daemon's control socket (with a timeout) says
whether it answers, and the mount's runtime record (`ckptfs.runtime`, kept
outside the mount, left behind when a daemon dies) gives the store URL.

A daemon that did not answer in time is not waited for again by every call
of this process: its mount is routed to the store at once while a thread of
this process asks the daemon again every ASK_AGAIN_S (`_Unanswered`); once it
answers, its mount is routed to it again.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ckptfs import runtime
from ckptfs.client import CkptfsError, Client, DaemonUnavailable, find_mount

LOCAL_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # $TMPDIR cannot take a file that a load copies from the store
ASK_AGAIN_S = 1.0  # a daemon that did not answer in time is asked again this often, in the background


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
        reason = unanswered.why(mountpoint)
        if reason is None:
            try:
                Client(mountpoint, timeout=deadline_s).ping()
                return Route("mount", p, rel)
            except CkptfsError as exc:
                reason = str(exc)
                if isinstance(exc, DaemonUnavailable) and exc.hung:
                    unanswered.add(mountpoint, reason, deadline_s)
    else:
        reason = f"{mountpoint} is no longer mounted"
    info = runtime.MountInfo.read(mountpoint)
    if info is None:
        raise NoStore(f"cannot save {p}: {reason}, and the store behind {mountpoint} is unknown")
    return Route("store", p, rel, info.store_url, reason)


class _Unanswered:
    """The mounts whose daemon did not answer in time (hung, or too busy to
    answer its control socket), each with why: a thread per mount asks its
    daemon again every ASK_AGAIN_S (as long as it waits for the answer; a
    daemon that never answers delays no other's) and forgets it once it
    answers, or once its mount is gone. A process forked meanwhile starts
    with none (the threads are not forked)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mounts: dict[str, tuple[str, float]] = {}  # mountpoint -> (why, seconds to wait for an answer)

    def why(self, mountpoint: str) -> str | None:
        """Why the mount's daemon is not asked now (None: it is)."""
        with self._lock:
            found = self._mounts.get(mountpoint)
        return None if found is None else f"{found[0]}; asked again every {ASK_AGAIN_S:g}s"

    def add(self, mountpoint: str, why: str, deadline_s: float) -> None:
        with self._lock:
            asking = mountpoint in self._mounts  # (its thread runs)
            self._mounts[mountpoint] = (why, deadline_s)
        if not asking:
            threading.Thread(target=self._ask_again, args=(mountpoint,), name=f"ckptfs-ask-again {mountpoint}", daemon=True).start()

    def _ask_again(self, mountpoint: str) -> None:
        while True:
            time.sleep(ASK_AGAIN_S)
            with self._lock:
                found = self._mounts.get(mountpoint)
            if found is None:  # (a fork's child cleared it)
                return
            try:
                if find_mount(mountpoint)[0] != mountpoint:
                    raise CkptfsError(f"{mountpoint} is no longer mounted")
                Client(mountpoint, timeout=found[1]).ping()
            except DaemonUnavailable as exc:
                if exc.hung:
                    continue  # still no answer
            except Exception:  # gone, answering otherwise, anything else: each call asks for itself again
                pass
            with self._lock:
                self._mounts.pop(mountpoint, None)
            return

    def _forked(self) -> None:
        self._lock = threading.Lock()
        self._mounts.clear()


unanswered = _Unanswered()
os.register_at_fork(after_in_child=unanswered._forked)


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


@contextlib.contextmanager
def mapped(path: str) -> Iterator[mmap.mmap | bytes]:
    """A local file's bytes (a save's, on its way to the store), mapped:
    read from the page cache as they go, never copied into the process's
    own memory whole (a checkpoint may be as large as what RAM has left
    while the daemon is hung, holding its budget)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        yield data
    finally:
        with contextlib.suppress(BufferError):  # a view still held (an error's traceback): unmapped when it goes
            data.close()


def said(exc: BaseException) -> str:
    """An error's first line, for a warning (torch's errors run to many)."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__
