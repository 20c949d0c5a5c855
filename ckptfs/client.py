"""Talk to a running ckptfs daemon: `Client(mountpoint)`.

Why a Unix socket outside the mount, and not a control file inside it: any
process that touches a hung FUSE mount blocks in the kernel, uninterruptibly,
so a health check through the mount could never time out. The socket lives in
the mount's runtime directory (`ckptfs.runtime`, private to the mounting user,
the socket itself 0600), is found from the mountpoint alone via
/proc/mounts, and every read has a timeout; the daemon also refuses peers
whose uid (SO_PEERCRED) is neither its own nor root's.

Protocol (version 1): one JSON request line `{"version": 1, "op": ...}`; the
daemon answers with zero or more `{"progress": {...}}` lines, then one
`{"ok": true, "result": {...}}` or `{"ok": false, "error": "..."}` line.
"""

from __future__ import annotations

import json
import math
import os
import socket
import stat
import time
from collections.abc import Callable
from typing import Any

from ckptfs import runtime

PROTOCOL_VERSION = 1
IO_TIMEOUT_S = 10.0  # silence longer than this means the daemon is hung
MAX_LINE = 64 << 20  # a request, at most
MAX_REPLY = 1 << 30  # a reply, at most (`status --files` of 100,000 files: 20 MiB)


class CkptfsError(Exception):
    """Base of the errors the client raises; the message is for a user."""


class NotMounted(CkptfsError):
    """The path is not on a ckptfs mount."""


class DaemonUnavailable(CkptfsError):
    """The daemon is gone (`hung` False) or does not answer in time (True)."""

    def __init__(self, message: str, hung: bool) -> None:
        super().__init__(message)
        self.hung = hung


class AccessDenied(CkptfsError):
    pass


class RequestFailed(CkptfsError):
    """The daemon answered with an error."""


class FlushIncomplete(CkptfsError):
    """A flush ended with files not yet published, `left` names them: its
    timeout passed (`timed_out`), or all that is left can never be published
    as it is (parked: a name or a file the store refuses) and waits for the
    user to change or delete it."""

    def __init__(self, message: str, left: list[dict], timed_out: bool) -> None:
        super().__init__(message)
        self.left = left
        self.timed_out = timed_out


