"""Configuration, built once by the command line and frozen."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def parse_store_options(pairs: tuple[str, ...] | list[str], env_json: str | None = None) -> dict:
    """fsspec storage options from KEY=VALUE pairs (dots nest: client_kwargs.endpoint_url=...)
    and a JSON object ($CKPTFS_STORE_OPTIONS); values are JSON when they parse.
    ValueError, with a message for the user, on anything malformed."""
    import json

    try:
        options = json.loads(env_json) if env_json else {}
    except ValueError as exc:
        raise ValueError(f"$CKPTFS_STORE_OPTIONS is not valid JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ValueError("$CKPTFS_STORE_OPTIONS must be a JSON object, like {\"key\": \"secret\"}")
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        *parents, last = key.split(".")
        if not sep or not all((*parents, last)):
            raise ValueError(f"bad --store-option {pair!r}: expected KEY=VALUE (KEY may be dotted: a.b=VALUE)")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        node = options
        for depth, k in enumerate(parents):
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"--store-option {pair!r} conflicts with {'.'.join(parents[: depth + 1])}, already set to a value")
        if isinstance(node.get(last), dict) and not isinstance(value, dict):
            raise ValueError(f"--store-option {pair!r} conflicts with options already set under {key}.")
        node[last] = value
    return options


DEFAULT_SPILL_DIR = "/var/tmp"  # local disk, and never the store: a write must not depend on the store being up


@dataclass(frozen=True)
class MountConfig:
    mountpoint: Path
    store_url: str
    memory_limit: int
    reuse_ram: int | None = None  # freed RAM kept for the next save (default: see tools/cli.py)
    log_file: Path | None = None
    log_level: str = "INFO"
    fsync: str = "ram"  # "ram": fsync returns at once; "durable": once published
    drain_timeout: float = 600.0
    store_timeout: float = 60.0  # deadline of one store call (plus 1 s per 4 MiB it moves)
    upload_workers: int = 4
    storage_options: dict = field(default_factory=dict)  # passed to fsspec (credentials, endpoint)
    spill_dir: str | None = None  # where files too big for RAM continue (default: DEFAULT_SPILL_DIR)
    metrics_port: int | None = None  # serve Prometheus metrics here
    metrics_host: str = "127.0.0.1"
    cluster: str | None = None  # cluster mode: the Redis URL of the shared namespace
    cluster_password_file: str | None = None  # its password (else $CKPTFS_REDIS_PASSWORD)
    node: str | None = None  # this node's name in the cluster (default: the host name)
    cluster_patience: float = 10.0  # how long a namespace change or a close waits for a Redis that does not answer (cluster.namespace)
    cluster_snapshot_every: int = 10_000  # log entries between snapshots of the namespace (cluster.snapshot)
    oom_score_adj: int | None = None  # the kernel's OOM killer picks this daemon less (negative) or more; None: as inherited
    markers: tuple[str, ...] = ()  # completion markers of the user's own (name patterns), besides publisher.MARKERS
