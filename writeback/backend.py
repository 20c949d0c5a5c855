"""The store adapter over fsspec: opening and validating a store URL."""

from __future__ import annotations

import os

import fsspec
from fsspec.core import split_protocol


class StoreError(Exception):
    """A store URL that cannot be used; the message is for the user."""


def open_store(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec file system and root path for `url`, checked to be usable.

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
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except Exception as exc:  # fsspec backends raise anything on bad URLs
        raise StoreError(f"cannot open store {url!r}: {exc}") from None
    if protocol in ("file", "local"):
        if os.path.exists(root) and not os.path.isdir(root):
            raise StoreError(f"store path {root} exists and is not a directory")
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {root}: {exc.strerror}") from None
    return fs, root.rstrip("/")
