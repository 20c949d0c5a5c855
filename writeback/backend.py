"""The store adapter: one small interface over fsspec file systems.

A `Backend` publishes whole files only (C2): data is first *staged* (a temp
file, a multipart upload or a hidden staging object) and becomes visible at
its final path in one step (rename, multipart completion, server-side move).
Every method is blocking and is called from worker threads, never from the
trio thread. Paths are relative to the store root, with "/" separators.

Staging is never visible and never bound to a final name, so a file renamed
before its turn is published under its new name without uploading it again:

- `LocalBackend` (file://): a temp file in the daemon's staging directory,
  fsynced; published by rename(2). Directories move by one rename(2).
- `S3Backend` (s3://): small files are not uploaded ahead: publication PUTs
  them whole from the sealed snapshot. Large ones are multipart uploads to a
  staging key, published by a server-side copy.
- `FsspecBackend` (anything else, e.g. memory://): staging object + move.

Each daemon stages under `.ckptfs/staging/<daemon id>/` and proves it is
alive with a heartbeat object in `.ckptfs/daemons/`; a starting daemon
removes only the staging (and S3 multipart uploads) of daemons that are not.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import datetime
import errno
import fcntl
import fnmatch
import itertools
import json
import logging
import os
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ckptfs import runtime
from ckptfs.holes import is_hole, read_sparse

from . import listing
from .calls import InTheWay

if TYPE_CHECKING:
    import fsspec

log = logging.getLogger(__name__)

META = ".ckptfs"  # ckptfs's own objects live under this prefix only (C8)
STAGING = f"{META}/staging"
DAEMONS = f"{META}/daemons"  # one heartbeat object per live daemon
INDEX = f"{META}/index"  # every record in one object, left by a clean exit (manifest.Image)
IMAGE = f"{META}/image"  # every record in one object as of a time; those changed since are found by their times
HEARTBEAT_S = 20.0  # a daemon rewrites its heartbeat this often
HEARTBEAT_DEAD_S = 4 * HEARTBEAT_S  # older than this: the daemon is gone
PART_SIZE = 16 << 20  # grown for huge files to stay under S3's 10,000 parts
PART_CONCURRENCY = 4  # S3: parts of one file in flight at once (each held as one copy meanwhile)
SMALL_PUT = 8 << 20  # object stores: up to this size, one PUT at publish time
MAX_OBJECT = 5 << 40  # S3: the largest object
MAX_KEY = 1024  # S3: the longest key, in bytes of UTF-8
READ_MANY_BATCH = 500  # object stores: records fetched concurrently per batch
GROUP_CONCURRENCY = 16  # object stores: requests of one group commit's step in flight together
DELETE_MANY = 1000  # S3: keys deleted by one request (its most)
READ_MANY_TRIES = 4  # records a burst of reads could not get (an overloaded store's 503 or 500) are read again, together
# Local stores: a staged file this big is fsynced at once, by its upload worker
# (in parallel with others); a smaller one at publication, where a group of
# them shares one syncfs (`LocalBackend.publish_group`).
SYNCED_AT_PUBLISH = 1 << 20


class StoreError(Exception):
    """A store URL that cannot be used; the message is for the user."""


@dataclass
class Staged:
    """Data uploaded but not yet visible anywhere."""

    size: int
    token: str | None  # the hidden staging path (S3: "mpu:<id>", see `at`); None: not uploaded ahead (published from the snapshot)
    parts: list[dict] = field(default_factory=list)
    at: str | None = None  # S3: a multipart upload left open at this name; completing it publishes, with no copy


MPU = "mpu:"  # a staging token naming an open multipart upload
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


class _ObjectSource(Source):
    """An object (or any fsspec file): one ranged request per read."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.fs, self.path = fs, path
        self.size = int(_file_info(fs.info(path), path)["size"])

    def read(self, off: int, n: int, into: Into | None = None) -> Iterator[memoryview | bytes]:
        data = self.fs.cat_file(self.path, start=off, end=off + n)
        if len(data) != n:
            raise OSError(errno.EIO, f"{self.path}: asked for {n} bytes at {off}, the store gave {len(data)}")
        yield data


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


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _OpenDirs:
    """Descriptors of the directories a run of calls goes to, opened once
    each when the calls come a directory at a time, and only the last few
    kept open: never one per directory of thousands (the daemon ran out of
    descriptors)."""

    KEEP = 16

    def __init__(self, opener: Callable[[str], int]) -> None:
        self._open = opener
        self._fds: collections.OrderedDict[str, int] = collections.OrderedDict()

    def get(self, head: str) -> int:
        """Valid until the next call."""
        fd = self._fds.get(head)
        if fd is not None:
            self._fds.move_to_end(head)
            return fd
        if len(self._fds) >= self.KEEP:
            os.close(self._fds.popitem(last=False)[1])
        fd = self._fds[head] = self._open(head)
        return fd

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])


class FileInTheWay(InTheWay, NotADirectoryError):
    """A file in the store where a path needs a directory: permanent for a
    publication (InTheWay), and, as any ENOTDIR, nothing there to read,
    find or delete."""


class SymlinkInStore(OSError):
    """A symlink where a local store should have a directory (ELOOP)."""


