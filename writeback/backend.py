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

import contextlib
import errno
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import fsspec
from fsspec.core import split_protocol

log = logging.getLogger(__name__)

META = ".ckptfs"  # ckptfs's own objects live under this prefix only (C8)
STAGING = f"{META}/staging"
DAEMONS = f"{META}/daemons"  # one heartbeat object per live daemon
SPILL = f"{META}/spill"  # files too big for RAM, on local stores (unlinked, O_TMPFILE)
HEARTBEAT_S = 20.0  # a daemon rewrites its heartbeat this often
HEARTBEAT_DEAD_S = 4 * HEARTBEAT_S  # older than this: the daemon is gone
PART_SIZE = 16 << 20  # grown for huge files to stay under S3's 10,000 parts
SMALL_PUT = 8 << 20  # object stores: up to this size, one PUT at publish time


class StoreError(Exception):
    """A store URL that cannot be used; the message is for the user."""


@dataclass
class Staged:
    """Data uploaded but not yet visible anywhere."""

    size: int
    token: str | None  # the hidden staging path; None: not uploaded ahead (published from the snapshot)
    parts: list[dict] = field(default_factory=list)


def new_daemon_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns():x}"


def _dead_here(daemon: str) -> bool:
    """Whether `daemon` (an id from `new_daemon_id`) ran on this host and its
    process is gone."""
    host, _, rest = daemon.rpartition("-")[0].rpartition("-")
    pid = rest
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@dataclass(frozen=True)
class Entry:
    path: str
    size: int
    is_dir: bool


