"""Checksums and metadata of published files, kept in the store (C6).

One small JSON record per published path, at
`.ckptfs/files/<h[:2]>/<h>.json` where h is the xxh3-128 of the path (the
path itself is inside): no name-length limits, no clash between a record and
a directory of records. A record is written *before* its data is published and keeps the previous
generation's checksum too, so whichever of the two is in the store after a
crash between the two steps verifies, and a store never holds a file that
its manifest cannot vouch for.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import time
import uuid
import zlib
from typing import NamedTuple

import xxhash

from .backend import INDEX, META, UNKNOWN, Backend

log = logging.getLogger(__name__)

PREFIX = f"{META}/files"
VERSION = 1


BLOCK = 16 << 20  # a load verifies and serves a file block by block (C6); the block of every digest made now
OLD_BLOCK = 64 << 20  # the block of digests made before 2026-11-29 (their records say no "block_size")
_BLOCKS = (BLOCK, OLD_BLOCK)
LEAD = 1 << 20  # a load serves a file's first bytes once they verify, before the rest of their block: a reader's first requests


class Digest(NamedTuple):  # a tuple, as Record
    """A file's size and xxh3-128, and for files of more than one block the
    xxh3-128 of each block (`block_size` bytes) in order, so that a load can
    serve each block as soon as it is verified; for files of more than LEAD
    bytes, the xxh3-128 of their first LEAD bytes too (`lead`; "" in
    digests made before 2026-12-02), so that a reader's first bytes need
    not wait for the rest of the first block. Two digests are equal when
    size and hash are."""

    size: int
    xxh3: str  # xxh3-128, hex
    blocks: tuple[str, ...] = ()
    block_size: int = BLOCK
    lead: str = ""  # xxh3-128 of the first LEAD bytes, hex ("": not recorded, or a file of LEAD bytes or fewer)

    def block(self, i: int, unit: int) -> str | None:
        """The hash the `i`-th `unit` bytes of the file must have; None if
        this digest cannot tell (its blocks are of another size)."""
        if self.size <= unit:
            return self.xxh3 if i == 0 else None  # the whole file
        if unit != self.block_size or len(self.blocks) != -(-self.size // unit):
            return None
        return self.blocks[i] if i < len(self.blocks) else None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Digest) and self.size == other.size and self.xxh3 == other.xxh3

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((self.size, self.xxh3))


class Meta(NamedTuple):  # a tuple: a restart makes one per file in the store
    """What an entry carries besides its bytes, as the mount shows it."""

    mode: int = 0o644  # permission bits, set-ID and sticky bits included (S_IMODE)
    uid: int | None = None  # None: not recorded (a restart gives the mount's owner, and no set-ID bits)
    gid: int | None = None
    mtime_ns: int | None = None  # None: not recorded (a restart gives the time of the restart); 0 is 1970


class Record(NamedTuple):
    """What the store keeps of a published path besides its bytes. A tuple:
    a restart makes one per file in the store, straight from its row in the
    index (`_of_row`)."""

    path: str
    kind: str  # "file", "symlink" or "dir"
    current: Digest | None = None
    previous: Digest | None = None
    mode: int = 0o644
    mtime_ns: int | None = None  # None: not recorded
    target: str = ""  # symlinks
    written_ns: int = 0  # when the bytes were sealed (daemon) or written (store fallback): the newer wins
    # where the bytes come from while being published: "staged:<path>", "move:<path>", "copy:<path>", "put:<daemon>",
    # "delete:<daemon>" (being deleted), "hidden:<hidden name> <old path>" (an exchange on an object store);
    # a symlink's or a directory's: "dirmove:<directory moved>\0<old path>\0<new directory>" (`storeio.dir_move_source`)
    source: str = ""
    uid: int | None = None
    gid: int | None = None

    @classmethod
    def of(cls, path: str, kind: str, meta: Meta, **fields) -> Record:
        return cls(path, kind, mode=meta.mode, mtime_ns=meta.mtime_ns, uid=meta.uid, gid=meta.gid, **fields)

    @property
    def meta(self) -> Meta:
        return Meta(self.mode, self.uid, self.gid, self.mtime_ns)

    def matches(self, size: int, xxh3: str | None = None) -> Digest | None:
        """The digest (current or previous) that data of this size/hash matches."""
        for d in (self.current, self.previous):
            if d is not None and d.size == size and (xxh3 is None or d.xxh3 == xxh3):
                return d
        return None

    def encode(self) -> bytes:
        d = {name: getattr(self, name) for name in _FIELDS}  # what asdict gives, without its deep copies
        for k in ("current", "previous"):
            if d[k] is not None:
                d[k] = digest_dict(d[k])
        return json.dumps({"version": VERSION, **d}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Record:
        return cls.of_dict(json.loads(raw))

    @classmethod
    def of_dict(cls, d: dict) -> Record:
        d = {k: v for k, v in d.items() if k in _FIELDS}  # "version", and fields of later versions, are ignored
        for k in ("current", "previous"):
            if d.get(k) is not None:
                d[k] = digest_of_dict(d[k])
        return checked(cls(**d))


_FIELDS = frozenset(Record._fields)
_tuple = tuple.__new__  # a Record or Digest of a row in field order, without NamedTuple's __new__ (a restart makes one per file)
UNREADABLE = (ValueError, TypeError, KeyError, AttributeError)  # what decoding a record that is not one raises
KINDS = frozenset({"file", "symlink", "dir"})
_NS = 1 << 63  # times are signed 64-bit nanoseconds
_ID = 1 << 32  # uids and gids


def checked(rec: Record) -> Record:
    """`rec` if every field has the type and range ckptfs writes, else
    ValueError. A store is input: an object another tool, a torn write or
    someone hostile left must not stop a restart, nor give the mount a mode,
    owner or time it cannot show (such a record reads as unreadable)."""
    _check(rec.path, rec.kind, rec.mode, rec.mtime_ns, rec.written_ns, rec.target, rec.source, rec.uid, rec.gid)
    if not (_digest_ok(rec.current) and _digest_ok(rec.previous)):
        raise ValueError(f"a record with a digest ckptfs never writes: {rec.path!r:.200}")
    return rec


def _check(path, kind, mode, mtime_ns, written_ns, target, source, uid, gid) -> None:
    if not (type(path) is str and kind in KINDS and type(mode) is int and 0 <= mode <= 0o7777
            and (mtime_ns is None or (type(mtime_ns) is int and -_NS <= mtime_ns < _NS))
            and type(written_ns) is int and type(target) is str and type(source) is str
            and (uid is None or (type(uid) is int and 0 <= uid < _ID)) and (gid is None or (type(gid) is int and 0 <= gid < _ID))):
        raise ValueError(f"a record with fields ckptfs never writes: {path!r:.200}")


def _digest_ok(d: Digest | None) -> bool:
    if d is None:
        return True
    size, blocks = d.size, d.blocks
    return (type(size) is int and 0 <= size < _NS and type(d.xxh3) is str and type(d.block_size) is int and d.block_size in _BLOCKS
            and (not blocks or all(type(b) is str for b in blocks)) and type(d.lead) is str and (not d.lead or size > LEAD))


def _as_before(d: Digest) -> bool:
    """Whether a daemon of before could have written `d` (no blocks: a file
    of one block, told by its size alone; or blocks of OLD_BLOCK): then its
    record and index row are written as such a daemon wrote them."""
    return not d.blocks or d.block_size == OLD_BLOCK


def digest_dict(d: Digest) -> dict:
    """A digest as its record holds it: as before (`_as_before`), else with
    its blocks under keys a daemon of before does not know (it verifies
    those files whole, instead of failing them); and its lead's hash, with
    the lead's size, under keys of their own (a daemon of before ignores
    them)."""
    if _as_before(d):
        out = {"size": d.size, "xxh3": d.xxh3, "blocks": d.blocks}
    else:
        out = {"size": d.size, "xxh3": d.xxh3, "block_size": d.block_size, "block_xxh3": d.blocks}
    if d.lead:
        out["lead_size"], out["lead_xxh3"] = LEAD, d.lead
    return out


def digest_of_dict(d: dict) -> Digest:
    """`digest_dict`'s inverse (ValueError, TypeError or KeyError if `d` is no digest)."""
    lead = _lead_of(d.get("lead_size"), d.get("lead_xxh3"))
    if "block_size" in d:
        digest = Digest(d["size"], d["xxh3"], tuple(d["block_xxh3"]), d["block_size"], lead)
    else:
        digest = Digest(d["size"], d["xxh3"], tuple(d.get("blocks", ())), OLD_BLOCK, lead)
    if not _digest_ok(digest):
        raise ValueError(f"a digest ckptfs never writes: {d!r:.200}")
    return digest


