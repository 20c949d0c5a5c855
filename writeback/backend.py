"""The store adapter: one small interface over fsspec file systems.

A `Backend` publishes whole files only (C2): data is first *staged* (a temp
file, a multipart upload or a hidden staging object) and becomes visible at
its final path in one step (rename, multipart completion, server-side move).
Every method is blocking and is called from worker threads, never from the
trio thread. Paths are relative to the store root, with "/" separators.

- `LocalBackend` (file://): temp file in `.ckptfs/staging/`, fsync, rename.
- `S3Backend` (s3://): small objects are kept staged in memory and PUT whole
  at publish; large ones are multipart uploads to the final key, completed at
  publish.
- `FsspecBackend` (anything else, e.g. memory://): staging object + move.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.core import split_protocol

log = logging.getLogger(__name__)

META = ".ckptfs"  # ckptfs's own objects live under this prefix only (C8)
STAGING = f"{META}/staging"
SPILL = f"{META}/spill"  # files too big for RAM, on local stores (unlinked, O_TMPFILE)
PART_SIZE = 16 << 20  # grown for huge files to stay under S3's 10,000 parts
SMALL_PUT = 8 << 20  # object stores: up to this size, one PUT at publish time


class StoreError(Exception):
    """A store URL that cannot be used; the message is for the user."""


@dataclass
class Staged:
    """Data uploaded but not yet visible at `path`."""

    path: str
    size: int
    token: Any = None  # backend-specific: temp path, multipart upload id
    parts: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class Entry:
    path: str
    size: int
    is_dir: bool


class Backend:
    url: str

    def prepare(self) -> None:
        """Called once by the daemon that will write: create what staging
        needs and clear what a daemon that died left there. Nothing else
        (verify, watchers) may do this: it would delete live uploads."""

    def stage(self, path: str, pieces: Iterable[memoryview | bytes], size: int) -> Staged:
        raise NotImplementedError

    def publish(self, staged: Staged, path: str) -> None:
        """Make `staged` visible at `path` atomically (replacing what is there)."""
        raise NotImplementedError

    def publishable_at(self, staged: Staged, path: str) -> bool:
        """Whether `staged` can be published at `path` (else: stage again)."""
        return True

    def discard(self, staged: Staged) -> None:
        raise NotImplementedError

    def put(self, path: str, data: bytes) -> None:
        """Write a small object whole (used for ckptfs's own records)."""
        self.publish(self.stage(path, [data], len(data)), path)

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

    def mkdir(self, path: str) -> None:
        """Create a directory where directories exist (local stores only)."""

    def rmdir(self, path: str) -> None:
        """Remove an empty directory where directories exist."""

    def walk(self, prefix: str = "") -> Iterator[Entry]:
        """Files and directories under `prefix`, ckptfs's own prefix excluded."""
        raise NotImplementedError

    def find(self, prefix: str) -> list[str]:
        """Every file under `prefix` (ckptfs's own prefix included)."""
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError


class LocalBackend(Backend):
    def __init__(self, root: str, url: str) -> None:
        self.root = root
        self.url = url

    def prepare(self) -> None:
        os.makedirs(self._abs(STAGING), exist_ok=True)
        os.makedirs(self._abs(SPILL), exist_ok=True)
        for leftover in os.listdir(self._abs(STAGING)):  # from a daemon that died
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._abs(STAGING), leftover))

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def stage(self, path: str, pieces: Iterable[memoryview | bytes], size: int) -> Staged:
        tmp = f"{STAGING}/{uuid.uuid4().hex}"
        os.makedirs(self._abs(STAGING), exist_ok=True)
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
        return Staged(path, size, tmp)

    def publish(self, staged: Staged, path: str) -> None:
        dst = self._abs(path)
        parent = os.path.dirname(dst)
        os.makedirs(parent, exist_ok=True)
        if os.path.isdir(dst) and not os.path.islink(dst):
            os.rmdir(dst)  # an empty directory left where a file now goes
        os.rename(self._abs(staged.token), dst)
        _fsync_dir(parent)

    def discard(self, staged: Staged) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._abs(staged.token))

    def read(self, path: str) -> Iterator[bytes]:
        with open(self._abs(path), "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                yield chunk

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._abs(path))

    def move(self, src: str, dst: str) -> None:
        os.makedirs(os.path.dirname(self._abs(dst)), exist_ok=True)
        os.rename(self._abs(src), self._abs(dst))
        _fsync_dir(os.path.dirname(self._abs(dst)))

    def copy(self, src: str, dst: str) -> None:
        staged = self.stage(dst, self.read(src), -1)
        self.publish(staged, dst)

    def mkdir(self, path: str) -> None:
        os.makedirs(self._abs(path), exist_ok=True)

    def rmdir(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(self._abs(path))

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

    def stage(self, path: str, pieces: Iterable[memoryview | bytes], size: int) -> Staged:
        tmp = f"{STAGING}/{uuid.uuid4().hex}"
        with self.fs.open(self._abs(tmp), "wb") as f:
            for piece in pieces:
                f.write(piece)
        return Staged(path, size, tmp)

    def publish(self, staged: Staged, path: str) -> None:
        self.fs.mv(self._abs(staged.token), self._abs(path))

    def discard(self, staged: Staged) -> None:
        self.delete(staged.token)

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
            return [p[len(self.root) :].lstrip("/") for p in self.fs.find(self._abs(prefix))]
        except FileNotFoundError:
            return []

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._abs(path))