class Backend:
    url: str
    dirs = False  # real directories, movable in one step (local stores)
    daemon_id: str = ""  # set by `prepare`: this daemon stages under its own prefix

    @property
    def staging(self) -> str:
        return f"{STAGING}/{self.daemon_id or 'shared'}"

    def _staging_name(self) -> str:
        return f"{self.staging}/{uuid.uuid4().hex}"

    # -- the daemon's own namespace --------------------------------------------
    def prepare(self, daemon_id: str, started: float) -> None:
        """Called once by the daemon that will write: claim a staging prefix,
        and clear what dead daemons left (staging, multipart uploads). Never
        another live daemon's: verify and watchers must not call this."""
        self.daemon_id = daemon_id
        self.heartbeat()
        live = self.live_daemons()
        for path in self.find(STAGING):
            owner = path[len(STAGING) + 1 :].split("/", 1)[0] if "/" in path[len(STAGING) + 1 :] else ""
            if owner not in live:
                self.delete(path)
        self._clean_uploads(live, started)

    def heartbeat(self) -> None:
        self.put(f"{DAEMONS}/{self.daemon_id}", json.dumps({"time": time.time(), "pid": os.getpid()}).encode())

    def retire(self) -> None:
        """The daemon exits: its staging and heartbeat go."""
        for path in self.find(self.staging):
            self.delete(path)
        self.delete(f"{DAEMONS}/{self.daemon_id}")

    def live_daemons(self) -> set[str]:
        """Daemons using this store: a recent heartbeat, and on this host a
        running process (a daemon killed a second ago has a fresh heartbeat)."""
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
            else:
                self.delete(path)
        return live

    def _clean_uploads(self, live: set[str], started: float) -> None:
        """Abort incomplete multipart uploads that no live daemon owns."""

    # -- data --------------------------------------------------------------------
    def stage(self, pieces: Iterable[memoryview | bytes], size: int) -> Staged:
        """Upload `pieces` (`size` bytes) under a hidden name of its own."""
        raise NotImplementedError

    def publish(self, staged: Staged, path: str, pieces: Iterable[memoryview | bytes] = ()) -> None:
        """Make `staged` visible at `path` atomically (replacing what is
        there). `pieces` are the bytes again, for a `Staged` with no token.
        FileNotFoundError: the staged data is gone (published already, or
        cleaned away): the caller checks which."""
        raise NotImplementedError

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

    def delete(self, path: str) -> None:
        """Remove a file; a missing file is not an error."""
        raise NotImplementedError

    def move(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def copy(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def exchange(self, a: str, b: str) -> None:
        """Swap two files (atomically where the store can)."""
        tmp = self._staging_name()
        self.copy(a, tmp)
        self.move(b, a)
        self.move(tmp, b)

    def mkdir(self, path: str) -> None:
        """Create a directory where directories exist (local stores only)."""

    def rmdir(self, path: str) -> None:
        """Remove an empty directory where directories exist."""

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

    def find(self, prefix: str) -> list[str]:
        """Every file under `prefix` (ckptfs's own prefix included)."""
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError


class LocalBackend(Backend):
    dirs = True

    def __init__(self, root: str, url: str) -> None:
        self.root = root
        self.url = url

    def prepare(self, daemon_id: str, started: float) -> None:
        os.makedirs(self._abs(SPILL), exist_ok=True)
        super().prepare(daemon_id, started)
        for path in os.listdir(self._abs(STAGING)):  # emptied directories of dead daemons
            with contextlib.suppress(OSError):
                os.rmdir(self._abs(f"{STAGING}/{path}"))

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def stage(self, pieces: Iterable[memoryview | bytes], size: int) -> Staged:
        tmp = self._staging_name()
        os.makedirs(self._abs(self.staging), exist_ok=True)
        fd = os.open(self._abs(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for piece in pieces:
                view = memoryview(piece)
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self._abs(tmp))
            raise
        os.close(fd)
        return Staged(size, tmp)

    def publish(self, staged: Staged, path: str, pieces: Iterable[memoryview | bytes] = ()) -> None:
        assert staged.token is not None
        self._replace(staged.token, path)

    def _replace(self, src: str, dst: str) -> None:
        full = self._abs(dst)
        parent = os.path.dirname(full)
        os.makedirs(parent, exist_ok=True)
        if os.path.isdir(full) and not os.path.islink(full):
            os.rmdir(full)  # an empty directory left where a file now goes
        os.rename(self._abs(src), full)
        _fsync_dir(parent)

    def put(self, path: str, data: bytes) -> None:
        self.publish(self.stage([data], len(data)), path)

    def read(self, path: str) -> Iterator[bytes]:
        with open(self._abs(path), "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                yield chunk

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._abs(path))

    def move(self, src: str, dst: str) -> None:
        self._replace(src, dst)

    def copy(self, src: str, dst: str) -> None:
        self.publish(self.stage(self.read(src), -1), dst)

    def exchange(self, a: str, b: str) -> None:
        _renameat2(self._abs(a), self._abs(b), RENAME_EXCHANGE)
        _fsync_dir(os.path.dirname(self._abs(a)))
        _fsync_dir(os.path.dirname(self._abs(b)))

    def mkdir(self, path: str) -> None:
        os.makedirs(self._abs(path), exist_ok=True)

    def rmdir(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(self._abs(path))

    def move_dir(self, src: str, dst: str) -> bool:
        full = self._abs(dst)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        try:
            os.rename(self._abs(src), full)  # replaces an empty directory
        except OSError as exc:
            if exc.errno == errno.ENOENT and os.path.isdir(full):
                return True  # moved already (an earlier attempt whose answer was lost)
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOENT):
                return False  # something is in the way, or nothing to move: the caller moves members
            raise
        _fsync_dir(os.path.dirname(full))
        _fsync_dir(os.path.dirname(self._abs(src)))
        return True

    def unit_dir(self) -> str:
        path = f"{self.staging}/d-{uuid.uuid4().hex}"
        os.makedirs(self._abs(path))
        return path

    def walk(self, prefix: str = "") -> Iterator[Entry]:
        base = self._abs(prefix)
        if prefix and os.path.isfile(base):  # a single file
            yield Entry(prefix, os.path.getsize(base), False)
            return
        for dirpath, dirnames, filenames in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel
            if rel == META or rel.startswith(META + "/"):
                dirnames[:] = []
                continue
            if not prefix and not rel:
                dirnames[:] = [d for d in dirnames if d != META]
            for d in dirnames:
                yield Entry(f"{rel}/{d}" if rel else d, 0, True)
            for name in filenames:
                p = f"{rel}/{name}" if rel else name
                with contextlib.suppress(FileNotFoundError):
                    yield Entry(p, os.lstat(os.path.join(dirpath, name)).st_size, False)

    def find(self, prefix: str) -> list[str]:
        out = []
        for dirpath, _, files in os.walk(self._abs(prefix)):
            out += [os.path.relpath(os.path.join(dirpath, n), self.root) for n in files]
        return out

    def exists(self, path: str) -> bool:
        return os.path.lexists(self._abs(path))


RENAME_EXCHANGE = 2


def _renameat2(a: str, b: str, flags: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd = -100
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), a)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsspecBackend(Backend):
    """Any fsspec file system: stage to a hidden object, publish by moving it."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def stage(self, pieces: Iterable[memoryview | bytes], size: int) -> Staged:
        tmp = self._staging_name()
        with self.fs.open(self._abs(tmp), "wb") as f:
            for piece in pieces:
                f.write(piece)
        return Staged(size, tmp)

    def publish(self, staged: Staged, path: str, pieces: Iterable[memoryview | bytes] = ()) -> None:
        assert staged.token is not None
        self.fs.mv(self._abs(staged.token), self._abs(path))

    def put(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(self._abs(path), data)

    def read(self, path: str) -> Iterator[bytes]:
        with self.fs.open(self._abs(path), "rb") as f:
            while chunk := f.read(8 << 20):
                yield chunk

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._abs(path))

    def move(self, src: str, dst: str) -> None:
        self.fs.mv(self._abs(src), self._abs(dst))

    def copy(self, src: str, dst: str) -> None:
        self.fs.copy(self._abs(src), self._abs(dst))

    def walk(self, prefix: str = "") -> Iterator[Entry]:
        base = self._abs(prefix)
        try:
            found = self.fs.find(base, withdirs=True, detail=True)
        except FileNotFoundError:
            return
        for full, info in sorted(found.items()):
            rel = full[len(self.root) :].lstrip("/") if full.startswith(self.root) else full
            if not rel or rel == META or rel.startswith(META + "/"):
                continue
            yield Entry(rel, int(info.get("size") or 0), info.get("type") == "directory")

    def find(self, prefix: str) -> list[str]:
        try:
            found = self.fs.find(self._abs(prefix), detail=True)
        except FileNotFoundError:
            return []
        # Stores with folders (SeaweedFS) list an emptied folder as an entry.
        return [p[len(self.root) :].lstrip("/") for p, info in found.items() if info.get("type") != "directory"]

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._abs(path))


class S3Backend(FsspecBackend):
    """S3: small files are PUT whole at publication (from the snapshot, so
    nothing is uploaded twice); large ones are multipart uploads to a hidden
    staging key, published by a server-side copy (CopyObject is atomic)."""

    def _bucket_key(self, path: str) -> tuple[str, str]:
        bucket, _, key = self._abs(path).partition("/")
        return bucket, key

    def stage(self, pieces: Iterable[memoryview | bytes], size: int) -> Staged:
        if 0 <= size <= SMALL_PUT:
            for _ in pieces:  # hashed on the way by the caller; published from the snapshot
                pass
            return Staged(size, None)
        tmp = self._staging_name()
        bucket, key = self._bucket_key(tmp)
        mpu = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        upload_id = mpu["UploadId"]
        part_size = max(PART_SIZE, -(-size // 9000))
        parts: list[dict] = []
        try:
            buf = bytearray()
            for piece in pieces:
                buf += piece
                while len(buf) >= part_size:
                    parts.append(self._part(bucket, key, upload_id, len(parts) + 1, bytes(buf[:part_size])))
                    del buf[:part_size]
            if buf or not parts:
                parts.append(self._part(bucket, key, upload_id, len(parts) + 1, bytes(buf)))
            self.fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                            MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            raise
        return Staged(size, tmp, parts)

    def _part(self, bucket: str, key: str, upload_id: str, n: int, data: bytes) -> dict:
        r = self.fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=data)
        return {"PartNumber": n, "ETag": r["ETag"]}

    def publish(self, staged: Staged, path: str, pieces: Iterable[memoryview | bytes] = ()) -> None:
        if staged.token is None:  # a single PUT is atomic too
            self.fs.pipe_file(self._abs(path), b"".join(bytes(p) for p in pieces))
        else:
            self.fs.invalidate_cache(self._abs(staged.token))
            self.fs.copy(self._abs(staged.token), self._abs(path))
            self.delete(staged.token)
        self.fs.invalidate_cache(self._abs(path))

    def move(self, src: str, dst: str) -> None:
        self.fs.copy(self._abs(src), self._abs(dst))
        self.fs.rm_file(self._abs(src))

    def _clean_uploads(self, live: set[str], started: float) -> None:
        bucket, prefix = self._bucket_key("")
        prefix = f"{prefix}/" if prefix else ""
        staging = f"{prefix}{STAGING}/"
        kwargs = {"Bucket": bucket, "Prefix": prefix}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", **kwargs)
            for up in page.get("Uploads", []):
                key = up["Key"]
                owner = key[len(staging) :].split("/", 1)[0] if key.startswith(staging) else ""
                initiated = up.get("Initiated")
                old = initiated is None or initiated.timestamp() < started
                if owner not in live and old:
                    log.info("aborting an abandoned multipart upload of %s", key)
                    with contextlib.suppress(Exception):
                        self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=up["UploadId"])
            if not page.get("IsTruncated"):
                return
            kwargs.update(KeyMarker=page.get("NextKeyMarker", ""), UploadIdMarker=page.get("NextUploadIdMarker", ""))

    def walk(self, prefix: str = "") -> Iterator[Entry]:
        self.fs.invalidate_cache()
        yield from super().walk(prefix)

    def find(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache()
        return super().find(prefix)

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(self._abs(path))
        return super().exists(path)


def open_store(url: str, storage_options: dict | None = None) -> Backend:
    """The backend for `url`, checked to be usable.

    Local stores are created if missing. Errors name what to fix: an unknown
    protocol, or the package a known protocol needs (e.g. s3fs for s3://).
    """
    if not url or not url.strip():
        raise StoreError("the store URL is empty")
    protocol, _ = split_protocol(url)
    protocol = protocol or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise StoreError(f"unknown store protocol {protocol!r} in {url!r}") from None
    except ImportError as exc:
        raise StoreError(f"store protocol {protocol!r} needs a package that is not installed: {exc}") from None
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        options.setdefault("use_listings_cache", False)
        # Fail fast and let the engine retry (with backoff, shown in status)
        # rather than hang for minutes on a dead connection.
        config = options.setdefault("config_kwargs", {})
        config.setdefault("connect_timeout", 5)
        config.setdefault("read_timeout", 30)
        config.setdefault("retries", {"max_attempts": 2})
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except Exception as exc:  # fsspec backends raise anything on bad URLs
        raise StoreError(f"cannot open store {url!r}: {exc}") from None
    if protocol in ("file", "local"):
        if os.path.exists(root) and not os.path.isdir(root):
            raise StoreError(f"store path {root} exists and is not a directory")
        try:
            os.makedirs(root, exist_ok=True)
            return LocalBackend(root.rstrip("/") or "/", url)
        except OSError as exc:
            raise StoreError(f"cannot use store directory {root}: {exc.strerror}") from None
    backend_cls = S3Backend if protocol in ("s3", "s3a") else FsspecBackend
    backend = backend_cls(fs, root, url)
    try:
        fs.ls(backend.root.split("/")[0] if protocol in ("s3", "s3a", "gs", "gcs") else backend.root)
    except FileNotFoundError:
        if protocol in ("s3", "s3a", "gs", "gcs"):
            raise StoreError(f"bucket of {url!r} does not exist") from None
    except Exception as exc:
        raise StoreError(f"cannot reach store {url!r}: {exc}") from None
    return backend
