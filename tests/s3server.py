"""A real S3 server on loopback: `rclone serve s3` over a temp directory."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

KEY, SECRET = "CKPTFSTESTACCESSKEY1", "ckptfs-test-secret-key-0123456789abcdef"


def rclone() -> str | None:
    here = Path(sys.executable).parent / "rclone"
    return str(here) if here.exists() else shutil.which("rclone")


@dataclass
class S3Server:
    root: Path
    port: int
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def options(self) -> dict:
        return {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
                "config_kwargs": {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 2}}}

    def cli_options(self) -> list[str]:
        return ["--store-option", f"key={KEY}", "--store-option", f"secret={SECRET}",
                "--store-option", f"client_kwargs.endpoint_url={self.endpoint}",
                "--store-option", "client_kwargs.region_name=us-east-1"]

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [rclone(), "serve", "s3", str(self.root), "--addr", f"127.0.0.1:{self.port}", "--auth-key", f"{KEY},{SECRET}",
             "--dir-cache-time", "0s"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("rclone serve s3 did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def bucket(self, name: str) -> str:
        """A bucket is a directory of the served root (rclone caches no listing)."""
        (self.root / name).mkdir(exist_ok=True)
        return f"s3://{name}"

    def objects(self, bucket: str) -> dict[str, bytes]:
        """The bucket's objects, read from the directory rclone serves."""
        base = self.root / bucket
        out = {}
        for p in base.rglob("*"):
            rel = p.relative_to(base).as_posix()
            # rclone's own in-flight temp files are not objects
            if p.is_file() and not rel.startswith(".ckptfs/") and not p.name.startswith(".rclone_temp"):
                out[rel] = p.read_bytes()
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3(root: Path) -> S3Server:
    root.mkdir(parents=True, exist_ok=True)
    server = S3Server(root, free_port())
    server.start()
    return server


def have_rclone() -> bool:
    return rclone() is not None and os.access(rclone(), os.X_OK)
