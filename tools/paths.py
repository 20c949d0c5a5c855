"""Paths, store URLs and file-name patterns as given on the command line.

An empty one is refused, never taken for the current directory: it is what
`ckptfs mount "$MNT" --store "$STORE"` passes when a variable is unset, and
the current directory would then become a store (its files shown in the
mount, the mount's written into it) or a mount point. So do `ls ''` and
every POSIX call (ENOENT)."""

from __future__ import annotations

import os
import re

import click

UNSET = "empty (an unset shell variable?)"


class GivenPath(click.Path):
    """A click.Path that is not empty."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value == "":
            self.fail(UNSET, param, ctx)
        return super().convert(value, param, ctx)


# `s3:/bucket`, `s3:bucket`: a URL with its `//` cut short, which a plain path would take for a directory `s3:` here
_SHORT_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/?([^/].*)")


class StoreURL(click.ParamType):
    """A store URL or a local directory, not empty, and a local URL naming a
    directory (`file://` alone names none). A URL with a slash or two
    missing (`s3:/bucket`) is refused, not taken for a new directory `s3:`
    in the current one, where the checkpoints would go unnoticed; one that
    is there already is a directory the user means."""

    name = "url"

    def convert(self, value, param, ctx) -> str:
        from ckptfs.writeback.backend import split_protocol  # only where the store is opened anyway (trio: 0.1 s)

        if not value.strip():
            self.fail(UNSET, param, ctx)
        protocol, rest = split_protocol(value)
        if protocol in ("file", "local") and not rest:
            self.fail(f"{value!r} names no directory: write {protocol}:///ABSOLUTE/PATH or a plain path", param, ctx)
        if protocol is None and (short := _SHORT_URL.fullmatch(value)) and not os.path.lexists(value.split("/")[0]):
            scheme, rest = short.groups()
            # file:/x meant the absolute path /x; s3:/bucket, the bucket
            meant = f"{scheme}:///{rest}" if scheme in ("file", "local") and value[len(scheme) + 1] == "/" else f"{scheme}://{rest}"
            self.fail(f"{value!r} looks like a URL with a slash missing: write {meant} (or ./{value} for a new local "
                      f"directory of that name)", param, ctx)
        return value


class NamePattern(click.ParamType):
    """A pattern for a file's name (fnmatch: `*`, `?`, `[...]`), matched
    against the last part of each path: not empty, no `/`."""

    name = "glob"

    def convert(self, value, param, ctx) -> str:
        if not value.strip():
            self.fail(UNSET, param, ctx)
        if "/" in value or "\0" in value:
            self.fail(f"{value!r} is not a file's name: a pattern is matched against the name alone (say 'done', not 'ckpt/done')",
                      param, ctx)
        if value in (".", ".."):
            self.fail(f"{value!r} names no file", param, ctx)
        return value
