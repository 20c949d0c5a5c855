"""The store adapter: one small interface over every kind of store.

A `Backend` publishes whole files only (C2): data is first *staged* (a temp
file, a multipart upload or a hidden staging object) and becomes visible at
its final path in one step (rename, multipart completion, server-side move).
Every method is blocking and is called from worker threads, never from the
trio thread. Paths are relative to the store root, with "/" separators.

Staging is never visible and never bound to a final name, so a file renamed
before its turn is published under its new name without uploading it again:

- `localstore.LocalBackend` (file://): a temp file in the daemon's staging
  directory, fsynced; published by rename(2). Directories move by one
  rename(2).
- `objectstore.S3Backend` (s3://): small files are not uploaded ahead:
  publication PUTs them whole from the sealed snapshot. A large one is a
  multipart upload left open at its name (completing it publishes it), or,
  when its name looks temporary, an upload to a hidden staging key,
  published by a server-side copy.
- `objectstore.FsspecBackend` (anything else, e.g. memory://): staging
  object + move.

`open_store` picks one for a URL; this module holds what they share (the
store's own namespace under `.ckptfs/`, `Staged`, `Source`).

Each daemon stages under `.ckptfs/staging/<daemon id>/` and proves it is
alive with a heartbeat object in `.ckptfs/daemons/`; a starting daemon
removes only the staging (and S3 multipart uploads) of daemons that are not.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fnmatch
import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from ckptfs import runtime
from ckptfs.holes import read_sparse

log = logging.getLogger(__name__)

META = ".ckptfs"  # ckptfs's own objects live under this prefix only (C8)
STAGING = f"{META}/staging"
DAEMONS = f"{META}/daemons"  # one heartbeat object per live daemon
INDEX = f"{META}/index"  # every record in one object, left by a clean exit (manifest.Image)
IMAGE = f"{META}/image"  # every record in one object as of a time; those changed since are found by their times
HEARTBEAT_S = 20.0  # a daemon rewrites its heartbeat this often
HEARTBEAT_DEAD_S = 4 * HEARTBEAT_S  # older than this: the daemon is gone

class StoreError(Exception):
    """A store URL that cannot be used; the message is for the user."""


@dataclass
class Staged:
    """Data uploaded but not yet visible anywhere."""

    size: int
    token: str | None  # the hidden staging path (S3: "mpu:<id>", see `at`); None: not uploaded ahead (published from the snapshot)
    parts: list[dict] = field(default_factory=list)
    at: str | None = None  # S3: a multipart upload left open at this name; completing it publishes, with no copy


# Names a file is likely to be renamed from before its turn: staged under a
# hidden name (published by a copy), not in place (which a rename would make
# upload again). Matched against each component of the path.
TEMPORARY = ("*tmp*", "*.part", "*.partial", "*.incomplete", "*.inprogress")


def temporary(path: str) -> bool:
    return any(fnmatch.fnmatch(part.lower(), pattern) for part in path.split("/") for pattern in TEMPORARY)


def new_daemon_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns():x}"


def _dead_here(daemon: str) -> bool:
    """Whether `daemon` (an id from `new_daemon_id`) ran on this host and its
    process is gone (a zombie, killed but not yet reaped, is gone)."""
    host, _, pid = daemon.rpartition("-")[0].rpartition("-")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    return not runtime.pid_alive(int(pid))


UNKNOWN = object()  # what a record object holds after a call that failed: it may or may not have landed


class Changes:
    """Record objects changed since they were last taken, each with what
    the call that changed it left there (the record written, None once
    deleted, UNKNOWN after a call that failed or overlapped another: read
    it again), and the calls changing them now (manifest.Image). Noted by
    store calls, which run in threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._noted: dict[str, object] = {}
        self._open: dict[str, int] = {}  # object -> calls changing it now
        self._overlapped: set[str] = set()  # objects two calls changed at once: the last to land is not known

    def __len__(self) -> int:
        return len(self._noted)

    def begin(self, objpath: str) -> None:
        with self._lock:
            self._noted[objpath] = UNKNOWN
            n = self._open[objpath] = self._open.get(objpath, 0) + 1
            if n > 1:
                self._overlapped.add(objpath)

    def end(self, objpath: str, left: object = UNKNOWN) -> None:
        with self._lock:
            self._noted[objpath] = UNKNOWN if objpath in self._overlapped else left
            n = self._open.get(objpath, 0) - 1
            if n > 0:
                self._open[objpath] = n
            else:
                self._open.pop(objpath, None)
                self._overlapped.discard(objpath)

    def under_way(self) -> set[str]:
        """The objects a call is changing now."""
        with self._lock:
            return set(self._open)

    def take(self) -> dict[str, object]:
        """Those noted, with what each holds; from now on, noted anew."""
        with self._lock:
            taken, self._noted = self._noted, {}
            return taken

    def give_back(self, taken: dict[str, object]) -> None:
        """Those taken, when what they were taken for failed (those noted
        again since keep what was noted last)."""
        with self._lock:
            self._noted = {**taken, **self._noted}