def _lead_of(size: object, xxh3: object) -> str:
    """A lead's hash as a record or row gives it with its size: "" if it
    gives none, or one of another size than LEAD (not verifiable here)."""
    if size is None and xxh3 is None:
        return ""
    if type(size) is not int or type(xxh3) is not str or not xxh3:
        raise ValueError(f"a lead ckptfs never writes: {size!r:.50} {xxh3!r:.50}")
    return xxh3 if size == LEAD else ""


def digest_row(d: Digest | None) -> list | None:
    """A digest as a row of the index or an event: [size, xxh3, blocks,
    block_size], or without the block size as before (`_as_before`), and
    with the lead's size and hash after it if it has one (a daemon of
    before reads no index with such rows: it reads every record instead)."""
    if d is None:
        return None
    if d.lead:
        return [d.size, d.xxh3, list(d.blocks), d.block_size, LEAD, d.lead]
    if _as_before(d):
        return [d.size, d.xxh3, list(d.blocks)]
    return [d.size, d.xxh3, list(d.blocks), d.block_size]


def digest_of_row(row: list) -> Digest:
    """`digest_row`'s inverse (ValueError if `row` is no digest)."""
    n = len(row)
    if n == 3:
        (size, xxh3, blocks), block_size, lead = row, OLD_BLOCK, ""
    elif n == 4:
        (size, xxh3, blocks, block_size), lead = row, ""
    elif n == 6:
        size, xxh3, blocks, block_size, lead_size, lead = row
        lead = _lead_of(lead_size, lead)
    else:
        raise ValueError(f"a digest ckptfs never writes: {row!r:.200}")
    if type(block_size) is int and block_size == BLOCK:
        block_size = BLOCK  # one int for all (a restart makes a digest per file)
    d = _tuple(Digest, (size, xxh3, tuple(blocks), block_size, lead))
    if not _digest_ok(d):
        raise ValueError(f"a digest ckptfs never writes: {row!r:.200}")
    return d


