"""Checks run before mounting, each failing with a message for the user."""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
from pathlib import Path

from ckptfs import runtime
from ckptfs.config import DEFAULT_SPILL_DIR


class PreflightError(Exception):
    pass


def check_fuse(load: bool = True) -> None:
    """FUSE is usable here; `load`: pyfuse3 is imported (else only found: the
    daemon that imports it checks again)."""
    if not os.path.exists("/dev/fuse"):
        raise PreflightError("/dev/fuse is missing: load the fuse module (modprobe fuse) or, in a container, pass --device /dev/fuse")
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise PreflightError(f"uid {os.getuid()} may not open /dev/fuse: ask an administrator to make it usable "
                             "(chmod 0666 /dev/fuse, as most distributions ship it), or mount as root")
    fusermount = shutil.which("fusermount3")
    if fusermount is None:
        raise PreflightError("fusermount3 not found: install the fuse3 package (apt-get install fuse3)")
    if os.getuid() != 0 and not os.stat(fusermount).st_mode & stat.S_ISUID:
        raise PreflightError(f"{fusermount} is not setuid root, so uid {os.getuid()} cannot mount: "
                             f"ask an administrator (chmod u+s {fusermount}), or mount as root")
    try:
        if not load:
            if importlib.util.find_spec("pyfuse3") is None:
                raise ImportError("No module named 'pyfuse3'")
            return
        import pyfuse3  # noqa: F401
    except ImportError as exc:
        raise PreflightError(f"pyfuse3 cannot be imported ({exc}): pip install pyfuse3 (it builds against libfuse3-dev)") from None


def check_mountpoint(path: str) -> Path:
    mp = Path(os.path.realpath(path))
    if len(os.fsencode(str(mp))) >= 4096:
        raise PreflightError(f"mount point {str(mp)[:60]}... is longer than PATH_MAX (4095 bytes)")
    # /proc/mounts first: stat() on a hung FUSE mount would block forever.
    if str(mp) in runtime.all_mountpoints():
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


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def check_spill_dir(spill_dir: str | None) -> str | None:
    """Whether what RAM cannot hold can continue in `spill_dir` (None: the
    default) as the daemon will put it there (an unlinked file). Refused
    for a directory the user named; for the default, a warning to show (a
    read-only /var/tmp in a container): the mount is usable, but a save
    larger than the RAM budget would fail."""
    where = spill_dir or DEFAULT_SPILL_DIR
    if not os.path.isdir(where):
        why = "it is not a directory"
    else:
        try:
            os.close(os.open(where, os.O_TMPFILE | os.O_RDWR, 0o600))
            return None
        except OSError as exc:
            why = f"it cannot hold files ({exc.strerror})"
    if spill_dir is not None:
        raise PreflightError(f"--spill-dir {spill_dir}: {why}")
    return (f"the spill directory {where}: {why}; a save larger than the RAM budget will fail instead of continuing on disk "
            "(give --spill-dir DIR, a writable local disk)")


def check_places(mp: Path, store_url: str, spill_dir: str | None, log_file: str | None = None) -> None:
    """The store and spill directory are disk, outside the mount and outside
    any ckptfs mount; the mount is not inside the store (the daemon walks the
    store before it serves, and would walk into its own mount); the log file
    is in neither (the daemon would log into its own mount, or the next
    restart would show the log as a file of the store)."""
    from ckptfs.writeback.backend import local_root

    if store_url.split("://", 1)[0] == "memory":
        raise PreflightError(f"the store {store_url} would live in the daemon's own memory and be gone when it exits: "
                             "name durable storage (a directory, s3://, gs://)")
    mount = str(mp)
    for what, where in (("the store", local_root(store_url)), ("--spill-dir", spill_dir and os.path.abspath(spill_dir))):
        if where is None:
            continue
        names = [where]
        if not _on_ckptfs(where):  # resolving symlinks under a ckptfs mount could block on it
            names.append(os.path.realpath(where))
        for candidate in names:
            if _inside(candidate, mount):
                raise PreflightError(f"{what} {candidate} is inside the mount point {mount}: it must be outside the mount")
            if what == "the store" and _inside(mount, candidate):
                raise PreflightError(f"the mount point {mount} is inside the store {candidate}: mount somewhere else")
            other = _on_ckptfs(candidate)
            if other:
                raise PreflightError(f"{what} {candidate} is inside the ckptfs mount {other}: it must be durable storage, not RAM")
    if log_file is not None:
        log = os.path.abspath(log_file)
        store = local_root(store_url)
        names = {log} if _on_ckptfs(log) else {log, os.path.join(os.path.realpath(os.path.dirname(log)), os.path.basename(log))}
        for candidate in names:
            if _inside(candidate, mount):
                raise PreflightError(f"--log-file {candidate} is inside the mount point {mount}: the daemon would log into its own "
                                     "mount; put it outside")
            if store is not None and _inside(candidate, store):
                raise PreflightError(f"--log-file {candidate} is inside the store {store}: it would show as a file of the store; "
                                     "put it outside")


