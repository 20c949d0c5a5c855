"""Object stores and any other fsspec file system as a store.

- `S3Backend` (s3://): small files are not uploaded ahead: publication PUTs
  them whole from the sealed snapshot. Large ones are multipart uploads left
  open at their name (completing one publishes it), or uploaded to a hidden
  staging key and published by a server-side copy when the name looks
  temporary.
- `FsspecBackend` (anything else, e.g. memory://): staging object + move.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import errno
import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from .backend import META, STAGING, Backend, Entry, Into, Source, Staged, StoreError, parents, temporary

if TYPE_CHECKING:
    import fsspec

log = logging.getLogger(__name__)

PART_SIZE = 16 << 20  # grown for huge files to stay under S3's 10,000 parts
PART_CONCURRENCY = 4  # S3: parts of one file in flight at once (each held as one copy meanwhile)
SMALL_PUT = 8 << 20  # object stores: up to this size, one PUT at publish time
MAX_OBJECT = 5 << 40  # S3: the largest object
MAX_KEY = 1024  # S3: the longest key, in bytes of UTF-8
READ_MANY_BATCH = 500  # object stores: records fetched concurrently per batch
GROUP_CONCURRENCY = 16  # object stores: requests of one group commit's step in flight together
DELETE_MANY = 1000  # S3: keys deleted by one request (its most)
READ_MANY_TRIES = 4  # records a burst of reads could not get (an overloaded store's 503 or 500) are read again, together
MPU = "mpu:"  # a staging token naming an open multipart upload


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


def open_object_store(url: str, protocol: str | None, rest: str, storage_options: dict | None, create: bool) -> Backend:
    """`backend.open_store` for a URL that is not a local directory: its
    fsspec file system, checked to be reachable (and its bucket to exist)."""
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
    if bucketed:
        # The store is shared (a cluster's nodes, `verify`, whoever reads the
        # checkpoints there): a listing kept from before would hide what
        # another client wrote since, and give the size a file had (gcsfs
        # keeps them unless told not to).
        options.setdefault("use_listings_cache", False)
    if protocol in ("s3", "s3a"):
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