class S3Backend(FsspecBackend):
    """S3: multipart uploads to the final key, invisible until completed (C2).

    A rename before publication means the staged upload is for the wrong key:
    it is aborted and the data re-staged under the final name (C4).
    """

    def _bucket_key(self, path: str) -> tuple[str, str]:
        bucket, _, key = self._abs(path).partition("/")
        return bucket, key

    def stage(self, path: str, pieces: Iterable[memoryview | bytes], size: int) -> Staged:
        if 0 <= size <= SMALL_PUT:
            return Staged(path, size, b"".join(bytes(p) for p in pieces))
        bucket, key = self._bucket_key(path)
        mpu = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        staged = Staged(path, size, mpu["UploadId"])
        part_size = max(PART_SIZE, -(-size // 9000))
        try:
            buf = bytearray()
            for piece in pieces:
                buf += piece
                while len(buf) >= part_size:
                    self._part(staged, bytes(buf[:part_size]))
                    del buf[:part_size]
            if buf or not staged.parts:
                self._part(staged, bytes(buf))
        except BaseException:
            self.discard(staged)
            raise
        return staged

    def _part(self, staged: Staged, data: bytes) -> None:
        bucket, key = self._bucket_key(staged.path)
        n = len(staged.parts) + 1
        r = self.fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=staged.token, PartNumber=n, Body=data)
        staged.parts.append({"PartNumber": n, "ETag": r["ETag"]})

    def publishable_at(self, staged: Staged, path: str) -> bool:
        return isinstance(staged.token, bytes) or path == staged.path

    def publish(self, staged: Staged, path: str) -> None:
        if isinstance(staged.token, bytes):  # a single PUT is atomic too
            self.fs.pipe_file(self._abs(path), staged.token)
            return
        if path != staged.path:
            raise ValueError("an S3 upload can only be published under the key it was staged for")
        bucket, key = self._bucket_key(path)
        self.fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=staged.token,
                        MultipartUpload={"Parts": staged.parts})
        self.fs.invalidate_cache(self._abs(path))

    def discard(self, staged: Staged) -> None:
        if isinstance(staged.token, bytes):
            return
        bucket, key = self._bucket_key(staged.path)
        with contextlib.suppress(Exception):
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=staged.token)

    def move(self, src: str, dst: str) -> None:
        self.fs.copy(self._abs(src), self._abs(dst))
        self.fs.rm_file(self._abs(src))

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