def _on_ckptfs(path: str) -> str | None:
    """The ckptfs mount `path` is on, by name only (a hung mount cannot block this)."""
    return next((m for m in runtime.ckptfs_mounts() if _inside(path, m)), None)


def check_not_in_a_store(store_url: str) -> None:
    """A local store inside another ckptfs store (a directory above it holds
    that store's `.ckptfs/`): the other store's mount would show this one's
    files, and its `.ckptfs/`, as its own, and delete them with a directory
    of that mount. `check_places` ran first: the store is on no ckptfs mount."""
    from ckptfs.writeback.backend import META, local_root

    root = local_root(store_url)
    if root is None:
        return
    above = os.path.dirname(os.path.realpath(root))
    while True:
        meta = os.path.join(above, META)
        if os.path.isdir(os.path.join(meta, "files")) or os.path.isdir(os.path.join(meta, "daemons")):
            raise PreflightError(f"the store {root} is inside the ckptfs store {above} (it holds {meta}): that store's mount would "
                                 "take this one's files for its own; use a directory outside it")
        if above == os.path.dirname(above):
            return
        above = os.path.dirname(above)


def check_no_daemon(mp: Path, backend=None) -> None:
    """No daemon still serves, or still drains, this mount point (after an
    `umount --timeout` gave up) or this store: two daemons would overwrite
    each other's files and socket."""
    info = runtime.MountInfo.read(mp)
    if info is not None and info.pid != os.getpid() and runtime.pid_alive(info.pid):
        raise PreflightError(f"a ckptfs daemon (pid {info.pid}) for {mp} is still running, probably still publishing "
                             f"after an unmount; `ckptfs umount {mp}` waits for it and says how it ends (log: {info.log_file}); "
                             f"killing it (kill {info.pid}) drops what it has not published")
    if backend is None:
        return
    others = sorted(backend.live_daemons())  # this process has no heartbeat yet
    if others:
        host, _, pid = others[0].rsplit("-", 1)[0].rpartition("-")
        raise PreflightError(f"the store {backend.url} is in use by a running ckptfs daemon (host {host}, pid {pid}): "
                             "one store serves one mount; unmount that one first")


def check_cluster_url(url: str) -> None:
    """A Redis URL with a password in it is refused: on the daemon's
    command line and in `status`, every user of the machine would read it."""
    from urllib.parse import urlsplit

    try:
        secret = urlsplit(url).password
    except ValueError:
        return  # malformed: the connection check says so
    if secret:
        raise PreflightError("--cluster: the Redis URL holds a password, which every user of this machine could read "
                             "(in `ps` and `ckptfs status`): leave it out of the URL and set $CKPTFS_REDIS_PASSWORD "
                             "or --cluster-password-file FILE")


def check_cluster(url: str, password_file: str | None, store_url: str) -> None:
    """Cluster mode: its Redis answers, takes the password, and keeps this store's namespace."""
    from ckptfs.cluster.log import ClusterError, SharedLog, Where

    try:
        shared = SharedLog(Where(url, password_file))
        try:
            shared.open(store_url)
        finally:
            shared.close()
    except ClusterError as exc:
        raise PreflightError(f"--cluster: {exc}") from None


def check_log_file(path: str) -> None:
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise PreflightError(f"--log-file {path}: cannot write it: {exc.strerror}") from None


def check_mounted_ckptfs(path: str) -> str:
    mounts = runtime.ckptfs_mounts()
    mp = runtime.resolved_to_mount(path, mounts)
    if mp not in mounts:
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

