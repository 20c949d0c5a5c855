"""Re-read published files from the store and check them against the manifest."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from . import manifest
from .backend import Backend


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
            digest = manifest.digest_of(backend.read(entry.path))
        except FileNotFoundError:
            seen.discard(entry.path)
            continue
        if rec.matches(digest.size, digest.xxh3):
            report.ok.append(entry.path)
        else:
            report.corrupt.append((entry.path, f"store has {digest.size} bytes xxh3 {digest.xxh3}, manifest says "
                                               f"{rec.current.size if rec.current else '?'} bytes xxh3 {rec.current.xxh3 if rec.current else '?'}"))
    report.missing = sorted(p for p, r in records.items() if r.kind == "file" and p not in seen)
    return report


def _under(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix.rstrip("/") + "/")