_RECORD_OBJECT = re.compile(re.escape(PREFIX) + r"/[0-9a-f]{2}/[0-9a-f]{32}\.json")  # what `record_path` makes


def record_path(path: str) -> str:
    h = xxhash.xxh3_128_hexdigest(path.encode("utf-8", "surrogateescape"))
    return f"{PREFIX}/{h[:2]}/{h}.json"


def write(backend: Backend, record: Record) -> None:
    objpath = changing(backend, record_path(record.path))
    left: object = UNKNOWN
    try:
        backend.put(objpath, record.encode())
        left = record
    finally:
        changed(backend, objpath, left)


def write_many(backend: Backend, records: list[Record]) -> None:
    """`write` of many records made durable together (one group commit,
    `Backend.publish_group`): a directory rename rewrites a record for each
    file under it, and one fsync each made it a publication stall of a
    second per thousand files."""
    objpaths = [changing(backend, record_path(rec.path)) for rec in records]
    done = False
    try:
        backend.publish_group([(objpath, rec.encode()) for objpath, rec in zip(objpaths, records, strict=True)], [])
        done = True
    finally:
        for objpath, rec in zip(objpaths, records, strict=True):
            changed(backend, objpath, rec if done else UNKNOWN)


def delete_many(backend: Backend, paths: list[str]) -> None:
    """`delete` of many records (`Backend.delete_many`)."""
    objpaths = [changing(backend, record_path(path)) for path in paths]
    done = False
    try:
        backend.delete_many(objpaths)
        done = True
    finally:
        for objpath in objpaths:
            changed(backend, objpath, None if done else UNKNOWN)


def read(backend: Backend, path: str) -> Record | None:
    """`path`'s record; raises one of UNREADABLE where its object holds
    something else (garbage, or another path's record)."""
    try:
        rec = Record.decode(backend.read_all(record_path(path)))
    except FileNotFoundError:
        return None
    if rec.path != path:
        raise ValueError(f"the record object of {path!r:.200} holds the record of {rec.path!r:.200}")
    return rec