class Entry(NamedTuple):
    path: str
    size: int
    is_dir: bool


_NAME_PREFIX = uuid.uuid4().hex[:16]
_names = itertools.count()


Into = Callable[[int, int], "memoryview | None"]  # (offset, n): where a read may put up to n bytes itself


class Source:
    """One store file opened for a load: its size, and any range of its bytes
    (a load reads the block a reader waits for first)."""

    size: int
    fd = -1  # a local store file's descriptor (-1: none)

    def read(self, off: int, n: int, into: Into | None = None) -> Iterator[memoryview | bytes]:
        """The bytes `off`..`off + n`, in order, holes as hole pieces; data
        goes straight into `into(offset, k)` where the store can do that."""
        raise NotImplementedError

    def ahead(self, off: int, n: int) -> None:
        """The bytes `off`..`off + n` are likely read next: a local store
        starts reading them from its disk meanwhile."""

    def forget(self, off: int, n: int) -> None:
        """The bytes `off`..`off + n` are not read again: a local store lets
        their pages go from its page cache."""

    def close(self) -> None:
        pass

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _FileSource(Source):
    """A local store file: reads land in the caller's memory, holes stay holes."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size

    def read(self, off: int, n: int, into: Into | None = None) -> Iterator[memoryview | bytes]:
        yield from read_sparse(self.fd, off + n, start=off, into=into)

    def ahead(self, off: int, n: int) -> None:
        if off < self.size:
            os.posix_fadvise(self.fd, off, min(n, self.size - off), os.POSIX_FADV_WILLNEED)

    def forget(self, off: int, n: int) -> None:
        os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def source_of(fd: int) -> Source:
    """A local store file opened already (the caller hands its descriptor
    over): read as `open_source`'s are."""
    try:
        return _FileSource(fd, os.fstat(fd).st_size)
    except BaseException:
        os.close(fd)
        raise