class LocalBackend(Backend):
    """A directory. Nothing in it is reached through a symlink: every path is
    walked from the root one component at a time with O_NOFOLLOW, and calls
    act on the last component relative to its parent's descriptor (a planted
    `store/d -> /elsewhere` cannot make a publish write outside the store,
    nor `store/x -> /etc/shadow` be read as a file). ckptfs keeps symlinks as
    manifest records, so a symlink in the store is never its own: it is not
    listed, and one in the way of a path is an error (ELOOP)."""

    dirs = True
    reads_in_place = True
    stage_ahead_from = 64 << 10

    def __init__(self, root: str, url: str) -> None:
        self.root = root
        self.url = url

    def prepare(self, daemon_id: str, started: float, sole: bool = True) -> None:
        super().prepare(daemon_id, started, sole)
        with self._at(f"{STAGING}/x") as (staging, _):
            for name in os.listdir(staging):  # emptied directories of dead daemons
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=staging)

    def _dir(self, path: str, create: bool = False) -> int:
        """A descriptor of directory `path`, reached without following a
        symlink, and never above the store's root; missing components are
        made if `create`."""
        _below_root(path)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        if path.strip("/"):
            below = _open_beneath(fd, path, _DIR)  # one call for the whole path, where the kernel can
            if below is not None:
                os.close(fd)
                return below
        try:
            # One component at a time: where openat2 is missing, to make what
            # is missing, and to tell why the path cannot be reached.
            for part in filter(None, path.split("/")):
                try:
                    try:
                        below = os.open(part, _DIR, dir_fd=fd)
                    except FileNotFoundError:
                        if not create:
                            raise
                        with contextlib.suppress(FileExistsError):  # 0700 until its record gives it the mount's mode (never more open)
                            os.mkdir(part, 0o700, dir_fd=fd)
                        below = os.open(part, _DIR, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise SymlinkInStore(errno.ELOOP, "a symlink in the store is in the way (ckptfs never follows one)", path) from None
                    if exc.errno == errno.ENOTDIR and not path.startswith(META + "/"):
                        raise FileInTheWay(errno.ENOTDIR, f"the store has a file at {part!r}, where the mount has a directory (made there by "
                                           "another tool?)", path) from None
                    raise
                os.close(fd)
                fd = below
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def _at(self, path: str, create: bool = False) -> Iterator[tuple[int, str]]:
        """(descriptor of the parent directory, last component) of `path`."""
        head, _, name = path.rpartition("/")
        _below_root(name)
        fd = self._dir(head, create)
        try:
            yield fd, name
        finally:
            os.close(fd)

    def stage(self, pieces: Iterable[memoryview | bytes], size: int, name: str | None = None, elsewhere: bool = False) -> Staged:
        return self.stage_many([(pieces, size)])[0]

    def stage_many(self, files: list[tuple[Iterable[memoryview | bytes], int]]) -> list[Staged]:
        """The staging directory is opened once for them all (reached from
        the store's root for each file, that was a tenth of a group commit's
        time)."""
        d = self._dir(self.staging, create=True)
        try:
            out = []
            for pieces, size in files:
                large = not 0 <= size < SYNCED_AT_PUBLISH
                out.append(Staged(size, self._write_staged(d, pieces, sync=large, direct=large)))
            return out
        finally:
            os.close(d)

    def _write_staged(self, d: int, pieces: Iterable[memoryview | bytes], sync: bool, direct: bool = False) -> str:
        """A new file in the staging directory (open as `d`); its token."""
        tmp = self._staging_name()
        _write_new(d, tmp.rpartition("/")[2], pieces, sync, direct)
        return tmp

    def publish(self, staged: Staged, path: str, pieces: Iterable[memoryview | bytes] = (), mode: int | None = None) -> None:
        if staged.token is None:  # a small file, written whole now and synced at once
            d = self._dir(self.staging, create=True)
            try:
                tmp = self._write_staged(d, pieces, sync=True)
            finally:
                os.close(d)
            self._replace(tmp, path, mode)
            return
        self._replace(staged.token, path, mode, sync_src=0 <= staged.size < SYNCED_AT_PUBLISH)

    def publish_group(self, records: list[tuple[str, bytes]], files: list[tuple[Staged, str, int | None, Iterable]]) -> None:
        """Group commit: the records and the small files are written, one
        syncfs makes them (and files staged without fsync) durable, every
        record and file is renamed into place, and a second syncfs makes the
        renames durable: two syncs for the group, not three fsyncs a file.
        Each directory is opened once for the group."""
        dirs: dict[str, int] = {}  # where files are written, then renamed from: open until the end
        dests = _OpenDirs(lambda head: self._dir(head, create=True))  # where they go: the last few open

        def at(path: str) -> tuple[int, str]:
            head, _, name = path.rpartition("/")
            if head not in dirs:
                dirs[head] = self._dir(head, create=True)
            return dirs[head], name

        def to(path: str) -> tuple[int, str]:
            head, _, name = path.rpartition("/")
            return dests.get(head), name

        written: list[tuple[int, str]] = []  # not renamed into place yet: removed if the group fails
        try:
            for _path, data in records:
                written.append(at(self._staging_name()))
                _write_new(*written[-1], [data], sync=False)
            sources = []
            for staged, _path, _mode, pieces in files:
                if staged.token is None:
                    written.append(at(self._staging_name()))
                    _write_new(*written[-1], pieces, sync=False)
                    sources.append(written[-1])
                else:
                    sources.append(at(staged.token))
            self.sync()
            moves = [(src, path, None) for src, (path, _data) in zip(written, records, strict=False)]  # records stay 0600
            moves += [(src, path, mode) for src, (_staged, path, mode, _pieces) in zip(sources, files, strict=True)]
            for (sd, sname), path, mode in moves:
                dd, dname = to(path)
                if mode is not None:
                    os.chmod(sname, mode & 0o777, dir_fd=sd)  # never set-ID bits in the store
                try:
                    os.rename(sname, dname, src_dir_fd=sd, dst_dir_fd=dd)
                except IsADirectoryError:
                    _rmdir_in_the_way(dd, dname, path)
                    os.rename(sname, dname, src_dir_fd=sd, dst_dir_fd=dd)
            written = []
        finally:
            for d, name in written:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=d)
            for fd in dirs.values():
                os.close(fd)
            dests.close()
        self.sync()

    def sync(self) -> None:
        """Make everything written to the store's file system durable (syncfs(2))."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if _libc.syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), self.root)
        finally:
            os.close(fd)

    def _replace(self, src: str, dst: str, mode: int | None = None, sync: bool = True, sync_src: bool = False) -> None:
        """Rename `src` over `dst`; `sync`: made durable (the directory
        fsynced), `sync_src`: the file's bytes first (staged unsynced)."""
        with self._at(src) as (sd, sname), self._at(dst, create=True) as (dd, dname):
            if sync_src:
                fd = os.open(sname, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sd)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            if mode is not None:
                os.chmod(sname, mode & 0o777, dir_fd=sd)  # never set-ID bits in the store
            if _kind(dname, dd) == stat.S_IFDIR:
                _rmdir_in_the_way(dd, dname, dst)
            os.rename(sname, dname, src_dir_fd=sd, dst_dir_fd=dd)
            if sync:
                os.fsync(dd)

    def put(self, path: str, data: bytes) -> None:
        self.publish(self.stage([data], len(data)), path, mode=0o600)  # ckptfs's own records: nobody else's business

    def read(self, path: str) -> Iterator[bytes]:
        with self._at(path) as (d, name):
            # O_NONBLOCK: a FIFO planted in the store must not block the open
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
        with open(fd, "rb", buffering=0):
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            yield from read_sparse(fd, st.st_size)  # holes stay holes on the way back

    def open_source(self, path: str) -> Source:
        with self._at(path) as (d, name):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
        except BaseException:
            os.close(fd)
            raise
        return _FileSource(fd, st.st_size)

    def read_many(self, paths: list[str]) -> Iterator[tuple[str, bytes]]:
        """Each directory is opened once, not once per file (a restart reads
        one record per file in the store), when `paths` come a directory at
        a time (sorted): the last few directories stay open, never all of
        them (thousands ran the daemon out of descriptors)."""
        heads = _OpenDirs(self._dir)
        try:
            for path in paths:
                head, _, name = path.rpartition("/")
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=heads.get(head))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                with open(fd, "rb", buffering=0) as f:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        raise OSError(errno.EINVAL, "not a regular file", path)
                    yield path, f.read()
        finally:
            heads.close()

    def stat_many(self, paths: list[str]) -> Iterator[tuple[str, os.stat_result]]:
        """As `read_many`, each directory opened once when `paths` come a
        directory at a time; a symlink is not followed (and is no entry of
        the store's)."""
        heads = _OpenDirs(self._dir)
        try:
            for path in paths:
                head, _, name = path.rpartition("/")
                try:
                    yield path, os.stat(name, dir_fd=heads.get(head), follow_symlinks=False)
                except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
                    continue
        finally:
            heads.close()

    def delete(self, path: str) -> None:
        # Under a symlink or a file nothing of ours can be: nothing to delete.
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, SymlinkInStore), self._at(path) as (d, name):
            os.unlink(name, dir_fd=d)

    def move(self, src: str, dst: str) -> None:
        self._replace(src, dst)

    def copy(self, src: str, dst: str) -> None:
        with self._at(src) as (d, name):
            mode = os.stat(name, dir_fd=d, follow_symlinks=False).st_mode
        self.publish(self.stage(self.read(src), -1), dst, mode=mode)

    def chmod(self, path: str, mode: int) -> None:
        with self._at(path) as (d, name):
            if _kind(name, d) in (stat.S_IFREG, stat.S_IFDIR):  # never through a symlink
                os.chmod(name, mode, dir_fd=d)

    def identity(self, path: str) -> object | None:
        try:
            with self._at(path) as (d, name):
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
            return None
        return st.st_dev, st.st_ino

    def exchange(self, a: str, b: str) -> None:
        """Files or directories, in one rename(2)."""
        with self._at(a) as (da, na), self._at(b) as (db, nb):
            _renameat2(da, na, db, nb, RENAME_EXCHANGE)
            os.fsync(da)
            os.fsync(db)

    def mkdir(self, path: str) -> None:
        os.close(self._dir(path, create=True))

    def rmdir(self, path: str) -> None:
        with contextlib.suppress(OSError), self._at(path) as (d, name):
            os.rmdir(name, dir_fd=d)

    def move_dir(self, src: str, dst: str) -> bool:
        with self._at(src) as (sd, sname), self._at(dst, create=True) as (dd, dname):
            try:
                os.rename(sname, dname, src_dir_fd=sd, dst_dir_fd=dd)  # replaces an empty directory
            except OSError as exc:
                if exc.errno == errno.ENOENT and _kind(dname, dd) == stat.S_IFDIR:
                    return True  # moved already (an earlier attempt whose answer was lost)
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOENT):
                    return False  # something is in the way, or nothing to move: the caller moves members
                raise
            os.fsync(dd)
            os.fsync(sd)
        return True

    def unit_dir(self) -> str:
        path = f"{self.staging}/d-{uuid.uuid4().hex}"
        os.close(self._dir(path, create=True))
        return path

    def walk(self, prefix: str = "") -> Iterator[Entry]:
        """Directories and regular files under `prefix` (ckptfs's own `.ckptfs/`
        left out); symlinks and special files are not the store's."""
        try:
            with self._at(prefix) as (d, name):
                kind = _kind(name, d) if prefix else stat.S_IFDIR
                if kind == stat.S_IFREG:  # a single file
                    yield Entry(prefix, os.stat(name, dir_fd=d, follow_symlinks=False).st_size, False)
                    return
        except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
            return
        if kind != stat.S_IFDIR:
            return
        yield from self._tree(prefix, skip_meta=True)

    def _tree(self, prefix: str, skip_meta: bool, dirs: bool = True) -> Iterator[Entry]:
        """Top down, depth first (`listing.tree`): each directory, then its
        files, then its directories the same way."""
        rel = prefix.strip("/")
        if skip_meta and (rel == META or rel.startswith(META + "/")):
            return
        try:
            top = self._dir(rel)
        except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
            return
        for path, size, is_dir in listing.tree(rel, top, META if skip_meta and not rel else "", dirs, _cannot_list):
            yield Entry(path, size, is_dir)

    @contextlib.contextmanager
    def walking(self, many: bool = False) -> Iterator[Callable[[], list[Entry]]]:
        if not many:
            with super().walking() as listed:
                yield listed
            return
        try:
            top = self._dir("")
        except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
            yield lambda: []
            return
        aside = listing.Aside("", top, META)  # on a core of its own (see `listing`)
        try:
            yield lambda: list(map(Entry._make, aside.result(_cannot_list)))
        finally:
            aside.close()

    def find(self, prefix: str) -> list[str]:
        return [e.path for e in self._tree(prefix, skip_meta=False, dirs=False)]

    def stamped(self, prefix: str) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        try:
            top = self._dir(prefix)
        except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
            return out
        try:
            for rel, _, filenames, fd in os.fwalk(".", dir_fd=top):  # never follows symlinks
                rel = os.path.normpath(os.path.join(prefix, rel))
                rel = "" if rel == "." else rel
                for n in filenames:
                    with contextlib.suppress(FileNotFoundError):
                        st = os.stat(n, dir_fd=fd, follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode):
                            out[f"{rel}/{n}" if rel else n] = st.st_ctime_ns / 1e9
        finally:
            os.close(top)
        return out

    def stamp(self, path: str) -> float | None:
        with self._at(path) as (d, name):
            return os.stat(name, dir_fd=d, follow_symlinks=False).st_ctime_ns / 1e9

    def exists(self, path: str) -> bool:
        try:
            with self._at(path) as (d, name):
                return _kind(name, d) is not None
        except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
            return False


