"""Sizes as people write them: 512M, 8GiB, 1.5G, 40% (of RAM)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str, total: int | None = None) -> int:
    """Bytes for `text`; binary units; a percentage is of `total`."""
    text = text.strip()
    if text.endswith("%") and total is not None:
        try:
            pct = float(text[:-1])
        except ValueError:
            raise ValueError(f"bad size {text!r}") from None
        if not 0 < pct <= 100:
            raise ValueError(f"bad size {text!r}: a percentage must be in (0, 100]")
        return int(total * pct / 100)
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"bad size {text!r} (examples: 512M, 8G, 1.5GiB, 50%)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise ValueError(f"bad size {text!r}: must be more than zero")
    return value


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def format_duration(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"