def find_mount(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(mountpoint, path relative to it) for a path on a ckptfs mount.

    Touches nothing under a mount point: a hung mount cannot block this."""
    mounts = runtime.ckptfs_mounts()
    p = runtime.resolved_to_mount(path, mounts)
    best = ""
    for mp in mounts:
        if (p == mp or p.startswith(mp.rstrip("/") + "/")) and len(mp) > len(best):
            best = mp
    if not best:
        raise NotMounted(f"{p} is not on a ckptfs mount")
    return best, os.path.relpath(p, best).replace(os.sep, "/").removeprefix(".").strip("/")


class Client:
    """A connection to the daemon serving `mountpoint` (or any path on it)."""

    def __init__(self, path: str | os.PathLike[str], timeout: float = IO_TIMEOUT_S) -> None:
        self.mountpoint, self.relpath = find_mount(path)
        self.timeout = timeout
        owner = runtime.mount_owner(self.mountpoint)
        if owner is not None and owner != os.getuid():
            # Its daemon keeps its control socket in that user's runtime directory, which
            # may be anywhere ($XDG_RUNTIME_DIR): not knowing where, root would call it stale.
            raise AccessDenied(f"{self.mountpoint} was mounted by uid {owner}: only that user's ckptfs can reach its daemon "
                               "(its details are in that user's runtime directory)")
        self.socket_path = runtime.control_socket(self.mountpoint)

    @classmethod
    def unmounting(cls, mountpoint: str, timeout: float = IO_TIMEOUT_S) -> Client:
        """The daemon of `mountpoint` after its unmount, while it drains: no
        longer in the mount table, it still answers (status, never paths)."""
        client = cls.__new__(cls)
        client.mountpoint, client.relpath, client.timeout = mountpoint, "", timeout
        client.socket_path = runtime.control_socket(mountpoint)
        return client

    @classmethod
    def draining(cls, mountpoint: str | os.PathLike[str], timeout: float = 2.0) -> tuple[runtime.MountInfo, Client] | None:
        """The daemon of `mountpoint`, unmounted, still publishing what it
        holds: it answers on its control socket (not a stale record of a pid
        since reused). None if there is none."""
        info = runtime.MountInfo.read(runtime.resolved_to_mount(mountpoint))
        if info is None or not runtime.pid_alive(info.pid):
            return None
        client = cls.unmounting(info.mountpoint, timeout=timeout)
        try:
            client.ping()
        except CkptfsError:
            return None
        return info, client

    def _rel(self, path: str | os.PathLike[str] | None) -> str:
        if path is None:
            return self.relpath
        mp, rel = find_mount(path)
        if mp != self.mountpoint:
            raise NotMounted(f"{path} is not on {self.mountpoint}")
        return rel

    # -- requests ------------------------------------------------------------
    def ping(self) -> dict:
        return self.call("ping")

    def status(self, files: bool = False, path: str | os.PathLike[str] | None = None, cluster: bool = False) -> dict:
        """Totals, and with `files` the per-file rows (under `path`); with
        `cluster` (a cluster mount) every node of the cluster too."""
        return self.call("status", files=files, path=self._rel(path), cluster=cluster)

    def flush(self, path: str | os.PathLike[str] | None = None, timeout: float | None = None,
              progress: Callable[[dict], None] | None = None, cluster: bool = False) -> dict:
        """Wait until everything sealed before the call (under `path`) is
        published; with `cluster`, everything sealed anywhere in the cluster
        before the call. Raises FlushIncomplete when `timeout` passes first,
        or when what is left is parked (it would wait for ever)."""
        # Progress lines arrive every PROGRESS_EVERY_S: silence, not length, means hung.
        result = self.call("flush", path=self._rel(path), timeout=timeout, progress=progress, cluster=cluster,
                           deadline=math.inf if timeout is None else timeout + self.timeout)
        if not result["published"]:
            left = result["left"]
            if result.get("timed_out") and timeout is not None:
                raise FlushIncomplete(f"{len(left)} {'file' if len(left) == 1 else 'files'} not published after {timeout:g}s", left, True)
            raise FlushIncomplete(f"{len(left)} {'file or change' if len(left) == 1 else 'files or changes'} can never be published as "
                                  "they are (parked, or a change the store could not take: change or delete them)", left, False)
        return result

    def prefetch(self, path: str | os.PathLike[str] | None = None) -> dict:
        return self.call("prefetch", path=self._rel(path), deadline=math.inf)

    def evict(self, path: str | os.PathLike[str] | None = None) -> dict:
        return self.call("evict", path=self._rel(path))

    # -- the wire ------------------------------------------------------------
    def call(self, op: str, progress: Callable[[dict], None] | None = None, deadline: float | None = None, **args: Any) -> dict:
        """Send one request; return its result. `deadline`: seconds the whole
        request may take (progress lines keep a long one alive meanwhile)."""
        sock = self._connect()
        closed = DaemonUnavailable(f"the ckptfs daemon for {self.mountpoint} closed the connection", hung=False)
        try:
            try:
                sock.sendall(json.dumps({"version": PROTOCOL_VERSION, "op": op, **args}).encode() + b"\n")
            except (BrokenPipeError, ConnectionResetError):  # it died (or stopped) as the request went
                raise closed from None
            end = time.monotonic() + (deadline if deadline is not None else self.timeout)
            buf = bytearray()  # appended to in place: a 20 MiB reply (`status --files`, 100,000 files) came in 64 KiB at a time
            searched = 0  # no newline in buf before this
            while True:
                while (eol := buf.find(b"\n", searched)) < 0:
                    searched = len(buf)
                    sock.settimeout(max(0.01, min(self.timeout, end - time.monotonic())))
                    try:
                        chunk = sock.recv(1 << 16)
                    except TimeoutError:
                        raise DaemonUnavailable(f"the ckptfs daemon for {self.mountpoint} did not answer within "
                                                f"{self.timeout:g}s (hung?)", hung=True) from None
                    except ConnectionResetError:  # it died with the request unread
                        raise closed from None
                    if not chunk:
                        raise closed
                    buf += chunk
                    if len(buf) > MAX_REPLY:
                        raise RequestFailed("reply too long")
                line = bytes(buf[:eol])
                del buf[: eol + 1]
                searched = 0
                reply = json.loads(line)
                if "progress" in reply:
                    if progress is not None:
                        progress(reply["progress"])
                    continue
                if not reply.get("ok"):
                    if reply.get("kind") == "access":
                        raise AccessDenied(reply.get("error", "refused"))
                    raise RequestFailed(reply.get("error", "the daemon gave no reason"))
                return reply["result"]
        finally:
            sock.close()

    def _connect(self) -> socket.socket:
        self._check_socket()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.socket_path))
        except PermissionError:
            sock.close()
            raise AccessDenied(f"permission denied on {self.socket_path}: only the user who mounted {self.mountpoint} may control it") from None
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            info = runtime.MountInfo.read(self.mountpoint)
            why = "its daemon is not running" if info is None or not runtime.pid_alive(info.pid) else "its daemon has no control socket"
            raise DaemonUnavailable(f"{self.mountpoint} is a ckptfs mount but {why} (stale mount? `ckptfs umount` it)", hung=False) from None
        except TimeoutError:
            sock.close()
            raise DaemonUnavailable(f"the ckptfs daemon for {self.mountpoint} did not accept a connection (hung?)", hung=True) from None
        return sock

    def _check_socket(self) -> None:
        """Talk only to a socket of the user's own, in a private runtime
        directory: a squatter's socket would be handed the user's requests."""
        if runtime.trusted_dir(self.mountpoint) is None and runtime.mount_dir(self.mountpoint).exists():
            raise AccessDenied(f"the runtime directory {runtime.mount_dir(self.mountpoint)} of {self.mountpoint} is not private "
                               f"to uid {os.getuid()}: refusing to talk through it (remove it)")
        try:
            st = os.lstat(self.socket_path)
        except OSError:
            return  # connect() says what is missing
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
            raise AccessDenied(f"{self.socket_path} is not a socket of uid {os.getuid()}'s: refusing to talk to it")