def delete(backend: Backend, path: str) -> None:
    objpath = changing(backend, record_path(path))
    left: object = UNKNOWN
    try:
        backend.delete(objpath)
        left = None
    finally:
        changed(backend, objpath, left)


def changing(backend: Backend, objpath: str) -> str:
    """Note that a call is about to change the record object `objpath`
    (see Image); `changed` once it ended, whatever its outcome."""
    if backend.records_changed is not None:
        backend.records_changed.begin(objpath)
    return objpath


def changed(backend: Backend, objpath: str, left: object = UNKNOWN) -> None:
    """A call that changed `objpath` ended, leaving there `left`: the
    Record written, None (deleted), or UNKNOWN (it failed: the next image
    save reads the object again)."""
    if backend.records_changed is not None:
        backend.records_changed.end(objpath, left)


def read_all(backend: Backend) -> tuple[dict[str, Record], list[str]]:
    """Every record in the store, by path, and the record objects that could
    not be read (their files cannot be verified: reading them is an error)."""
    return Image.of_store(backend).records()


# -- the manifest in one object -------------------------------------------------
# Reading one record object per file makes a restart over 100,000 files take
# many seconds (and over S3 one request per file). So every record is also
# kept in one object, an image of them all, and the next mount reads that
# instead (it still lists the store: the store's files are what the mount
# shows; the image only stands in for their records). Two objects hold one:
# - INDEX, left by a clean exit: exact as long as nothing changed a record
#   since. A daemon claiming the store moves it to IMAGE (records change
#   from then on), and anyone changing records without a daemon (the torch
#   helpers' direct writes, C7) first leaves a mark under OUTSIDE; the next
#   mount then reads every record (and only then are the marks removed).
# - IMAGE, saved by a running daemon now and then (`Engine.save_image`), so a restart
#   after a crash need not read every record either. It says when it was
#   saved (`since`, the store's own time of an object put just before):
#   the next mount lists the record objects with their times of change
#   and reads only those changed since then (less a margin for the store's
#   clock) or missing from the image; what it lists no more is gone.
# A daemon notes every record object it changes, when the call begins and
# once it ended (`changing`, `changed`); saving an image reads those again, so it
# holds what each was after the `since` object was put, except those a call
# was still changing (left out: a restart reads them). A change that lands
# later is noted for the next image, and is newer than this one.
OUTSIDE = f"{META}/outside"
IMAGE_BEGUN = f"{META}/image-begun"  # put just before an image is saved: its time is the image's `since`
IMAGE_VERSION = 2
CLOCK_MARGIN_S = 2.0  # records changed this long before an image's `since` are read again all the same (the store's clock: S3 times are whole seconds)


class OlderImage(ValueError):
    """An index or image left by an older ckptfs."""