def _write_new(dir_fd: int, name: str, pieces: Iterable[memoryview | bytes], sync: bool, direct: bool = False) -> None:
    """A new file `name` (0600: a published file takes its mount
    counterpart's mode then, never more open) holding `pieces`; holes are
    kept (the store file stays sparse).

    `direct`: pieces aligned to pages (whole chunks of a snapshot) are
    written with O_DIRECT, straight from the daemon's memory to the disk. A
    buffered write of 2 GiB costs this VM 1-3 s of CPU copying into the page
    cache, a direct one 0.1 s, and the store's bytes need not fill the page
    cache of the machine that trains. From the first piece that is not
    aligned on (or on a file system that refuses O_DIRECT: tmpfs), writes
    are buffered."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    try:
        direct = direct and _set_direct(fd, True)
        off = end = 0  # end: where the bytes written so far end (a new file: its size)
        for piece in pieces:
            if is_hole(piece):
                off += len(piece)
                continue
            view = memoryview(piece).cast("B")
            if direct and not (off % _PAGE == 0 and len(view) % _PAGE == 0 and _address(view) % _PAGE == 0):
                direct = _set_direct(fd, False)
            while view:
                try:
                    n = os.pwrite(fd, view, off)
                except OSError as exc:
                    if not direct or exc.errno != errno.EINVAL:
                        raise
                    direct = _set_direct(fd, False)  # alignment the device wants is larger: buffered from here
                    continue
                view, off = view[n:], off + n
            end = off
        if off > end:  # it ends in a hole
            os.ftruncate(fd, off)
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise
    os.close(fd)


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; whether it is on now."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return on


def _address(view: memoryview) -> int:
    """Where `view`'s bytes are in memory (-1: unknown, read-only)."""
    if view.readonly:
        return -1
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _cannot_list(path: str, why: str) -> None:
    log.warning("cannot list %s in the store (%s): what it holds is not shown", path, why)


