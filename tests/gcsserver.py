"""A GCS server on loopback: gcp-storage-emulator (from PyPI), which
answers Google Cloud Storage's JSON API as gcsfs speaks it, started and
stopped by the tests, by pid.

gcsfs (2025.x on) makes `gs://` an `ExtendedGcsFileSystem` that first asks
Google's gRPC control API what kind of bucket it is: an emulator has none,
and each such question waits out a 60 s deadline. The tests turn that off
(`GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`, set in conftest before gcsfs is
first imported, inherited by the daemons they start)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.ports import free_port
from tests.servers import objects_in, stop_group, wait_started

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
PROJECT = "ckptfs-tests"
# The emulator parses a multipart upload (gcsfs's `pipe_file`: one request
# of metadata and data) with the `email` package, which takes the line end
# before the closing delimiter to be CRLF when the data ends in CR: gcsfs
# ends its lines with LF alone, so the emulator dropped the last byte of any
# object ending in b"\r" (one in 256 of the manifest images the daemon puts,
# which then could not be decompressed). Parsed here by the delimiter the
# client's first line uses instead.
LAUNCH = """
import email.parser, http.server, json, sys
http.server.HTTPServer.request_queue_size = 4096
import gcp_storage_emulator.server as server

def related(raw, content_type):
    boundary = email.parser.HeaderParser().parsestr("Content-Type: " + content_type).get_param("boundary")
    delimiter = b"--" + boundary.encode()
    eol = b"\\r\\n" if raw.startswith(delimiter + b"\\r\\n") else b"\\n"
    parts = []
    for chunk in (eol + raw).split(eol + delimiter)[1:-1]:  # each: the end of its delimiter's line, headers, a blank line, the data
        head, _, body = chunk.partition(eol + eol) if not chunk.startswith(eol + eol) else (b"", b"", chunk[2 * len(eol):])
        parts.append((email.parser.BytesHeaderParser().parsebytes(head[len(eol):]), body))
    return {"meta": json.loads(parts[0][1]), "content": parts[1][1], "content-type": parts[1][0].get_content_type()}

def read_data(handler, query, _read_data=server._read_data):
    content_type = handler.headers.get("Content-Type") or ""
    if not content_type.startswith("multipart/related"):
        return _read_data(handler, query)
    raw = server._decode_raw_data(server._read_raw_data(handler), handler)
    return related(raw, content_type) if raw else None

server._read_data = read_data
from gcp_storage_emulator.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@dataclass
class GCSServer:
    root: Path
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def options(self) -> dict:
        return {"endpoint_url": self.endpoint, "token": "anon", "project": PROJECT}

    def cli_options(self) -> list[str]:
        return [arg for k, v in self.options().items() for arg in ("--store-option", f"{k}={v}")]

    def start(self) -> None:
        self.port = free_port()
        # --in-memory: its objects live in the process (a restart of it starts empty).
        # It serves one connection at a time, behind a listen backlog of 5: the
        # many requests a store has in flight at once (a restart's reads of its
        # records) had their connections dropped and retried for a second or
        # more each (100 concurrent reads took 150 s). A longer backlog queues them.
        args = [sys.executable, "-c", LAUNCH, "start", "--host=127.0.0.1", f"--port={self.port}", "--in-memory"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.root / "emulator.log", "ab"),
                                     start_new_session=True, cwd=self.root)
        wait_started(self.proc, lambda: self.fs().ls(""), START_TIMEOUT_S, self.stop, "gcp-storage-emulator", self.root / "emulator.log")

    def stop(self) -> None:
        stop_group(self.proc, STOP_TIMEOUT_S)
        self.proc = None

    def fs(self):
        import gcsfs

        return gcsfs.GCSFileSystem(**self.options(), skip_instance_cache=True, use_listings_cache=False)

    def bucket(self, name: str) -> str:
        fs = self.fs()
        if not fs.exists(name):
            fs.mkdir(name)
        return f"gs://{name}"

    def objects(self, bucket: str) -> dict[str, bytes]:
        """The bucket's objects (ckptfs's own prefix excluded), as a client reads them."""
        return objects_in(self.fs(), bucket)


def start_gcs(root: Path) -> GCSServer:
    root.mkdir(parents=True, exist_ok=True)
    server = GCSServer(root)
    server.start()
    return server


def have_emulator() -> bool:
    try:
        import gcp_storage_emulator  # noqa: F401
        import gcsfs  # noqa: F401
    except ImportError:
        return False
    return True