class Image:
    """Every record object of the store: its path -> the record, or None
    where it cannot be read; `since`: the store's time it holds them as of
    (None: unknown)."""

    def __init__(self, objects: dict[str, Record | None], packed: bytes | None = None, since: float | None = None) -> None:
        self.objects = objects
        self.since = since
        self._packed = packed  # as read from the index, while unchanged
        # Packed, and the paths (encoded) of the records taken from it: their lines are copied when packed
        self._from: tuple[bytes, set[bytes]] | None = None

    @classmethod
    def of_store(cls, backend: Backend, base: Image | None = None) -> Image:
        """Every record object in the store; with `base` (an image, or an
        index no longer exact), only those changed since it, or missing from
        it, are read; the rest come from it."""
        stamps = {p: t for p, t in backend.stamped(PREFIX).items() if _RECORD_OBJECT.fullmatch(p)}  # not a planted name
        objects: dict[str, Record | None] = {}
        if base is not None and base.since is not None:
            after = base.since - CLOCK_MARGIN_S
            objects = {p: rec for p, rec in base.objects.items() if p in stamps and (t := stamps[p]) is not None and t < after}
        taken = {objpath.encode() for objpath in objects}
        unread = sorted(p for p in stamps if p not in objects)
        if base is not None:
            log.info("reading %d of %d records: changed since the manifest image, or not in it", len(unread), len(stamps))
        for objpath, raw in backend.read_many(unread):
            objects[objpath] = decoded(raw, objpath)
        image = cls(objects, since=base.since if base is not None and base.since is not None else None)
        if base is not None and base._packed is not None and taken:
            image._from = (base._packed, taken)
        return image

    @staticmethod
    def packed_in(backend: Backend, name: str = INDEX) -> bytes | None:
        """The bytes of object `name` (INDEX or IMAGE), if it is there (`of_packed` decodes them)."""
        try:
            return backend.read_all(name)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.EISDIR):
                raise  # the store failing: tried again
            log.warning("the store's manifest %s is no file (%s; ckptfs never follows a symlink): reading every record instead", name, exc)
            return None

    @classmethod
    def of_packed(cls, packed: bytes | None, name: str = INDEX) -> Image | None:
        """The image `packed` holds (`packed_in` object `name`), if it is readable."""
        if packed is None:
            return None
        try:
            return cls.unpacked(packed)
        except OlderImage as exc:
            log.info("the store's manifest %s is of an older version (%s): reading every record instead", name, exc)
            return None
        except (ValueError, TypeError, KeyError, IndexError, zlib.error) as exc:
            log.warning("the store's manifest %s cannot be read (%s): reading every record instead", name, exc)
            return None

    def packed(self) -> bytes:
        """The image as the index holds it, compressed: a line of its version
        and time, then one line per record object, `<path>\t<row>` (compact:
        a daemon keeps this, not the records; and a save rewrites only the
        lines of the records that changed)."""
        if self._packed is None:
            base, taken = self._from or (None, set())
            kept = [line for line in _lines(base)[1] if line.partition(b"\t")[0] in taken] if base is not None else []
            fresh = [_line(objpath, rec) for objpath, rec in self.objects.items() if objpath.encode() not in taken]
            self._packed = _pack(self.since, kept + fresh)
        return self._packed

    @classmethod
    def unpacked(cls, packed: bytes) -> Image:
        since, lines = _lines(packed)
        keys, rows = [], []
        for line in lines:
            key, tab, row = line.partition(b"\t")
            if not tab:
                raise ValueError("a line with no tab")
            keys.append(key.decode())
            rows.append(row)
        values = json.loads(b"[" + b",".join(rows) + b"]")  # one parse for all rows
        return cls({k: None if v is None else _of_row(v) for k, v in zip(keys, values, strict=True)}, packed, since)

    def records(self) -> tuple[dict[str, Record], list[str]]:
        """By path, and the record objects that could not be read (their
        files cannot be verified: reading them is an error)."""
        out: dict[str, Record] = {}
        unreadable = []
        for objpath, rec in self.objects.items():
            if rec is None:
                unreadable.append(objpath)
            else:
                out[rec.path] = rec
        return out, unreadable

    def learn(self, objpath: str, rec: Record) -> None:
        """A record object the image did not have (see `storeio.scan`): packed again."""
        self.objects[objpath] = rec
        self._packed = None

    def forget(self, objpaths) -> None:
        for objpath in objpaths:
            self.objects.pop(objpath, None)
            if self._from is not None:
                self._from[1].discard(objpath.encode())
        self._packed = None

    @staticmethod
    def saved(backend: Backend, packed: bytes, changed: dict[str, object], since: float | None, name: str) -> tuple[bytes, int]:
        """A daemon's image of every record as of `since` (`image_time`)
        into object `name` (IMAGE, or INDEX at a clean exit): `packed`
        (its image as of its scan or last save) with the record objects
        noted as `changed` since then (`Changes.take`) as the calls that
        changed them left them, and those whose outcome is not known read
        again; returns it packed, and how many records it holds. Those that
        a call is still changing are left out (a restart reads them): what
        it changes may land later, and an object store may give it a time
        before `since` (when its request began). Lines of records that did
        not change are copied as they are. Store calls."""
        unsettled = backend.records_changed.under_way() if backend.records_changed is not None else set()
        settled = {objpath: left for objpath, left in changed.items() if objpath not in unsettled}
        fresh = [_line(objpath, left) for objpath, left in settled.items() if isinstance(left, Record)]
        unknown = sorted(objpath for objpath, left in settled.items() if left is UNKNOWN)
        fresh += [_line(objpath, decoded(raw, objpath)) for objpath, raw in backend.read_many(unknown)]
        gone = {objpath.encode() for objpath in changed.keys() | unsettled}
        _, lines = _lines(packed)
        kept = [line for line in lines if line.partition(b"\t")[0] not in gone]
        out = _pack(since, [*kept, *fresh])
        backend.put(name, out)
        return out, len(kept) + len(fresh)


