"""A real Redis on loopback (Debian's `redis-server`), the cluster tests'
metadata engine, started and stopped by the tests, by pid. It wants a
password, kept in its config file and handed to clients through the
environment or a file, never on a command line."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 20.0


@dataclass
class RedisServer:
    root: Path
    port: int = 0
    password: str = ""
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def password_file(self) -> Path:
        return self.root / "password"

    def start(self) -> None:
        import redis

        self.root.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = _free_port()
            self.password = secrets.token_hex(16)
        self.password_file.write_text(self.password + "\n")
        self.password_file.chmod(0o600)
        conf = self.root / "redis.conf"
        conf.write_text(f"bind 127.0.0.1\nport {self.port}\nrequirepass {self.password}\nsave \"\"\nappendonly no\n"
                        f"dir {self.root}\nlogfile {self.root / 'redis.log'}\n")
        conf.chmod(0o600)
        self.proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                redis.Redis(port=self.port, password=self.password, socket_timeout=1).ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    log = self.root / "redis.log"
                    raise RuntimeError(f"redis-server did not start: {log.read_text()[-2000:] if log.exists() else ''}") from None
                time.sleep(0.05)

    def client(self):
        import redis

        return redis.Redis(port=self.port, password=self.password, socket_timeout=5)

    def flush(self) -> None:
        self.client().flushall()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def have_redis() -> bool:
    return shutil.which("redis-server") is not None
