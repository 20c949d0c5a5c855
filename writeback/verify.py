"""Re-read published files from the store and check them against the manifest.

A store can be verified while its daemon publishes into it. Every record is
read first, then every file, so a file published, moved or deleted in
between looked corrupt, missing or extra against its record of before.
Each such finding is therefore looked at again, on its own: its record
read before and after its bytes (a publication changes the record first,
then the data; a move and a deletion change the data, then the record).
An object store may say so itself: s3fs fails a read whose object was
replaced midway (`FileExpired`, EBUSY), which is looked at again too. A
file the store fails to read (EIO) is reported as corrupt, and the rest
verified.
A finding stands once two looks in a row, a moment apart, find the same
record, the same bytes and the same fault; one that turns out well (the
publication landed) goes.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import manifest
from .backend import Backend
from .localstore import SymlinkInStore
from .manifest import Digest, Record

LOOKS = 6  # at most, per finding
PAUSE_S = 0.1  # before the first look again; doubled each time (3.1 s in all)


@dataclass
class Report:
    ok: list[str] = field(default_factory=list)
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    missing: list[str] = field(default_factory=list)  # recorded, not in the store
    extra: list[str] = field(default_factory=list)  # in the store, not recorded

    @property
    def clean(self) -> bool:
        return not (self.corrupt or self.missing or self.extra)


def verify(backend: Backend, prefix: str = "", progress: Callable[[str, int], None] | None = None) -> Report:
    """Check size and xxh3-128 of every file under `prefix` against its record;
    `progress(path, size)` is called before each file is read."""
    all_records, unreadable = manifest.read_all(backend)
    records = {p: r for p, r in all_records.items() if _under(p, prefix)}
    unreadable_set = set(unreadable)
    report = Report()
    seen = set()
    for entry in backend.walk(prefix):
        if entry.is_dir:
            continue
        if progress is not None:
            progress(entry.path, entry.size)
        seen.add(entry.path)
        rec = records.get(entry.path)
        if rec is None and manifest.record_path(entry.path) in unreadable_set:
            report.corrupt.append((entry.path, "its record cannot be read"))
            continue
        if rec is None or rec.kind != "file":
            report.extra.append(entry.path)
            continue
        try:
            digest = _digest(backend, entry.path, rec)
        except FileNotFoundError:
            seen.discard(entry.path)
            continue
        except OSError as exc:
            if exc.errno == errno.EIO:  # this file cannot be read (a bad sector): said, and the others verified
                report.corrupt.append((entry.path, _cannot_read(exc)))  # looked at again below
                continue
            if exc.errno != errno.EBUSY:
                raise _about(exc, entry.path) from None
            report.corrupt.append((entry.path, "replaced while it was read"))  # looked at again below
            continue
        why = _unlike(digest, rec)
        if why is None:
            report.ok.append(entry.path)
        else:
            report.corrupt.append((entry.path, why))
    report.missing = sorted(p for p, r in records.items() if r.kind == "file" and p not in seen)
    return _looked_again(backend, report)


def _digest(backend: Backend, path: str, rec: Record | None) -> Digest:
    """The digest of the store's bytes at `path`, its blocks of the size `rec`'s current digest has."""
    block = rec.current.block_size if rec is not None and rec.current is not None else manifest.BLOCK
    return manifest.digest_of(backend.read(path), block)


def _unlike(digest: Digest, rec: Record) -> str | None:
    """Why the store's bytes (`digest`) are not what `rec` says; None if
    they are: size and hash of the file, each block's hash and the lead's, as a load
    checks them (block by block, where the record names as many blocks as
    the file has)."""
    d = rec.matches(digest.size, digest.xxh3)
    if d is None:
        return (f"store has {digest.size} bytes xxh3 {digest.xxh3}, manifest says "
                f"{rec.current.size if rec.current else '?'} bytes xxh3 {rec.current.xxh3 if rec.current else '?'}")
    if d.block_size == digest.block_size and len(d.blocks) == len(digest.blocks) and d.blocks != digest.blocks:
        i = next(i for i, (a, b) in enumerate(zip(d.blocks, digest.blocks, strict=True)) if a != b)
        return (f"the file matches its record's xxh3, but block {i} ({d.block_size >> 20} MiB blocks) not the record's hash "
                "of it: its record is damaged, and a load of that block fails")
    if d.lead and digest.lead and d.lead != digest.lead:
        return (f"the file matches its record's xxh3, but its first {manifest.LEAD} bytes not the record's hash of them: "
                "its record is damaged, and a load of the file fails")
    return None


def _looked_again(backend: Backend, report: Report) -> Report:
    """`report` with each finding looked at again (see the module's doc)."""
    found = [(p, "corrupt") for p, _ in report.corrupt] + [(p, "missing") for p in report.missing] + [(p, "extra") for p in report.extra]
    if not found:
        return report
    out = Report(ok=list(report.ok))
    last: dict[str, tuple] = {}
    pause = PAUSE_S
    for attempt in range(LOOKS):
        time.sleep(pause)
        pause *= 2
        left = []
        for path, before in found:
            seen = _look(backend, path)
            if seen is None:
                left.append((path, before))  # changed while looked at: look again
                continue
            fault, why, state = seen
            if fault == "ok":
                out.ok.append(path)
            elif fault is None:
                pass  # gone, record and file: a deletion or a move that landed
            elif last.get(path) == (fault, state) or attempt == LOOKS - 1:
                _add(out, path, fault, why)
            else:
                last[path] = (fault, state)
                left.append((path, fault))
                continue
            last.pop(path, None)
        found = left
        if not found:
            break
    for path, fault in found:  # changing at every look
        _add(out, path, fault, "changing while it was verified")
    out.missing.sort()
    return out


def _add(report: Report, path: str, fault: str, why: str) -> None:
    if fault == "corrupt":
        report.corrupt.append((path, why))
    elif fault == "missing":
        report.missing.append(path)
    else:
        report.extra.append(path)


def _look(backend: Backend, path: str) -> tuple[str | None, str, tuple] | None:
    """What `path` is now: (fault, why, what was seen) with fault "ok",
    "corrupt", "missing", "extra" or None (neither file nor record); None
    if its record changed while its bytes were read."""
    before = _record(backend, path)
    unreadable = None
    try:
        digest: Digest | None = _digest(backend, path, before if isinstance(before, Record) else None)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, SymlinkInStore):  # no file there (a symlink is never followed)
        digest = None
    except OSError as exc:
        if exc.errno == errno.EIO:
            digest, unreadable = None, _cannot_read(exc)
        elif exc.errno != errno.EBUSY:
            raise _about(exc, path) from None
        else:
            return None  # replaced while it was read: look again
    if _record(backend, path) != before:
        return None
    state = (before, digest, unreadable)
    if unreadable is not None:
        return "corrupt", unreadable, state
    if before == "unreadable":
        return ("corrupt", "its record cannot be read", state) if digest is not None else (None, "", state)
    rec = before if isinstance(before, Record) and before.kind == "file" else None
    if digest is None:
        return ("missing", "", state) if rec is not None else (None, "", state)
    if rec is None:
        return "extra", "", state
    why = _unlike(digest, rec)
    return ("ok", "", state) if why is None else ("corrupt", why, state)


def _record(backend: Backend, path: str) -> Record | str | None:
    try:
        return manifest.read(backend, path)
    except manifest.UNREADABLE:
        return "unreadable"


def _cannot_read(exc: OSError) -> str:
    return f"its bytes cannot be read from the store ({exc.strerror or exc})"


def _about(exc: OSError, path: str) -> OSError:
    """`exc`, naming the store path it is about (a local store's names
    only the last part of it): an OSError of its errno (OSError picks the
    subclass, PermissionError for EACCES; the error's own class may take
    other arguments)."""
    return OSError(exc.errno, f"{exc.strerror or exc}: cannot read {path}") if exc.errno is not None else exc


def _under(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix.rstrip("/") + "/")
