"""Blocking store I/O: the steps the engine runs in worker threads, and the
same steps for a whole file written or read straight from the store (the
torch helpers' fallback when the daemon cannot serve, C7).

Each publication writes the manifest record first, then makes the data
visible (see manifest.py), so a store never holds a file its manifest cannot
vouch for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, BinaryIO

from . import exchange, manifest
from .backend import DAEMONS, IMAGE, META, UNKNOWN, Backend, Entry, Staged, StoreError, parents
from .manifest import Digest, Record

if TYPE_CHECKING:
    from .replica import Shown

log = logging.getLogger(__name__)

PIECE = 8 << 20


class Cancelled(Exception):
    """The staging attempt was dropped or abandoned: stop reading its snapshot."""


class IntegrityError(OSError):
    """Bytes read from the store do not match their manifest record."""


class StagingLost(FileNotFoundError):
    """The staged copy a publication needs is gone from the store (cleaned
    away, or consumed by an earlier attempt whose answer was lost, its bytes
    replaced since), and the store does not hold its bytes: only staging it
    again from its snapshot can publish it (another node's: only that node can)."""


class NewerInStore(Exception):
    """The store holds bytes at the path that this daemon did not put there,
    written after the generation being published was sealed (the torch
    helpers' direct write while the daemon could not serve): they win."""

    def __init__(self, record: Record) -> None:
        super().__init__(record.path)
        self.record = record


def stage(backend: Backend, pieces: Iterable[memoryview | bytes], size: int,
          cancelled: Callable[[], bool] | None = None, name: str | None = None, elsewhere: bool = False) -> tuple[Staged, Digest]:
    """Upload `pieces` invisibly, hashing them on the way (`name`: where it
    will probably be published; `elsewhere`: by another node; see `Backend.stage`;
    `size` -1: not known yet, the caller checks the digest's)."""
    h = manifest.Hashing()

    def hashed():
        for piece in pieces:
            if cancelled is not None and cancelled():
                raise Cancelled()  # checked per piece: a dropped or abandoned upload stops promptly
            h.update(piece)
            yield piece

    staged = backend.stage(hashed(), size, name, elsewhere)
    if size >= 0 and h.size != size:
        with contextlib.suppress(Exception):  # best effort: a later start removes what is left
            backend.discard(staged)
        raise OSError(errno.EIO, f"snapshot yielded {h.size} bytes, expected {size}")
    return staged, h.digest()


def publish(backend: Backend, rec: Record | None, staged: Staged, path: str, digest: Digest,
            pieces: Callable[[], Iterable] | None = None, mode: int | None = None) -> None:
    """Record (if any), then make visible (see manifest.py), with the
    record's mode (`mode` with none: a file assembled in a hidden directory,
    whose record is written for its final path). Idempotent: if the staged
    data is gone because an earlier attempt published it, that is success."""
    if rec is not None:
        try:
            there = manifest.read(backend, rec.path)
        except manifest.UNREADABLE:  # no record, only garbage where it goes: this publication writes one over it
            there = None
        _refuse_newer(rec, there)
        [(rec, staged)] = _staged_now(backend, [(rec, staged, pieces)])
        manifest.write(backend, rec)  # first: see manifest.py
    try:
        backend.publish(staged, path, pieces() if pieces is not None else (), mode=rec.mode if rec is not None else mode)
    except FileNotFoundError as exc:
        if holds(backend, path, digest):
            log.info("%s was published already by an earlier attempt", path)
            return
        if staged.token is None:
            raise
        raise StagingLost(errno.ENOENT, "its staged copy is gone from the store", path) from exc


def publish_group(backend: Backend, items: list[tuple[Record, Staged, str, Callable[[], Iterable]]], recorded: bool = True) -> None:
    """`publish` of many files at once (record, staged data, path, its
    bytes again): every record, then every file, made durable together
    (`Backend.publish_group`). Any error fails the group; the caller then
    publishes them one by one (idempotent). `recorded` False: files
    assembled in a hidden directory, whose records are written for their
    final paths (`publish` with no record; the records give the modes)."""
    if recorded:
        objpaths = [manifest.record_path(rec.path) for rec, _, _, _ in items]
        there = dict(backend.read_many(objpaths))  # side by side on object stores
        for objpath, (rec, _staged, _path, _pieces) in zip(objpaths, items, strict=True):
            if objpath in there:
                _refuse_newer(rec, manifest.decoded(there[objpath], objpath))
        now = _staged_now(backend, [(rec, staged, pieces) for rec, staged, _path, pieces in items])
        items = [(rec, staged, path, pieces) for (rec, staged), (_rec, _staged, path, pieces) in zip(now, items, strict=True)]
    recs = [rec for rec, _, _, _ in items] if recorded else []
    objpaths = [manifest.changing(backend, manifest.record_path(rec.path)) for rec in recs]
    done = False
    try:
        backend.publish_group([(objpath, rec.encode()) for objpath, rec in zip(objpaths, recs, strict=True)],
                              [(staged, path, rec.mode, pieces() if staged.token is None or staged.at not in (None, path) else ())
                               for rec, staged, path, pieces in items])  # the bytes again: a small file, or one staged at another name (S3)
        done = True
    finally:
        for objpath, rec in zip(objpaths, recs, strict=True):
            manifest.changed(backend, objpath, rec if done else UNKNOWN)


def _staged_now(backend: Backend, files: list[tuple[Record, Staged, Callable[[], Iterable] | None]]) -> list[tuple[Record, Staged]]:
    """Small files not staged ahead, on a store that stages everything
    (`stage_ahead_from`: local stores): staged now (`Backend.stage_many`),
    before their records, which name the staged copies. So a crash between
    a record and its data is told from a real loss at the next mount
    (`scan`): the staged copy is still there. (A record saying `put:` could
    not tell them apart once its daemon is gone: a file lost from the store
    later would be forgotten.)"""
    out = [(rec, staged) for rec, staged, _pieces in files]
    if not backend.stage_ahead_from:
        return out
    todo = [(i, staged.size, pieces) for i, (_rec, staged, pieces) in enumerate(files) if staged.token is None and pieces is not None]
    if todo:
        for (i, _size, _pieces), staged in zip(todo, backend.stage_many([(pieces(), size) for _i, size, pieces in todo]), strict=True):
            out[i] = (out[i][0]._replace(source=f"staged:{staged.token}"), staged)
    return out


def _refuse_newer(rec: Record, there: Record | None) -> None:
    """NewerInStore if the store holds a newer file at `rec.path` (its
    record `there`), written there directly after this generation was sealed."""
    if there is not None and there.kind == "file" and there.current not in (rec.previous, rec.current) and there.written_ns > rec.written_ns:
        raise NewerInStore(there)


def holds(backend: Backend, path: str, digest: Digest) -> bool:
    """Whether the store's bytes at `path` are exactly `digest`."""
    try:
        return manifest.digest_of(backend.read(path)) == digest
    except FileNotFoundError:
        return False


def show(backend: Backend, rec: Record | None, src: str, dst: str, move: bool) -> None:
    """Give published bytes at `src` the name `dst` too (copy) or instead (move)."""
    if rec is not None:
        manifest.write(backend, rec._replace(source=f"{'move' if move else 'copy'}:{src}"))
    if move:
        globals()["move"](backend, src, dst, rec.current if rec is not None else None)
        manifest.delete(backend, src)
    else:
        backend.copy(src, dst)


def move(backend: Backend, src: str, dst: str, digest: Digest | None) -> None:
    """Move published bytes; idempotent: already moved (the destination
    holding `digest`, the source gone or, since, a directory: an exchange's
    plan makes one there after the move, in the same phase) is success."""
    try:
        backend.move(src, dst)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        if digest is None or not holds(backend, dst, digest):
            raise


def swap(backend: Backend, a: str, b: str, before: list) -> None:
    """Swap what a local store has at `a` and `b`, files or directories;
    idempotent: `before` keeps the identities the first try saw, and a try
    that finds them swapped is done."""
    now = (backend.identity(a), backend.identity(b))
    if not before:
        before.append(now)
    elif None not in now and now == before[0][::-1]:
        return
    backend.exchange(a, b)


def delete(backend: Backend, path: str, shown: Shown | None = None) -> None:
    """Delete a published file, then its record. With `shown` (what the
    store has there), the record is first marked as being deleted by this
    daemon: a crash between the two deletes leaves a record with no file
    that the next scan knows for a leftover, not for a file lost."""
    if shown is not None and shown.digest is not None:
        manifest.write(backend, Record.of(path, "file", shown.meta, current=shown.digest, source=f"delete:{backend.daemon_id}"))
    backend.delete(path)
    manifest.delete(backend, path)


def take_back(backend: Backend, path: str, shown: Shown | None) -> None:
    """`delete` of what a failed try to publish `shown` may have left at
    `path` (`Publisher._take_back`). A directory there (another tool's, in
    the way: the try failed for it) holds nothing of it: only the record
    goes."""
    try:
        delete(backend, path, shown)
    except IsADirectoryError:
        manifest.delete(backend, path)


def delete_many(backend: Backend, files: list[tuple[str, Shown]]) -> None:
    """`delete` of many published files (path, what the store shows there)
    in three steps for all: every record marked as being deleted (one group
    commit), the files, the records."""
    manifest.write_many(backend, [Record.of(path, "file", shown.meta, current=shown.digest, source=f"delete:{backend.daemon_id}")
                                  for path, shown in files if shown.digest is not None])
    backend.delete_many([path for path, _shown in files])
    manifest.delete_many(backend, [path for path, _shown in files])


@dataclasses.dataclass
class Scanned:
    entries: list[Entry]  # what the store holds: the mount shows these
    records: dict[str, Record]  # by path
    unreadable: list[str]  # record objects that cannot be read
    image: manifest.Image  # every record: what the daemon's manifest image starts from
    outside: list[str]  # marks of record changes made without a daemon (all records were read)
    indexed: bool  # the records came from the manifest index or image, not all from their objects
    exchanged: int = 0  # the journal position of the last exchange the store applied, as its plan says (`exchange`)
    # Files and directories with no record, on a store that keeps attributes
    # itself (`unrecorded_meta`): what its file system says of them.
    unrecorded: dict[str, manifest.Meta] = dataclasses.field(default_factory=dict)


# A packed image of this many bytes holds some 7,000 records, and the store
# about as many files: listing them takes longer than starting a process to
# list them beside the decoding (`Backend.walking`).
MANY_PACKED = 256 << 10


def scan(backend: Backend) -> Scanned:
    """What the store holds, and its records. Called before this daemon
    claims the store (`Backend.prepare`), while dead daemons' staging is still
    there: a record whose data is missing is a crash leftover (removed) if the
    bytes it was being published from still exist; otherwise the file was
    lost from the store, and its record stays so `verify` reports it. An
    exchange a crash cut short is finished first."""
    exchanged = exchange.finish(backend)
    outside = backend.find(manifest.OUTSIDE)
    index = None if outside else manifest.Image.packed_in(backend)
    base = None if outside or index is not None else manifest.Image.packed_in(backend, IMAGE)
    # The listing waits on the store, the records' decoding on the CPU: side by side.
    with backend.walking(many=max(len(index or b""), len(base or b"")) >= MANY_PACKED) as listed:
        image = manifest.Image.of_packed(index)  # exact: left by a clean exit, nothing changed since
        exact = image is not None
        if image is None:
            # Checked against the times the store gives its record objects. Not
            # after a write without a daemon: one made while a daemon hung may
            # be older than that daemon's last image, and be missing from it.
            if base is None and index is not None:  # the index is there, and not readable
                base = manifest.Image.packed_in(backend, IMAGE)
            image = manifest.Image.of_store(backend, manifest.Image.of_packed(base, IMAGE))
        entries = listed()
    _refuse_nested(backend, entries)
    records, unreadable = image.records()
    entries, records = _nameable(entries, records, listed=backend.dirs)
    entries, hidden = _one_per_name(entries)
    files = {e.path for e in entries if not e.is_dir}
    if exact and backend.dirs:
        _left_out_of_the_index(backend, image, records, files)
    # Almost every record is a file's, at a file the store holds: only the
    # others are looked at below (one pass over 100,000 records each took
    # 10-70 ms of a restart).
    odd = [(p, r) for p, r in records.items() if r.kind != "file" or p not in files]
    missing = [(p, r) for p, r in odd if r.kind == "file" and p not in hidden]
    moved_to = {r.source[len("move:") :]: p for p, r in records.items() if r.source.startswith("move:") and p in files} if missing else {}
    crashed = None
    for path, rec in missing:
        kind, _, where = rec.source.partition(":")
        if path in moved_to and records[moved_to[path]].current == rec.current:
            leftover = True  # moved away (a directory move), its old record not yet deleted
        elif kind == "hidden":
            leftover = True  # an exchange's record written before its move, the move not finished: its bytes are still where they came from
        elif kind == "delete":
            leftover = True  # the rest of a removal: the file went first (whether its daemon died or a node took over from it)
        elif kind == "put":
            # A small object PUT whole: nothing was staged to prove it. Only a
            # daemon that died (its heartbeat still there, no longer live) can
            # have left a record before its data; one that exited cleanly
            # removed its heartbeat, so its files missing now are real losses.
            if crashed is None:
                beating = {p.rsplit("/", 1)[-1] for p in backend.find(DAEMONS)}  # the claim, after the scan, clears the dead
                crashed = beating - backend.live_daemons()
            leftover = where in crashed
        else:
            leftover = (kind == "staged" and backend.staged_exists(where)) or (kind in ("move", "copy") and backend.exists(where))
        if leftover:
            log.info("removing the record of %s: its data never reached the store (an earlier crash)", path)
            manifest.delete(backend, path)
            image.forget([manifest.record_path(path)])
            del records[path]
        else:
            log.warning("%s is recorded but missing from the store", path)
    dirs = {e.path for e in entries if e.is_dir}
    if not backend.dirs:  # an object store lists no directory of its own
        dirs |= parents(files)
    others = [(p, r) for p, r in odd if r.kind != "file"]  # symlinks' and directories' records
    links = {p for p, r in others if r.kind == "symlink"}
    for path, rec in others:
        # A symlink's or directory's record where the store has a file, or
        # under one (or a symlink under a symlink): left by a crash between
        # a store move and the record changes that follow it. The store's
        # files win: the record goes, and the restart shows them.
        if not (path in files or (rec.kind == "symlink" and path in dirs) or any(a in files or a in links for a in _above(path))):
            continue
        log.warning("removing the %s record of %s: the store has a file there, above or under it (an earlier crash)", rec.kind, path)
        manifest.delete(backend, path)
        image.forget([manifest.record_path(path)])
        del records[path]
    for path in _left_by_a_directory_move(backend, {p: records[p] for p, _ in others if p in records}, dirs):
        log.warning("removing the %s record of %s: a crash in a directory move left it at both names", records[path].kind, path)
        manifest.delete(backend, path)
        image.forget([manifest.record_path(path)])
        del records[path]
    for path, rec in others:
        if records.get(path) is rec and rec.source.startswith(DIR_MOVE):  # a move a crash left unsettled, settled above
            records[path] = rec = rec._replace(source="")
            manifest.write(backend, rec)
            image.forget([manifest.record_path(path)])
            image.learn(manifest.record_path(path), rec)
    image.packed()  # here, in a worker thread: the daemon keeps it packed
    unrecorded = unrecorded_meta(backend, [e.path for e in entries if e.path not in records or records[e.path].kind != ("dir" if e.is_dir else "file")])
    return Scanned(entries, records, unreadable, image, outside, index is not None, exchanged, unrecorded)


def unrecorded_meta(backend: Backend, paths: list[str]) -> dict[str, manifest.Meta]:
    """What a local store's own file system says of entries ckptfs has no
    record of, put there by another tool: their permission bits, owner and
    mtime, so that the mount never opens to every user what the store keeps
    to one. Never set-ID bits (a directory keeps its sticky bit). A file
    ckptfs publishes always has its record first, but a directory it made
    has none until the queue is idle, and is `0700` until then: one that
    the daemon's own user owns may be such a directory, left by a daemon
    killed meanwhile, and takes the defaults (`0755`), as on an object
    store, which keeps no attributes at all."""
    out = {}
    for path, st in backend.stat_many(paths):  # in listing order: a directory's entries together
        if stat.S_ISDIR(st.st_mode):
            if st.st_uid != os.geteuid():  # not one ckptfs made; its time: see `Engine.scan`
                out[path] = manifest.Meta(st.st_mode & 0o1777, st.st_uid, st.st_gid, None)
        elif stat.S_ISREG(st.st_mode):
            out[path] = manifest.Meta(st.st_mode & 0o777, st.st_uid, st.st_gid, st.st_mtime_ns)
    return out


def _left_out_of_the_index(backend: Backend, image: manifest.Image, records: dict[str, Record], files: set[str]) -> None:
    """The records of `files` that an exact index is short of, read from
    their objects into `records` and `image`. A daemon before 39c688d
    could leave such an index (exiting while it saved its image), and every
    clean exit after kept it: the files came back with no record, their
    modes, owners and times lost. Only on a store of real directories,
    where looking for an object that is not there costs a failed open: on
    an object store it would cost a request per file that ckptfs did not
    write, at every restart (there a file's first load looks: `Residency`)."""
    unrecorded = files - records.keys()
    if not unrecorded:
        return
    found = 0
    for objpath, raw in backend.read_many(sorted(manifest.record_path(p) for p in unrecorded)):
        rec = manifest.decoded(raw, objpath)
        if rec is None or rec.kind != "file" or rec.path not in unrecorded:
            continue  # garbage, or not this file's: it stays with no record (a load looks again)
        records[rec.path] = rec
        image.learn(objpath, rec)
        found += 1
    if found:
        log.warning("the store's manifest index was short of %d records of its files: read from their objects", found)


DIR_MOVE = "dirmove:"  # a symlink's or directory's record's source, written at its new name by a directory move on a local store


def dir_move_source(base: str, old: str, dst: str) -> str:
    """The source of a symlink's or a directory's record written at its new
    name by a directory's move on a local store (one rename(2) of `base`,
    to `dst`), before that move; its record at `old` is deleted after it."""
    return f"{DIR_MOVE}{base}\0{old}\0{dst}"


def _left_by_a_directory_move(backend: Backend, records: dict[str, Record], dirs: set[str]) -> list[str]:
    """Of `records` (those of symlinks and directories, by path), those a crash in a directory move on a
    local store left behind (`dir_move_source`; neither kind has bytes in
    the store to tell where the crash left it): the move's records at the
    new names, where the store shows the directory still at `base` and
    nothing at `dst`; the records at the old names, where it shows the
    reverse. Both there (a directory made again since at either name) tells
    nothing: both stay."""
    out = []
    for path, rec in records.items():
        if rec.kind not in ("symlink", "dir") or not rec.source.startswith(DIR_MOVE):
            continue
        parts = rec.source[len(DIR_MOVE):].split("\0")
        if len(parts) != 3 or not all(map(nameable, parts)):
            continue  # not one ckptfs wrote: a damaged or hostile record must not stop a restart
        base, old, dst = parts
        was = records.get(old)
        if was is None or was.kind != rec.kind or was.target != rec.target:
            continue  # the usual case: the move finished, the old record went
        at_base, at_dst = base in dirs or backend.exists(base), dst in dirs or backend.exists(dst)
        if at_base != at_dst:
            out.append(path if at_base else old)
    return list(dict.fromkeys(out))  # each once (hostile records may name one old record twice)


def _refuse_nested(backend: Backend, entries: list[Entry]) -> None:
    """A store with another ckptfs store inside it (`run2/.ckptfs/files/`,
    its daemons, its index) is not mounted: the mount would show that
    store's records and staging as files of its own, publish into it behind
    its daemon's back, and delete it, metadata and all, with a directory."""
    inner = f"/{META}/"
    nested = sorted({head for e in entries if inner in e.path
                     for head, _, tail in [e.path.partition(inner)] if tail.split("/")[0] in _STORE_MARKS})
    if nested:
        raise StoreError(f"the store {backend.url} holds another ckptfs store at {nested[0]} ({nested[0]}/{META}/)"
                         f"{f' and {len(nested) - 1} more' if len(nested) > 1 else ''}: this mount would take its files and its "
                         f"metadata for its own; mount that store on its own, or give this mount a directory that holds no other store")


_STORE_MARKS = frozenset({"files", "daemons", "index", "image", "staging"})  # what a ckptfs store keeps under its .ckptfs/


NAME_MAX = 255  # bytes in one name, on Linux


def _nameable(entries: list[Entry], records: dict[str, Record], listed: bool = False) -> tuple[list[Entry], dict[str, Record]]:
    """An object store takes keys no file system can name: `a//b`, `./a`,
    `a/..`, a name over NAME_MAX bytes (S3 keys run to 1,024 bytes), a NUL.
    Such an object (written by another tool) is left out of the mount with
    a warning, and stays in the store; one would stop every restart.
    `listed`: the entries are a file system's listing (a store of real
    directories): each one can be named, and so can a record at its path."""
    unlisted = records.keys() - {e.path for e in entries} if listed else records
    if (listed or not any(map(_suspect, (e.path for e in entries)))) and not any(map(_suspect, unlisted)):
        return entries, records
    for e in entries:
        if not e.is_dir and not nameable(e.path):
            log.warning("the store holds %s, which no file system can name: left out of the mount (it stays in the store)", e.path)
    return ([e for e in entries if not _suspect(e.path) or nameable(e.path)],
            {p: r for p, r in records.items() if not _suspect(p) or nameable(p)})


def _suspect(path: str) -> bool:
    """Cheap: False for a path that is surely nameable (almost all of them;
    "" is the root, whose directory record the store keeps too)."""
    return path != "" and ("//" in path or "/." in path or path[0] in "./" or path[-1] == "/" or "\0" in path or len(path) > NAME_MAX)


def nameable(path: str) -> bool:
    """Whether a file system can name `path` (each part: not empty, `.` or `..`, no NUL, at most NAME_MAX bytes)."""
    return all(part not in ("", ".", "..") and "\0" not in part and len(part.encode(errors="surrogateescape")) <= NAME_MAX
               for part in path.split("/"))


def _one_per_name(entries: list[Entry]) -> tuple[list[Entry], set[str]]:
    """An object store can hold an object `a` and objects under `a/` (S3,
    GCS), which a file system cannot show together: the directory is shown,
    and the file left out of the mount with a warning (it stays in the
    store). Returns the entries to show, and the files left out."""
    dirs = {e.path for e in entries if e.is_dir}
    hidden = {e.path for e in entries if not e.is_dir and e.path in dirs}
    for path in sorted(hidden):
        log.warning("the store holds a file %s and files under %s/: the mount shows the directory, not the file "
                    "(rename the object in the store to see it)", path, path)
    return ([e for e in entries if e.is_dir or e.path not in hidden] if hidden else entries), hidden


def _above(path: str) -> Iterator[str]:
    """The directories above `path`, top down."""
    at = path.find("/")
    while at != -1:
        yield path[:at]
        at = path.find("/", at + 1)


# -- whole files, straight to and from the store --------------------------------
def write_file(backend: Backend, path: str, data: bytes | memoryview, mode: int = 0o644) -> Digest:
    """Publish `data` at `path` as the engine would: staged, recorded, then
    visible in one step (C2), checksummed (C6). Without a daemon (C7): the
    next mount must read every record again (`manifest.mark_outside`)."""
    if backend.records_changed is None:
        manifest.mark_outside(backend)
    view = memoryview(data).cast("B")
    pieces = (view[i : i + PIECE] for i in range(0, len(view), PIECE))
    staged, digest = stage(backend, pieces, len(view), name=path)
    try:
        try:
            old = manifest.read(backend, path)
        except manifest.UNREADABLE:  # garbage where the record goes: replaced
            old = None
        rec = Record(path, "file", digest, old.current if old is not None and old.kind == "file" else None, mode, time.time_ns(),
                     written_ns=time.time_ns(), source=f"staged:{staged.token}" if staged.token else f"put:{backend.daemon_id}")
        publish(backend, rec, staged, path, digest, lambda: (view[i : i + PIECE] for i in range(0, len(view), PIECE)))
    except BaseException:
        with contextlib.suppress(Exception):  # the first error is the one to tell
            backend.discard(staged)
        raise
    if backend.records_changed is None:  # written: a daemon that lives on takes it into its mount (`outside.py`)
        manifest.mark_outside(backend, path)
    return digest


def read_file(backend: Backend, path: str) -> bytes:
    """The bytes at `path`, verified against the manifest (IntegrityError if
    they do not match; files with no record are returned as they are)."""
    out = io.BytesIO()
    copy_file(backend, path, out)
    return out.getvalue()


def copy_file(backend: Backend, path: str, out: BinaryIO) -> Digest:
    """The bytes at `path` into `out` (a file open for writing), piece by
    piece as the store gives them, never the whole file in memory; verified
    against the manifest once all of it is written (IntegrityError: what
    `out` got is not to be used; files with no record are copied as they
    are)."""
    h = manifest.hasher()
    n = 0
    for piece in backend.read(path):
        h.update(piece)
        n += len(piece)
        out.write(piece)
    digest = Digest(n, h.hexdigest())
    rec = manifest.read(backend, path)
    if rec is not None and rec.kind == "file" and rec.matches(digest.size, digest.xxh3) is None:
        raise IntegrityError(f"{path}: checksum mismatch: the store has {digest}, the manifest says {rec.current}")
    return digest
