"""Numbers as people write them: sizes (512M, 8GiB, 1.5G, 40% of RAM) and
seconds; and how the tools print them."""

from __future__ import annotations

import math
import re

import click

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


class Number(click.ParamType):
    """A finite number in [low, high] (click.FloatRange lets nan and inf through)."""

    name = "number"

    def __init__(self, low: float | None = None, high: float | None = None, low_open: bool = False) -> None:
        self.low, self.high, self.low_open = low, high, low_open

    def convert(self, value, param, ctx) -> float:
        if isinstance(value, float):
            return value
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(x):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if self.low is not None and (x < self.low or (self.low_open and x == self.low)):
            self.fail(f"{value} is too small: must be {'more than' if self.low_open else 'at least'} {self.low:g}", param, ctx)
        if self.high is not None and x > self.high:
            self.fail(f"{value} is too large: must be at most {self.high:g}", param, ctx)
        return x


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, plural unless `n` is 1: "1 file", "3 files", "0 files"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


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
