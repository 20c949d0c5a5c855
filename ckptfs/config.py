"""Configuration, built once by the command line and frozen."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def parse_store_options(pairs: tuple[str, ...] | list[str], env_json: str | None = None) -> dict:
    """fsspec storage options from KEY=VALUE pairs (dots nest: client_kwargs.endpoint_url=...)
    and a JSON object (CKPTFS_STORE_OPTIONS); values are JSON when they parse."""
    import json

    options: dict = json.loads(env_json) if env_json else {}
    if not isinstance(options, dict):
        raise ValueError("CKPTFS_STORE_OPTIONS must be a JSON object")
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"bad store option {pair!r}: expected KEY=VALUE")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        node = options
        *parents, last = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = value
    return options


@dataclass(frozen=True)
class MountConfig:
    mountpoint: Path
    store_url: str
    memory_limit: int
    log_file: Path | None = None
    log_level: str = "INFO"
    fsync: str = "ram"  # "ram": fsync returns at once; "durable": once published
    drain_timeout: float = 600.0
    store_timeout: float = 60.0  # deadline of one store call (plus 1 s per 4 MiB it moves)
    upload_workers: int = 4
    storage_options: dict = field(default_factory=dict)  # passed to fsspec (credentials, endpoint)
    spill_dir: str | None = None  # where files too big for RAM continue (default: see mount.py)
    metrics_port: int | None = None  # serve Prometheus metrics here
    metrics_host: str = "127.0.0.1"
