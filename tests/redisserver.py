"""A real Redis on loopback (Debian's `redis-server`), the cluster tests'
metadata engine, started and stopped by the tests, by pid. It wants a
password, kept in its config file and handed to clients through the
environment or a file, never on a command line."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.ports import free_port
from tests.servers import stop_group, wait_started

START_TIMEOUT_S = 20.0


@dataclass
class RedisServer:
    root: Path
    port: int = 0
    password: str = ""
    proc: subprocess.Popen | None = None
    tls: bool = False  # TLS only (rediss://), with a certificate of its own, signed by `ca`

    @property
    def url(self) -> str:
        if self.tls:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.ca}"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    def _make_certificate(self) -> tuple[Path, Path]:
        key, cert = self.root / "server.key", self.root / "server.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True)
        self.ca.write_bytes(cert.read_bytes())  # self-signed: its own authority
        return key, cert

    @property
    def password_file(self) -> Path:
        return self.root / "password"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
            self.password = secrets.token_hex(16)
        self.password_file.write_text(self.password + "\n")
        self.password_file.chmod(0o600)
        conf = self.root / "redis.conf"
        listen = f"port {self.port}\n"
        if self.tls:
            key, cert = self._make_certificate()
            listen = f"port 0\ntls-port {self.port}\ntls-cert-file {cert}\ntls-key-file {key}\ntls-ca-cert-file {self.ca}\ntls-auth-clients no\n"
        conf.write_text(f"bind 127.0.0.1\n{listen}requirepass {self.password}\nsave \"\"\nappendonly no\n"
                        f"dir {self.root}\nlogfile {self.root / 'redis.log'}\n")
        conf.chmod(0o600)
        self.proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        wait_started(self.proc, lambda: self.client(timeout=1).ping(), START_TIMEOUT_S, self.stop, "redis-server", self.root / "redis.log", 0.05)

    def client(self, timeout: float = 5):
        import redis

        if self.tls:
            return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=timeout, ssl=True,
                               ssl_ca_certs=str(self.ca))
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=timeout)

    def flush(self) -> None:
        self.client().flushall()

    def stop(self) -> None:
        stop_group(self.proc, 10)
        self.proc = None


def have_redis() -> bool:
    return shutil.which("redis-server") is not None