def _kind(name: str, dir_fd: int) -> int | None:
    """The file type of `name` in `dir_fd` (S_IFREG, S_IFDIR, S_IFLNK, ...), not following a symlink; None if missing."""
    try:
        return stat.S_IFMT(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return None


RENAME_EXCHANGE = 2


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_SYS_OPENAT2 = 437  # the same number on every architecture (Linux 5.6)
# No symlink, no magic link, no ".." above the root, no other mount.
_RESOLVE = 0x01 | 0x02 | 0x04 | 0x08  # RESOLVE_NO_XDEV | NO_MAGICLINKS | NO_SYMLINKS | BENEATH
_openat2_works = True


def _below_root(path: str) -> None:
    """EINVAL for a path with a `.` or `..` component: every path the
    daemon and the tools give a store is relative to its root and clean; one
    that is not must never reach above the root (openat2's RESOLVE_BENEATH
    refuses it, the walk by components would not)."""
    if "." in path and any(part in (".", "..") for part in path.split("/")):
        raise OSError(errno.EINVAL, "a store path with '.' or '..' in it", path)


def _open_beneath(dir_fd: int, path: str, flags: int) -> int | None:
    """openat2(2) of `path` below `dir_fd`, following no symlink: a
    descriptor, or None if it failed for any reason (or the kernel has no
    openat2), for the caller's component-by-component walk to redo it."""
    global _openat2_works
    if not _openat2_works:
        return None
    how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE)
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd >= 0:
        return fd
    if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # an old kernel, or a seccomp filter
        _openat2_works = False
    return None


def _rmdir_in_the_way(dir_fd: int, name: str, path: str) -> None:
    """A directory where a file goes: an empty one left by the mount goes;
    one holding what another tool made there stays, and the file cannot."""
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise InTheWay(exc.errno, "the store has a directory here, not empty, where the mount has a file (made there by another tool?)",
                           path) from None
        raise


def _renameat2(dir_a: int, a: str, dir_b: int, b: str, flags: int) -> None:
    if _libc.renameat2(dir_a, os.fsencode(a), dir_b, os.fsencode(b), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), a)