class Backend:
    url: str
    dirs = False  # real directories, movable in one step (local stores)
    # A published file is never written in place, only replaced: a reader may
    # be served from a descriptor of the store's file (`Source.fd`).
    reads_in_place = False
    any_name = True  # holds every path the mount does (else `check_path` says which it cannot)
    # Files smaller than this are not staged ahead: hashed when sealed and
    # written whole at publication, from the snapshot (`Staged` with no token).
    stage_ahead_from = 0
    daemon_id: str = ""  # set by `prepare`: this daemon stages under its own prefix
    # The record objects this daemon changed, from `prepare` on (see manifest.Image).
    records_changed: Changes | None = None

    @property
    def staging(self) -> str:
        return f"{STAGING}/{self.daemon_id or 'shared'}"

    def _staging_name(self) -> str:
        # A random prefix per process, then a counter: unique without a
        # getrandom(2) per name.
        return f"{self.staging}/{_NAME_PREFIX}{next(_names):x}"

    # -- the daemon's own namespace --------------------------------------------
    def unindex(self) -> None:
        """Records change from now on: the manifest index a clean exit left
        is no longer exact, and becomes an image (see manifest.Image)."""
        with contextlib.suppress(FileNotFoundError):
            self.move(INDEX, IMAGE)

    def prepare(self, daemon_id: str, started: float, sole: bool = True) -> None:
        """Called once by the daemon that will write: claim a staging prefix,
        and clear what dead daemons left (staging, multipart uploads). Never
        another live daemon's: verify and watchers must not call this.
        `sole`: no other daemon writes this store, so an upload left open
        at a file's name (no daemon's prefix) before `started` is
        abandoned; not so for a node joining a running cluster, whose
        other nodes stage at files' names."""
        self.daemon_id = daemon_id
        self.records_changed = Changes()
        self.heartbeat()
        self.unindex()
        live = self.live_daemons()
        for path in self.find(STAGING):
            owner = path[len(STAGING) + 1 :].split("/", 1)[0] if "/" in path[len(STAGING) + 1 :] else ""
            if owner not in live:
                self.delete(path)
        self._clean_uploads(live, started, sole)
        for path in self.find(DAEMONS):  # last: until the claim, a dead daemon's heartbeat tells its records apart (storeio.scan)
            if path.rsplit("/", 1)[-1] not in live:
                self.delete(path)

    def heartbeat(self) -> None:
        self.put(f"{DAEMONS}/{self.daemon_id}", json.dumps({"time": time.time(), "pid": os.getpid()}).encode())

    def retire(self) -> None:
        """The daemon exits: its staging and heartbeat go."""
        for path in self.find(self.staging):
            self.delete(path)
        self.delete(f"{DAEMONS}/{self.daemon_id}")

    def live_daemons(self) -> set[str]:
        """Daemons using this store: a recent heartbeat, and on this host a
        running process (a daemon killed a second ago has a fresh heartbeat).
        A question only: the dead ones' heartbeats go at the claim (`prepare`)."""
        live = set()
        now = time.time()
        for path in self.find(DAEMONS):
            daemon = path.rsplit("/", 1)[-1]
            try:
                beat = json.loads(self.read_all(path))["time"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if now - beat < HEARTBEAT_DEAD_S and not _dead_here(daemon):
                live.add(daemon)
        return live

    def _clean_uploads(self, live: set[str], started: float, named: bool) -> None:
        """Abort incomplete multipart uploads that no live daemon owns
        (`named`: those at files' names too, begun before `started`)."""

    # -- data --------------------------------------------------------------------
    def stage(self, pieces: Iterable[memoryview | bytes], size: int, name: str | None = None, elsewhere: bool = False) -> Staged:
        """Upload `pieces` (`size` bytes), invisible: under a hidden name of
        its own. `name`: where it will probably be published (a store that
        can stage there invisibly, S3, does; publishing elsewhere still works,
        from the bytes again). `elsewhere`: another node publishes it (cluster
        mode), without the bytes: every byte is staged now, whatever the size
        (no PUT at publication). What is staged at `name` (`Staged.at`) can
        then be published there only; under another name, its node stages it
        again with no `name`."""
        raise NotImplementedError

    def stage_many(self, files: list[tuple[Iterable[memoryview | bytes], int]]) -> list[Staged]:
        """`stage` of each of many files (pieces, size), with no `name`, in
        order: a group commit's small files not staged ahead."""
        return [self.stage(pieces, size) for pieces, size in files]

    def staged_exists(self, token: str) -> bool:
        """Whether the staged data behind `token` is still there (unpublished)."""
        return self.exists(token)

    def publish(self, staged: Staged, path: str, pieces: Iterable[memoryview | bytes] = (), mode: int | None = None) -> None:
        """Make `staged` visible at `path` atomically (replacing what is
        there), with permission bits `mode` where the store keeps them (local
        stores). `pieces` are the bytes again, for a `Staged` with no token.
        FileNotFoundError: the staged data is gone (published already, or
        cleaned away): the caller checks which."""
        raise NotImplementedError

    def publish_group(self, records: list[tuple[str, bytes]], files: list[tuple[Staged, str, int | None, Iterable]]) -> None:
        """Write every record (`put`), then `publish` every file (staged,
        path, mode, its bytes again for a `Staged` with no token): the
        records before any of the data (see manifest.py)."""
        for path, data in records:
            self.put(path, data)
        for staged, path, mode, pieces in files:
            self.publish(staged, path, pieces, mode=mode)

    def discard(self, staged: Staged) -> None:
        if staged.token is not None:
            self.delete(staged.token)

    def put(self, path: str, data: bytes) -> None:
        """Write a small object whole (ckptfs's own records)."""
        raise NotImplementedError

    def read(self, path: str) -> Iterator[bytes]:
        raise NotImplementedError

    def read_all(self, path: str) -> bytes:
        return b"".join(self.read(path))

    def open_source(self, path: str) -> Source:
        """A file opened for a load: read block by block, in any order."""
        raise NotImplementedError

    def read_many(self, paths: list[str]) -> Iterator[tuple[str, bytes]]:
        """(path, whole contents) of many small files (ckptfs's own records);
        missing ones are left out. Stores do better than one call each."""
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                yield path, self.read_all(path)

    def stat_many(self, paths: list[str]) -> Iterator[tuple[str, os.stat_result]]:
        """(path, what the store's own file system says of it) for entries the
        store keeps modes, owners and times of itself (local stores); missing
        ones, and every one on a store that keeps none (objects), are left out."""
        return iter(())

    def delete(self, path: str) -> None:
        """Remove a file; a missing file is not an error."""
        raise NotImplementedError

    def delete_many(self, paths: list[str]) -> None:
        """`delete` of many files. Stores do better than one call each."""
        for path in paths:
            self.delete(path)

    def move(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def copy(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def chmod(self, path: str, mode: int) -> None:
        """Give `path` these permission bits, where the store keeps them (local stores; object stores have none)."""

    def identity(self, path: str) -> object | None:
        """What tells the entry at `path` from any other (local stores: its
        inode), None if there is none or the store cannot tell."""
        return None

    def hidden_name(self) -> str:
        """A new name under this daemon's staging prefix, to park bytes on
        their way between two names."""
        return self._staging_name()

    def exchange(self, a: str, b: str) -> None:
        """Swap two entries in one step: stores with directories only (an
        object store's exchange moves every file through a hidden name:
        `Publisher._exchange`)."""
        raise NotImplementedError

    def mkdir(self, path: str) -> None:
        """Create a directory where directories exist (local stores only)."""

    def rmdir(self, path: str) -> None:
        """Remove an empty directory where directories exist."""

    def rmdirs(self, paths: list[str]) -> None:
        """`rmdir` of each of `paths`, in their order (deepest first).
        Stores do better than one call each."""
        for path in paths:
            self.rmdir(path)

    def move_dir(self, src: str, dst: str) -> bool:
        """Move a whole directory in one step, if this store can (True)."""
        return False

    def unit_dir(self) -> str | None:
        """A hidden, empty directory to assemble a directory in before
        `move_dir` shows it whole; None where directories are not real."""
        return None

    def walk(self, prefix: str = "") -> Iterator[Entry]:
        """Files and directories under `prefix`, ckptfs's own prefix excluded."""
        raise NotImplementedError

    @contextlib.contextmanager
    def walking(self, many: bool = False) -> Iterator[Callable[[], list[Entry]]]:
        """`walk()` of the whole store, started now and under way beside the
        caller's own work (a restart decodes the store's records meanwhile);
        the callable waits for it. `many`: the store holds many files."""
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckptfs-walk") as pool:
            walked = pool.submit(lambda: list(self.walk()))
            yield walked.result

    def find(self, prefix: str) -> list[str]:
        """Every file under `prefix` (ckptfs's own prefix included)."""
        raise NotImplementedError

    def stamped(self, prefix: str) -> dict[str, float | None]:
        """Every file under `prefix`, with the store's time of its last
        change (None where the store does not say). The store's own clock:
        a local file's ctime (which no one can set back), an object's
        LastModified."""
        raise NotImplementedError

    def stamp(self, path: str) -> float | None:
        """The store's time of the last change of the file `path`."""
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def check_path(self, path: str) -> None:
        """Raise OSError if the store cannot hold an entry at `path`. The
        mount asks before it makes or renames an entry, so that a name the
        store refuses fails at once (EILSEQ, ENAMETOOLONG, EINVAL) rather
        than a file that can never be published. A local store holds every
        name the mount does."""


def parents(paths: Iterable[str]) -> set[str]:
    """Every directory above these paths."""
    out: set[str] = set()
    for d in {p.rpartition("/")[0] for p in paths}:
        while d and d not in out:
            out.add(d)
            d = d.rpartition("/")[0]
    return out


def absolute_url(url: str) -> str:
    """`url` with a local path made absolute (a relative one means the cwd of
    whoever typed it, not of every later reader of the mount's records)."""
    protocol, path = split_protocol(url)
    if protocol in (None, "file", "local"):
        path = os.path.abspath(os.path.expanduser(path))
        return path if protocol is None else f"{protocol}://{path}"
    return url

def split_protocol(url: str) -> tuple[str | None, str]:
    """`s3://bucket/x` -> ("s3", "bucket/x"); a plain path -> (None, it): as
    fsspec splits a store URL, without importing fsspec (0.08 s of every
    `ckptfs mount`, which a local store never needs)."""
    protocol, sep, rest = url.partition("://")
    return (protocol, rest) if sep and len(protocol) > 1 else (None, url)


def local_root(url: str) -> str | None:
    """The directory of a local store URL; None for other stores."""
    protocol, path = split_protocol(url)
    return os.path.abspath(os.path.expanduser(path)) if protocol in (None, "file", "local") else None


def open_store(url: str, storage_options: dict | None = None, create: bool = True) -> Backend:
    """The backend for `url`, checked to be usable.

    A missing local store is created (unless `create` is False: then it is an
    error). Errors name what to fix: an unknown protocol, the package a known
    protocol needs (e.g. s3fs for s3://), a missing bucket.
    """
    if not url or not url.strip():
        raise StoreError("the store URL is empty")
    protocol, rest = split_protocol(url)
    root = local_root(url)
    if root is not None:  # a directory: no fsspec
        if os.path.exists(root) and not os.path.isdir(root):
            raise StoreError(f"store path {root} exists and is not a directory")
        if os.path.islink(root) and not os.path.exists(root):
            raise StoreError(f"store path {root} is a symlink to {os.readlink(root)}, which does not exist (or cannot be reached): "
                             "make that directory first")
        if not create and not os.path.isdir(root):
            raise StoreError(f"store directory {root} does not exist")
        try:
            os.makedirs(root, exist_ok=True)
            from .localstore import LocalBackend

            return LocalBackend(root.rstrip("/") or "/", url)
        except OSError as exc:
            raise StoreError(f"cannot use store directory {root}: {exc.strerror}") from None
    from .objectstore import open_object_store

    return open_object_store(url, protocol, rest, storage_options, create)
