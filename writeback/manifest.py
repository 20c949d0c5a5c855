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

import json
from dataclasses import dataclass, field

import xxhash

from .backend import META, Backend

PREFIX = f"{META}/files"
VERSION = 1


BLOCK = 64 << 20  # a load verifies and serves a file block by block (C6)


@dataclass(frozen=True)
class Digest:
    """A file's size and xxh3-128, and for files of more than one BLOCK the
    xxh3-128 of each BLOCK in order, so that a load can serve each block as
    soon as it is verified. Two digests are equal when size and hash are."""

    size: int
    xxh3: str  # xxh3-128, hex
    blocks: tuple[str, ...] = field(default=(), compare=False)

    def block(self, i: int) -> str | None:
        """The hash block `i` must have; None if only the whole file's is known."""
        if self.blocks:
            return self.blocks[i] if i < len(self.blocks) else None
        return self.xxh3 if i == 0 and self.size <= BLOCK else None


@dataclass(frozen=True)
class Meta:
    """What an entry carries besides its bytes, as the mount shows it."""

    mode: int = 0o644  # permission bits, set-ID and sticky bits included (S_IMODE)
    uid: int | None = None  # None: not recorded (a restart gives the mount's owner, and no set-ID bits)
    gid: int | None = None
    mtime_ns: int = 0


@dataclass(frozen=True)
class Record:
    path: str
    kind: str  # "file", "symlink" or "dir"
    current: Digest | None = None
    previous: Digest | None = None
    mode: int = 0o644
    mtime_ns: int = 0
    target: str = ""  # symlinks
    written_ns: int = 0  # when the bytes were sealed (daemon) or written (store fallback): the newer wins
    source: str = ""  # where the bytes come from while being published: "staged:<path>", "move:<path>", "copy:<path>", "put:<daemon>"
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
                d[k] = {"size": d[k].size, "xxh3": d[k].xxh3, "blocks": d[k].blocks}
        return json.dumps({"version": VERSION, **d}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Record:
        d = json.loads(raw)
        d.pop("version", None)
        d = {k: v for k, v in d.items() if k in _FIELDS}  # fields of later versions are ignored
        for k in ("current", "previous"):
            if d.get(k) is not None:
                d[k] = Digest(d[k]["size"], d[k]["xxh3"], tuple(d[k].get("blocks", ())))
        return cls(**d)


_FIELDS = {f for f in Record.__dataclass_fields__}


def record_path(path: str) -> str:
    h = xxhash.xxh3_128_hexdigest(path.encode("utf-8", "surrogateescape"))
    return f"{PREFIX}/{h[:2]}/{h}.json"


def write(backend: Backend, record: Record) -> None:
    backend.put(record_path(record.path), record.encode())


def read(backend: Backend, path: str) -> Record | None:
    try:
        return Record.decode(backend.read_all(record_path(path)))
    except FileNotFoundError:
        return None


def delete(backend: Backend, path: str) -> None:
    backend.delete(record_path(path))


def read_all(backend: Backend) -> tuple[dict[str, Record], list[str]]:
    """Every record in the store, by path, and the record objects that could
    not be read (their files cannot be verified: reading them is an error)."""
    out = {}
    unreadable = []
    for entry in backend.find(PREFIX):
        if not entry.endswith(".json"):
            continue
        try:
            rec = Record.decode(backend.read_all(entry))
        except FileNotFoundError:
            continue
        except (ValueError, TypeError, KeyError):
            unreadable.append(entry)
            continue
        out[rec.path] = rec
    return out, unreadable


def hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


class Hashing:
    """The digest of bytes fed in order: the whole and each BLOCK."""

    def __init__(self) -> None:
        self.size = 0
        self._whole = hasher()
        self._block = hasher()
        self.blocks: list[str] = []  # the hashes of the whole blocks so far

    def update(self, piece) -> None:
        view = memoryview(piece).cast("B")
        while view:
            k = min(len(view), BLOCK - self.size % BLOCK)
            self._whole.update(view[:k])
            self._block.update(view[:k])
            self.size += k
            view = view[k:]
            if self.size % BLOCK == 0:
                self.blocks.append(self._block.hexdigest())
                self._block = hasher()

    def digest(self) -> Digest:
        blocks = self.blocks + ([self._block.hexdigest()] if self.size % BLOCK else [])
        return Digest(self.size, self._whole.hexdigest(), tuple(blocks) if len(blocks) > 1 else ())


def digest_of(pieces) -> Digest:
    h = Hashing()
    for p in pieces:
        h.update(p)
    return h.digest()