class FsspecBackend(Backend):
    """Any fsspec file system: stage to a hidden object, publish by moving it."""

    WHOLE: dict = {}  # options of `cat_file` when a small object is read whole
    any_name = False

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url

    def check_path(self, path: str) -> None:
        try:
            self._abs(path).encode()
        except UnicodeEncodeError:  # a byte that is not UTF-8, carried by os.fsdecode as a surrogate escape
            raise OSError(errno.EILSEQ, "an object store's names are UTF-8 text; this name is not", path) from None

    def _abs(self, path: str) -> str:
        if not path:
            return self.root
        full = f"{self.root}/{path}"
        # Object stores' file systems read some names as URLs: s3fs takes
        # `x?versionId=1` for a version of `x` (and would write `x`), gcsfs
        # `x#1` for a generation. Such a name is one this store cannot take.
        split = getattr(self.fs, "split_path", None)
        if ("?" in path or "#" in path) and split is not None:
            bucket, key = split(full)[:2]
            if f"{bucket}/{key}" != full:
                raise OSError(errno.EINVAL, f"the store cannot take this name: {type(self.fs).__name__} reads it as {bucket}/{key}", path)
        return full

    def stage(self, pieces: Iterable[memoryview | bytes], size: int, name: str | None = None, elsewhere: bool = False) -> Staged:
        tmp = self._staging_name()
        with self.fs.open(self._abs(tmp), "wb") as f:
            for piece in pieces:
                f.write(piece)
        return Staged(size, tmp)

    def publish(self, staged: Staged, path: str, pieces: Iterable[memoryview | bytes] = (), mode: int | None = None) -> None:
        if staged.token is None:  # not staged ahead: written whole now
            with self.fs.open(self._abs(path), "wb") as f:
                for piece in pieces:
                    f.write(piece)
            return
        self.move(staged.token, path)

    def put(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(self._abs(path), data)

    def publish_group(self, records: list[tuple[str, bytes]], files: list[tuple[Staged, str, int | None, Iterable]]) -> None:
        """Every record, then every file (`Backend.publish_group`), each
        step's requests in flight together, GROUP_CONCURRENCY at a time: one
        after another, a group of small files on S3 went at 80 files a second."""
        with concurrent.futures.ThreadPoolExecutor(GROUP_CONCURRENCY, thread_name_prefix="ckptfs-group") as pool:
            for step in ([pool.submit(self.put, path, data) for path, data in records],
                         [pool.submit(self.publish, staged, path, pieces, mode) for staged, path, mode, pieces in files]):
                for done in step:
                    done.result()  # the first error fails the group (the records of a step always before its files)

    def read(self, path: str) -> Iterator[bytes]:
        with self.fs.open(self._abs(path), "rb") as f:
            _file_info(getattr(f, "details", None) or {}, path)
            while chunk := f.read(8 << 20):
                yield chunk

    def read_all(self, path: str) -> bytes:
        return self.fs.cat_file(self._abs(path), **self.WHOLE)

    def open_source(self, path: str) -> Source:
        return _ObjectSource(self.fs, self._abs(path))

    def read_many(self, paths: list[str]) -> Iterator[tuple[str, bytes]]:
        """Fetched concurrently (fsspec's `cat` of many paths: one request
        each, in flight together on async stores such as S3)."""
        for i in range(0, len(paths), READ_MANY_BATCH):
            batch = paths[i : i + READ_MANY_BATCH]
            got: dict[str, object] = {}
            todo = batch
            for tries in range(1, READ_MANY_TRIES + 1):
                found = self.fs.cat([self._abs(p) for p in todo], on_error="return", **self.WHOLE)
                again = []
                for path in todo:
                    data = found.get(self._abs(path))
                    if isinstance(data, Exception) and not isinstance(data, FileNotFoundError | PermissionError) and tries < READ_MANY_TRIES:
                        again.append(path)
                    else:
                        got[path] = data
                if not again:
                    break
                log.info("reading %d records again (try %d): %s", len(again), tries + 1, found.get(self._abs(again[0])))
                time.sleep(0.1 * 2**tries)
                todo = again
            for path in batch:
                data = got.get(path)
                if isinstance(data, FileNotFoundError) or data is None:
                    continue
                if isinstance(data, BaseException):
                    raise data
                yield path, data  # type: ignore[misc]

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._abs(path))

    # One object to exactly the key named: `mv` and `copy` put it *inside* a
    # destination the store lists as a directory (SeaweedFS keeps emptied
    # folders: a file taking the name of a directory that moved away).
    def move(self, src: str, dst: str) -> None:
        self.fs.cp_file(self._abs(src), self._abs(dst))
        self.fs.rm_file(self._abs(src))

    def copy(self, src: str, dst: str) -> None:
        self.fs.cp_file(self._abs(src), self._abs(dst))

    def walk(self, prefix: str = "") -> Iterator[Entry]:
        base = self._abs(prefix)
        try:
            if prefix:
                found = list(self.fs.find(base, detail=True).values())
            else:  # the top level first, so that ckptfs's own objects (a record per file) are never listed
                found = []
                for info in self.fs.ls(base, detail=True):  # an object `a` and objects under `a/`: both listed
                    full = info["name"].rstrip("/")
                    if full.rsplit("/", 1)[-1] == META:
                        continue
                    if info.get("type") == "directory":
                        found.extend(self.fs.find(full, detail=True).values())
                    else:
                        found.append(info)
        except FileNotFoundError:
            return
        files = {}
        for info in found:
            full = info["name"]
            rel = full[len(self.root) :].lstrip("/") if full.startswith(self.root) else full
            # A store with folders (SeaweedFS) lists an emptied folder, and a
            # console's "create folder" leaves a key `d/`: no file, and no
            # directory of ours.
            if info.get("type") == "directory" or full.endswith("/") or not rel or rel == META or rel.startswith(META + "/"):
                continue
            files[rel] = Entry(rel, int(info.get("size") or 0), False)
        # An object store's directories are those its files imply (and
        # those with records). An object `a` beside objects under `a/` is
        # listed as both a file and a directory: `storeio.scan` picks one.
        entries = [*files.values(), *(Entry(d, 0, True) for d in parents(files))]
        yield from sorted(entries, key=lambda e: (e.path, not e.is_dir))

    def find(self, prefix: str) -> list[str]:
        try:
            found = self.fs.find(self._abs(prefix), detail=True)
        except FileNotFoundError:
            return []
        # Stores with folders (SeaweedFS) list an emptied folder as an entry.
        return [p[len(self.root) :].lstrip("/") for p, info in found.items() if info.get("type") != "directory"]

    def stamped(self, prefix: str) -> dict[str, float | None]:
        try:
            found = self.fs.find(self._abs(prefix), detail=True)
        except FileNotFoundError:
            return {}
        return {p[len(self.root) :].lstrip("/"): _stamp_of(info) for p, info in found.items() if info.get("type") != "directory"}

    def stamp(self, path: str) -> float | None:
        return _stamp_of(self.fs.info(self._abs(path)))

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._abs(path))


