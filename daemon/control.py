"""The daemon's control endpoint: a Unix socket answering `ckptfs.client`.

Runs on the trio thread beside the FUSE handlers, so every answer is a
consistent view of the inode tree and the engine. See ckptfs/client.py for the
protocol and why the endpoint is a socket outside the mount.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from ckptfs.fs.tree import InodeTree
from ckptfs.writeback.engine import Left
from ckptfs.writeback.journal import FileGen, Op, kind

from ckptfs.client import MAX_LINE, PROTOCOL_VERSION

from . import status

if TYPE_CHECKING:
    from ckptfs.cluster.node import ClusterNode
    from ckptfs.writeback.engine import Engine

log = logging.getLogger(__name__)

EVICT_RETURN_S = 60.0  # an evict waits at most this long for the RAM it freed to be back with the OS
PROGRESS_EVERY_S = 0.5  # well under the client's IO timeout: silence means hung
REQUEST_TIMEOUT_S = 10.0
ROWS_BATCH = 2000  # rows of a long reply encoded between two turns of the event loop


class RequestError(Exception):
    pass


class ControlServer:
    def __init__(self, path: Path, tree: InodeTree, engine: Engine, ledger: status.Ledger, mount: dict[str, Any],
                 cluster: ClusterNode | None = None) -> None:
        self.path = path
        self.cluster = cluster
        self.tree = tree
        self.ledger = ledger
        self.engine = engine
        self.mount = mount  # mountpoint, store, pid, started: echoed in status

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a dead daemon's
        old = os.umask(0o177)  # 0600 from the start: no window with looser modes
        try:
            await sock.bind(str(self.path))
        finally:
            os.umask(old)
        sock.listen(64)
        try:
            task_status.started()
            await trio.serve_listeners(self._handle, [trio.SocketListener(sock)])
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                uid = _peer_uid(stream.socket)
                if uid not in (os.getuid(), 0):
                    log.warning("control: refused a client with uid %d", uid)
                    await _send(stream, {"ok": False, "kind": "access", "error": f"uid {uid} may not control this mount"})
                    return
                with trio.fail_after(REQUEST_TIMEOUT_S):
                    request = await _receive(stream)
                reply = await self._dispatch(stream, request)
                await _send(stream, {"ok": True, "result": reply})
            except RequestError as exc:
                await _send(stream, {"ok": False, "error": str(exc)})
            except OSError as exc:
                await _send(stream, {"ok": False, "error": f"{exc.strerror or exc}"})
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
                pass  # the client went away or never asked
            except Exception as exc:  # a bug here must not take the mount down
                log.exception("control request failed")
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await _send(stream, {"ok": False, "error": f"internal error: {exc}"})

    async def _dispatch(self, stream: trio.SocketStream, req: dict) -> dict:
        if req.get("version") != PROTOCOL_VERSION:
            raise RequestError(f"protocol version {req.get('version')} not supported (this daemon speaks {PROTOCOL_VERSION})")
        op = req.get("op")
        path = str(req.get("path") or "").strip("/")
        if op == "ping":
            return {**self.mount}
        if op == "status":
            out = await self.status(bool(req.get("files")), path)
            if req.get("cluster"):
                out["cluster"] = await self._cluster().status()
            return out
        if op == "flush":
            if req.get("cluster"):  # every seal the cluster's log has now, wherever it was made, is waited for
                try:
                    await self._cluster().namespace.catch_up()
                except Exception as exc:
                    raise RequestError(f"cannot reach the cluster's Redis: {exc}") from None
            return await self.flush(stream, path, _timeout(req.get("timeout")))
        if op == "prefetch":
            return await self.prefetch(stream, path)
        if op == "evict":
            return await self.evict(path)
        raise RequestError(f"unknown request {op!r}")

    def _cluster(self) -> ClusterNode:
        if self.cluster is None:
            raise RequestError("this mount is not in a cluster (mounted without --cluster)")
        return self.cluster

    # -- requests ------------------------------------------------------------
    async def status(self, with_files: bool, path: str) -> dict:
        await self.ledger.caught_up()
        out: dict[str, Any] = {"mount": {**self.mount, "uptime_s": time.time() - self.mount["started"]},
                               "totals": self.ledger.totals().as_dict()}
        if with_files:
            path = self._resolved(path)
            out["files"] = Rows(await status.files(self.tree, self.engine, path), _row)
        return out

    async def flush(self, stream: trio.SocketStream, path: str, timeout: float) -> dict:
        path = self._resolved(path)
        deadline = trio.current_time() + timeout
        with trio.move_on_at(deadline):  # what was written straight to the store meanwhile is in the mount first
            try:
                await self.engine.outside.take()
            except Exception as exc:  # the store fails now: its files are taken in later
                log.info("flush: cannot look for files written straight to the store now: %s", exc)
        self.tree.seal_closed()  # a file closed just before this request is in the barrier, whatever its RELEASE does
        ops = self.engine.barrier(path)
        total_files, total_bytes = _left(ops)
        waiting = Left(self.engine, ops)
        reported = -math.inf
        with trio.move_on_at(deadline) as waited:
            # Checked at every change (cheap: see Left), reported every PROGRESS_EVERY_S.
            while not waiting.settled():  # else nothing left, or only what waits for a parked file: never by itself
                if trio.current_time() - reported >= PROGRESS_EVERY_S:
                    reported = trio.current_time()
                    ops = waiting.now()
                    files, nbytes = _left(ops)
                    await _send(stream, {"progress": {"files_left": files, "bytes_left": nbytes, "files": total_files,
                                                      "bytes": total_bytes, "failed": _failed(ops)}})
                with trio.move_on_at(reported + PROGRESS_EVERY_S):
                    await self.engine.wait_change()
            await self.engine.sync_dirs()  # and the directories' attributes as they are now
        left = [self._describe(op) for op in waiting.now()]
        # Not waited for (a barrier of what is sealed), but a job that flushes
        # before it exits should know: files still open with changes not sealed.
        # From the open handles, not a walk of the tree: the mount keeps serving.
        writing = {h.inode for h in self.tree.handles.values() if h.writable and h.inode.version != h.inode.sealed_version}
        unsealed = sorted(p for inode in writing for p in self.tree.paths_of(inode.ino)[:1]
                          if not path or p == path or p.startswith(path + "/"))
        return {"published": not left, "files": total_files, "bytes": total_bytes, "left": left, "timed_out": waited.cancelled_caught,
                "unsealed": unsealed}

    def _describe(self, op: Op) -> dict:
        if isinstance(op, FileGen):
            paths = self.tree.paths_of(op.ino)
            return {"path": paths[0] if paths else op.path, "size": op.size, "state": op.state.value,
                    "error": op.error or self.engine.publisher.held_back(op), "tries": op.tries}
        state = f"{kind(op)} {'not applied' if op.seq in self.engine.skipped else 'pending'}"
        return {"path": op.path, "size": 0, "state": state, "error": op.error, "tries": op.tries}

    async def prefetch(self, stream: trio.SocketStream, path: str) -> dict:
        path = self._resolved(path)
        c = self.engine.counters
        files0, bytes0 = c.loads, c.loaded_bytes

        async def heartbeat() -> None:  # a long load must not look like a hung daemon
            while True:
                await trio.sleep(PROGRESS_EVERY_S)
                with trio.CancelScope(shield=True):  # never cut a line in half
                    await _send(stream, {"progress": {"loaded": c.loads - files0, "bytes": c.loaded_bytes - bytes0}})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(heartbeat)
            n, failed = await self.engine.prefetch(path)
            nursery.cancel_scope.cancel()
        return {"loaded": n, "bytes": c.loaded_bytes - bytes0, "failed": [{"path": p, "error": why} for p, why in failed]}

    async def evict(self, path: str) -> dict:
        path = self._resolved(path)
        evicted, freed, refused = 0, 0, []
        for n, f in enumerate(await status.files(self.tree, self.engine, path), 1):
            if n % status.FILES_BATCH == 0:
                await trio.sleep(0)  # the mount answers meanwhile; each file's eviction checks it is still published
            if f.state != "published":
                refused.append({"path": f.path, "state": f.state})
            elif f.resident and not f.spilled:
                got = self.engine.evict_file(f.ino)
                if got or f.size == 0:
                    evicted += 1
                    freed += got
        # What the stock does not keep is unmapped by the pool's thread: back with the OS before the answer.
        if not await trio.to_thread.run_sync(self.tree.pool.wait_returned, EVICT_RETURN_S):
            log.warning("evict: RAM freed is not all given back to the OS after %.0fs", EVICT_RETURN_S)
        return {"evicted": evicted, "bytes": freed, "refused": refused}

    def _resolved(self, path: str) -> str:
        """The path of what `path` names in the mount, symlinks followed (a
        `latest` link to the newest checkpoint names that checkpoint)."""
        if not path:
            return path
        try:
            return self.tree.resolve(path, self.mount["mountpoint"])
        except FileNotFoundError:
            raise RequestError(f"{path}: no such file or directory in the mount") from None
        except ValueError as exc:
            raise RequestError(f"{path}: {exc}") from None
        except OSError as exc:
            raise RequestError(f"{path}: {exc.strerror}") from None


def _row(f: status.FileStatus) -> dict:
    row = dict(vars(f))  # asdict's deep copies took 1.1 s at 100,000 files
    del row["ino"]
    return row


@dataclass
class Rows:
    """A long list in a reply (`status --files`): converted and encoded
    ROWS_BATCH items at a time by `_send`, the event loop getting a turn
    between batches, so that the mount answers while a listing of
    100,000 files (20 MiB of JSON) goes out."""

    items: list
    convert: Callable[[Any], Any]


def _left(ops: list[Op]) -> tuple[int, int]:
    gens = [op for op in ops if isinstance(op, FileGen)]
    return len(gens), sum(g.size for g in gens)


def _failed(ops: list[Op]) -> list[dict]:
    return [{"path": op.path, "error": op.error, "tries": op.tries} for op in ops if op.error]


def _peer_uid(sock: trio.socket.SocketType) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


async def _receive(stream: trio.SocketStream) -> dict:
    buf = b""
    while b"\n" not in buf:
        chunk = await stream.receive_some(1 << 16)
        if not chunk:
            raise trio.BrokenResourceError
        buf += chunk
        if len(buf) > MAX_LINE:
            raise RequestError("request too long")
    try:
        req = json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        raise RequestError("malformed request (not JSON)") from None
    if not isinstance(req, dict):
        raise RequestError("malformed request")
    return req


async def _send(stream: trio.SocketStream, message: dict) -> None:
    await stream.send_all(await _line(message))


async def _line(message: dict) -> bytes:
    """`message` as one line of JSON, its result's `Rows` (one at most)
    made a batch at a time."""
    result = message.get("result")
    rows_key = next((k for k, v in result.items() if isinstance(v, Rows)), None) if isinstance(result, dict) else None
    if rows_key is None:
        return json.dumps({"version": PROTOCOL_VERSION, **message}).encode() + b"\n"
    outer = {"version": PROTOCOL_VERSION, **{k: v for k, v in message.items() if k != "result"}}
    rows = result[rows_key]
    parts = []
    for i in range(0, len(rows.items), ROWS_BATCH):
        parts.append(json.dumps([rows.convert(x) for x in rows.items[i : i + ROWS_BATCH]])[1:-1])  # without its [ ]
        await trio.sleep(0)
    members = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in result.items() if k != rows_key]
    members.append(f"{json.dumps(rows_key)}: [{', '.join(parts)}]")
    return (json.dumps(outer)[:-1] + ', "result": {' + ", ".join(members) + "}}\n").encode()


def _timeout(value: Any) -> float:
    """A request's timeout: None (wait for ever) or seconds >= 0."""
    if value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value < 0:
        raise RequestError(f"timeout must be a number of seconds >= 0, not {value!r}")
    return float(value)