def _line(objpath: str, rec: Record | None) -> bytes:
    return f"{objpath}\t{'null' if rec is None else json.dumps(_row(rec), separators=(',', ':'))}".encode()


def _pack(since: float | None, lines: list[bytes]) -> bytes:
    return zlib.compress(b"\n".join([json.dumps({"version": IMAGE_VERSION, "since": since}).encode(), *lines]), 1)


def _lines(packed: bytes) -> tuple[float | None, list[bytes]]:
    """An image's time and its record lines."""
    head, _, body = zlib.decompress(packed).partition(b"\n")
    d = json.loads(head)
    version = d["version"]
    if version != IMAGE_VERSION:
        raise (OlderImage if isinstance(version, int) and version < IMAGE_VERSION else ValueError)(f"version {version}")
    since = d["since"]
    if since is not None and not isinstance(since, int | float):
        raise ValueError(f"bad time {since!r}")
    return since, body.split(b"\n") if body else []


def image_time(backend: Backend) -> float | None:
    """The store's time now, as an image's `since` (None: the store gives no times)."""
    backend.put(IMAGE_BEGUN, b"")
    return backend.stamp(IMAGE_BEGUN)


def decoded(raw: bytes, objpath: str) -> Record | None:
    """The bytes of record object `objpath` decoded; None if they are not
    a record (garbage where one goes), or the record of a path whose object
    `objpath` is not (never written there: ckptfs writes a record only at
    its path's object)."""
    try:
        rec = Record.decode(raw)
    except UNREADABLE:
        return None
    return rec if record_path(rec.path) == objpath else None


def _row(rec: Record) -> list:
    return [rec.path, rec.kind, digest_row(rec.current), digest_row(rec.previous), rec.mode, rec.mtime_ns, rec.target,
            rec.written_ns, rec.source, rec.uid, rec.gid]


def _of_row(row: list) -> Record:
    path, kind, cur, prev, mode, mtime_ns, target, written_ns, source, uid, gid = row  # the fields of Record, in order
    _check(path, kind, mode, mtime_ns, written_ns, target, source, uid, gid)
    if cur is not None:
        row[2] = digest_of_row(cur)
    if prev is not None:
        row[3] = digest_of_row(prev)
    return _tuple(Record, row)


def mark_outside(backend: Backend, path: str = "") -> None:
    """Records are about to change without a daemon: the index is not to be
    trusted. Or, given `path`: the file there was written (published) without
    a daemon, and a daemon that lives on takes it into its mount
    (`outside.py`). Named by the time they are made, so listed in order."""
    backend.put(f"{OUTSIDE}/{time.time_ns():020d}-{uuid.uuid4().hex}", path.encode("utf-8", "surrogateescape"))


def hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


class Hashing:
    """The digest of bytes fed in order: the whole, each block (`block`
    bytes: BLOCK, or OLD_BLOCK to check a digest of before) and the lead (the first LEAD bytes)."""

    def __init__(self, block: int = BLOCK) -> None:
        self.size, self.block = 0, block
        self._whole = hasher()
        self._block = hasher()
        self.blocks: list[str] = []  # the hashes of the whole blocks so far
        self.lead = ""  # the hash of the first LEAD bytes, once they are in

    def update(self, piece) -> None:
        view = memoryview(piece).cast("B")
        block = self.block
        while view:
            k = min(len(view), block - self.size % block, LEAD - self.size if self.size < LEAD else len(view))
            self._whole.update(view[:k])
            self._block.update(view[:k])
            self.size += k
            view = view[k:]
            if self.size == LEAD:  # (the first block's hash so far: LEAD is less than any block)
                self.lead = self._block.hexdigest()
            if self.size % block == 0:
                self.blocks.append(self._block.hexdigest())
                self._block = hasher()

    def digest(self) -> Digest:
        blocks = self.blocks + ([self._block.hexdigest()] if self.size % self.block else [])
        return Digest(self.size, self._whole.hexdigest(), tuple(blocks) if len(blocks) > 1 else (), self.block,
                      self.lead if self.size > LEAD else "")


def digest_of(pieces, block: int = BLOCK) -> Digest:
    h = Hashing(block)
    for p in pieces:
        h.update(p)
    return h.digest()