class S3Backend(FsspecBackend):
    """S3: small files are PUT whole at publication (from the snapshot, so
    nothing is uploaded twice). A large file is a multipart upload left open
    at the name it will probably be published under, and completing it (one
    atomic step) publishes it: no copy. Published under another name (renamed
    before its turn), the open upload is aborted and the bytes uploaded there
    from the snapshot. A file whose name looks temporary (`TEMPORARY`: Orbax's
    `*.orbax-checkpoint-tmp-*` directories, `*.tmp`) is likely to be renamed,
    so it is uploaded whole to a hidden staging key instead and published by a
    server-side copy, which is cheaper than uploading again.

    Cluster mode: a following node stages its large files at their names
    too, and the publishing node completes the upload at their turn. One
    renamed before its turn can be uploaded again only by its node, which
    holds the bytes: the publishing node aborts the upload and asks that
    node to stage the file again, under a hidden key (`Publisher._staged_again`)."""

    # s3fs asks for an object's size (a HEAD request) before reading it whole,
    # to fetch a large one in ranges side by side; ckptfs reads whole only its
    # records and manifests: one GET each (a restart that reads every record
    # made twice the requests).
    WHOLE = {"max_concurrency": 1}

    def check_path(self, path: str) -> None:
        super().check_path(path)
        size = len(self._bucket_key(path)[1].encode())
        if size > MAX_KEY:
            raise OSError(errno.ENAMETOOLONG, f"S3 keys are at most {MAX_KEY} bytes; this path makes one of {size} (with the store's prefix)", path)

    def _bucket_key(self, path: str) -> tuple[str, str]:
        bucket, _, key = self._abs(path).partition("/")
        return bucket, key

    def stage(self, pieces: Iterable[memoryview | bytes], size: int, name: str | None = None, elsewhere: bool = False) -> Staged:
        if size > MAX_OBJECT:  # refused before a byte is read or sent (a sparse `truncate -s 1P` costs nothing in RAM)
            raise OSError(errno.EFBIG, f"S3 takes objects of at most {MAX_OBJECT >> 40} TiB; this file has {size} bytes", name)
        if elsewhere and 0 <= size <= SMALL_PUT:
            tmp = self._staging_name()
            self.fs.pipe_file(self._abs(tmp), b"".join(bytes(p) for p in pieces))
            return Staged(size, tmp)
        if 0 <= size <= SMALL_PUT:
            for _ in pieces:  # hashed on the way by the caller; published from the snapshot
                pass
            return Staged(size, None)
        if name is not None and not temporary(name):
            upload_id, parts = self._upload(name, pieces, size, complete=False)
            return Staged(size, f"{MPU}{upload_id}", parts, at=name)
        tmp = self._staging_name()
        _, parts = self._upload(tmp, pieces, size, complete=True)
        return Staged(size, tmp, parts)

    def _upload(self, path: str, pieces: Iterable[memoryview | bytes], size: int, complete: bool) -> tuple[str, list[dict]]:
        """A multipart upload of `pieces` to `path`, up to PART_CONCURRENCY
        parts in flight at once; completed (visible) if asked."""
        bucket, key = self._bucket_key(path)
        upload_id = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        part_size = max(PART_SIZE, -(-size // 9000))  # size -1 (not known yet): grown as parts go, below
        parts: list[dict] = []
        inflight: set[concurrent.futures.Future] = set()

        def settle(until: int) -> None:
            """Wait until at most `until` parts are in flight (raises a part's error)."""
            nonlocal inflight
            while len(inflight) > until:
                done, inflight = concurrent.futures.wait(inflight, return_when=concurrent.futures.FIRST_COMPLETED)
                parts.extend(f.result() for f in done)

        pool = concurrent.futures.ThreadPoolExecutor(PART_CONCURRENCY, thread_name_prefix="ckptfs-part")
        try:
            n = 0

            def send(data: bytes) -> None:
                nonlocal n
                settle(PART_CONCURRENCY - 1)  # at most PART_CONCURRENCY parts held in memory
                n += 1
                inflight.add(pool.submit(self._part, bucket, key, upload_id, n, data))

            views: list[memoryview] = []  # the next part's bytes, as views of the snapshot: joined in one copy
            have = 0
            for piece in pieces:
                view = memoryview(piece).cast("B")
                if size < 0:  # S3 takes at most 10,000 parts: 1,000 of each size, growing (880 GiB in all)
                    part_size = PART_SIZE * (1 + n // 1000)
                while have + len(view) >= part_size:
                    k = part_size - have
                    views.append(view[:k])
                    send(b"".join(views))
                    views, have, view = [], 0, view[k:]
                if view:
                    views.append(view)
                    have += len(view)
            if views or not n:
                send(b"".join(views))
            settle(0)
            parts.sort(key=lambda p: p["PartNumber"])
            if complete:
                self._complete(bucket, key, upload_id, parts)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # nothing may still upload into the aborted upload
            with contextlib.suppress(Exception):
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            raise
        finally:
            pool.shutdown(wait=False)
        return upload_id, parts

    def _complete(self, bucket: str, key: str, upload_id: str, parts: list[dict]) -> None:
        for cleared in (False, True):
            try:
                self.fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})
                return
            except Exception as exc:
                if "NoSuchUpload" in f"{type(exc).__name__} {exc}":  # completed already (or aborted): the caller checks which
                    raise FileNotFoundError(errno.ENOENT, "no such multipart upload", key) from None
                if cleared or not self._clear_emptied_folder(bucket, key):
                    raise

    def rmdir(self, path: str) -> None:
        """Delete the folder key `path/`: a store with folders (SeaweedFS)
        keeps an emptied folder for minutes, and a file taking its name then
        can never be completed there (`_clear_emptied_folder`); a PUT over
        it makes an object that no completion can replace either, for good.
        Deleted at once, the folder is gone before anything takes its name.
        Elsewhere it deletes a console's folder key, or nothing (one
        request per directory removed). A folder that still holds objects
        is not touched: stores delete exactly the key named."""
        if path:
            bucket, key = self._bucket_key(path)
            self.fs.call_s3("delete_object", Bucket=bucket, Key=f"{key}/")
            self.fs.invalidate_cache(self._abs(path))

    def rmdirs(self, paths: list[str]) -> None:
        """The folder keys of a directory moved away member by member, and
        of the directories in it: one DeleteObjects request per DELETE_MANY,
        which takes them in order (deepest first: SeaweedFS deletes a
        folder only once nothing is left in it)."""
        keys = [self._bucket_key(path) for path in paths if path]
        for i in range(0, len(keys), DELETE_MANY):
            batch = keys[i : i + DELETE_MANY]
            try:
                self.fs.call_s3("delete_objects", Bucket=batch[0][0], Delete={"Objects": [{"Key": f"{key}/"} for _, key in batch], "Quiet": True})
            except Exception as exc:  # a store without DeleteObjects: one request each
                log.debug("deleting %d folder keys together failed (%s): one at a time", len(batch), exc)
                for bucket, key in batch:
                    self.fs.call_s3("delete_object", Bucket=bucket, Key=f"{key}/")
        self.fs.invalidate_cache()

    def _clear_emptied_folder(self, bucket: str, key: str) -> bool:
        """Remove a folder at `key` that holds no object; True if there was one.

        Stores with folders (SeaweedFS) keep a folder after its last object
        goes, and remove it minutes later (one holding emptied folders only
        after they went, and a console's folder key never). Until then they
        refuse to complete an upload at its name: an internal error at every
        try ("existing entry is a directory"), so a large file taking the
        name of a directory that was moved or removed was retried for ever,
        and everything after it waited. The mount's own directories are
        deleted as they go (`rmdir`); this clears what is left by others (a
        console's folder key) or by a crash. Asked only after a completion
        failed; on a store without folders the listing finds nothing. A
        folder holding an object is left alone (the store then holds files
        under a file's name: `storeio.scan` warns of them)."""
        folders: list[str] = []
        todo = [f"{key}/"]
        while todo:
            prefix = todo.pop()
            kwargs = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
            while True:
                page = self.fs.call_s3("list_objects_v2", **kwargs)
                if any(obj["Key"] != prefix for obj in page.get("Contents") or []):
                    return False
                if (page.get("Contents") or page.get("CommonPrefixes")) and folders[-1:] != [prefix]:
                    folders.append(prefix)  # listed itself, or folders under it
                todo.extend(sub["Prefix"] for sub in page.get("CommonPrefixes") or [])
                if not page.get("IsTruncated"):
                    break
                kwargs["ContinuationToken"] = page["NextContinuationToken"]
        if not folders:
            return False
        for prefix in reversed(folders):  # each folder after those under it
            self.fs.call_s3("delete_object", Bucket=bucket, Key=prefix)
        self.fs.invalidate_cache()
        log.info("removed the emptied folder %s that the store kept at the name of a file", key)
        return True

    def _part(self, bucket: str, key: str, upload_id: str, n: int, data: bytes) -> dict:
        r = self.fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=data)
        return {"PartNumber": n, "ETag": r["ETag"]}

    def publish(self, staged: Staged, path: str, pieces: Iterable[memoryview | bytes] = (), mode: int | None = None) -> None:
        if staged.token is None:  # a single PUT is atomic too
            self.fs.pipe_file(self._abs(path), b"".join(bytes(p) for p in pieces))
        elif staged.at is not None:
            if path == staged.at:
                self._complete(*self._bucket_key(path), staged.token[len(MPU) :], staged.parts)
            else:  # renamed before its turn: the open upload is at the wrong name
                log.info("%s was staged at %s, renamed before its turn: uploading it again at its name", path, staged.at)
                with contextlib.suppress(Exception):  # best effort: a later start aborts what is left
                    self.discard(staged)
                self._upload(path, pieces, staged.size, complete=True)
        else:
            self.fs.invalidate_cache(self._abs(staged.token))
            self.copy(staged.token, path)
            self.delete(staged.token)
        self.fs.invalidate_cache(self._abs(path))

    def delete_many(self, paths: list[str]) -> None:
        """One DeleteObjects request per DELETE_MANY keys (exactly these keys:
        fsspec's `rm` of a list would expand names holding `*` or `?`)."""
        for i in range(0, len(paths), DELETE_MANY):
            keys = [self._bucket_key(path) for path in paths[i : i + DELETE_MANY]]
            bucket = keys[0][0]
            out = self.fs.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": [{"Key": key} for _, key in keys], "Quiet": True})
            errors = out.get("Errors") or []
            if errors:
                e = errors[0]
                raise OSError(errno.EIO, f"the store did not delete {len(errors)} of {len(keys)} objects: {e.get('Key')}: "
                                         f"{e.get('Code')} {e.get('Message')}")
            for _, key in keys:
                self.fs.invalidate_cache(f"{bucket}/{key}")

    def discard(self, staged: Staged) -> None:
        if staged.at is not None and staged.token is not None:
            bucket, key = self._bucket_key(staged.at)
            try:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=staged.token[len(MPU) :])
            except Exception as exc:
                if "NoSuchUpload" not in f"{type(exc).__name__} {exc}":  # else completed or aborted already
                    raise
            return
        super().discard(staged)

    def staged_exists(self, token: str) -> bool:
        if not token.startswith(MPU):
            return super().staged_exists(token)
        return any(up["UploadId"] == token[len(MPU) :] for up in self._uploads())

    def _uploads(self) -> Iterator[dict]:
        """The multipart uploads in progress under the store's prefix."""
        bucket, prefix = self._bucket_key("")
        kwargs = {"Bucket": bucket, "Prefix": f"{prefix}/" if prefix else ""}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", **kwargs)
            yield from page.get("Uploads", [])
            if not page.get("IsTruncated"):
                return
            kwargs.update(KeyMarker=page.get("NextKeyMarker", ""), UploadIdMarker=page.get("NextUploadIdMarker", ""))

    def _clean_uploads(self, live: set[str], started: float, named: bool) -> None:
        """Abort the uploads no live daemon owns: those under a dead daemon's
        staging prefix, and (`named`) those left open at a file's name (owned
        by no prefix) that began before this daemon started (one daemon per
        store, or the node starting a cluster)."""
        bucket, prefix = self._bucket_key("")
        staging = f"{prefix}/{STAGING}/" if prefix else f"{STAGING}/"
        for up in list(self._uploads()):
            key = up["Key"]
            owner = key[len(staging) :].split("/", 1)[0] if key.startswith(staging) else ""
            if not owner and not named:
                continue
            initiated = up.get("Initiated")
            old = initiated is None or initiated.timestamp() < started
            if owner not in live and old:
                log.info("aborting an abandoned multipart upload of %s", key)
                with contextlib.suppress(Exception):
                    self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=up["UploadId"])

    def walk(self, prefix: str = "") -> Iterator[Entry]:
        self.fs.invalidate_cache()
        yield from super().walk(prefix)

    def find(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache()
        return super().find(prefix)

    def stamped(self, prefix: str) -> dict[str, float | None]:
        self.fs.invalidate_cache()
        return super().stamped(prefix)

    def stamp(self, path: str) -> float | None:
        self.fs.invalidate_cache(self._abs(path))
        return super().stamp(path)

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(self._abs(path))
        return super().exists(path)


def _file_info(info: dict, path: str) -> dict:
    """`info` of what an object store has at `path`, which must be a file:
    s3fs opens a folder (SeaweedFS keeps them; a key `d/`) as an empty
    file, and a load or `verify` of a name that became a directory read
    0 bytes there (CORRUPT, EXTRA)."""
    if info.get("type") == "directory":
        raise FileNotFoundError(errno.ENOENT, "the store has a folder there, no file", path)
    return info


def _stamp_of(info: dict) -> float | None:
    """An object's time of last change from an fsspec listing: s3fs
    LastModified, gcsfs updated, memory created, others mtime."""
    for key in ("LastModified", "last_modified", "updated", "mtime", "created"):
        value = info.get(key)
        if isinstance(value, datetime.datetime):
            return value.timestamp() if value.tzinfo else value.replace(tzinfo=datetime.UTC).timestamp()
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None


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


def _fast_timestamps(fs) -> None:
    """botocore reads every timestamp of a response with dateutil's parser,
    80 us each on this VM: 0.8 s for a listing of 10,000 objects, most of a
    restart over S3. S3 lists them in ISO 8601, which `_timestamp` reads in
    under a microsecond. The session is the one s3fs would make (its own
    session arguments), with that parser; a session the user gave, or one
    made already, is left as it is."""
    if getattr(fs, "session", False) is not None:
        return
    import aiobotocore.session

    session = aiobotocore.session.AioSession(**fs.kwargs)
    session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=_timestamp)
    fs.session = session


