"""Configuration, built once by the command line and frozen."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MountConfig:
    mountpoint: Path
    store_url: str
    memory_limit: int
    log_file: Path | None = None
    log_level: str = "INFO"
    fsync: str = "ram"  # "ram": fsync returns at once; "durable": once published
    drain_timeout: float = 600.0
    upload_workers: int = 4