def _timestamp(text: str) -> datetime.datetime:
    """An ISO 8601 time with its zone (S3's listings: `2026-11-25T03:50:06.417Z`);
    any other form (HTTP dates in headers, epoch seconds) as botocore reads it."""
    with contextlib.suppress(ValueError):
        value = datetime.datetime.fromisoformat(text)
        if value.tzinfo is not None:
            return value
    from botocore.utils import parse_timestamp

    return parse_timestamp(text)


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
            return LocalBackend(root.rstrip("/") or "/", url)
        except OSError as exc:
            raise StoreError(f"cannot use store directory {root}: {exc.strerror}") from None
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise StoreError(f"unknown store protocol {protocol!r} in {url!r}") from None
    except ImportError as exc:
        raise StoreError(f"store protocol {protocol!r} needs a package that is not installed: {exc}") from None
    bucketed = protocol in ("s3", "s3a", "gs", "gcs")
    if bucketed and not rest.strip("/"):
        raise StoreError(f"store URL {url!r} names no bucket: write {protocol}://BUCKET or {protocol}://BUCKET/PREFIX")
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        options.setdefault("use_listings_cache", False)
        # Fail fast and let the engine retry (with backoff, shown in status)
        # rather than hang for minutes on a dead connection.
        config = options.setdefault("config_kwargs", {})
        if not isinstance(config, dict):
            raise StoreError("store option config_kwargs must be a mapping of botocore settings")
        config.setdefault("connect_timeout", 5)
        config.setdefault("read_timeout", 30)
        config.setdefault("retries", {"max_attempts": 2})
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except Exception as exc:  # fsspec backends raise anything on bad URLs and options
        raise StoreError(f"cannot open store {url!r}: {exc}") from None
    if protocol in ("s3", "s3a"):
        _fast_timestamps(fs)
    backend_cls = S3Backend if protocol in ("s3", "s3a") else FsspecBackend
    backend = backend_cls(fs, root, url)
    try:
        backend.check_path("f")  # a prefix that is not UTF-8, or too long: no file could go there
    except OSError as exc:
        raise StoreError(f"store {url!r} cannot hold files: {exc.strerror}") from None
    bucket = backend.root.split("/")[0]
    try:
        fs.ls(bucket if bucketed else backend.root)
    except FileNotFoundError:
        if bucketed:
            raise StoreError(f"bucket {bucket!r} does not exist (store {url!r}); create it first") from None
        if not create:
            raise StoreError(f"store {url!r} does not exist") from None
    except Exception as exc:
        raise StoreError(f"cannot reach store {url!r}: {exc}") from None
    return backend
