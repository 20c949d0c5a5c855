"""Staging a file while it is still being written.

A save writes most files from start to end: torch.save, safetensors, a DCP
shard. Staged only once sealed, such a file reaches the store a whole upload
after its close. Instead, once the writer of an open file has got past
`STREAM_FROM` from its start, in order (`FileData.frontier`: the end of the
file for appends; less for a file sized first with ftruncate and then
filled, as safetensors does), its full chunks are handed, as they fill, to one
upload thread (a *stream*) that hashes and stages them with the same
`storeio.stage` as any upload, fed from a queue. At the seal the rest
follows, and the generation is staged soon after its close.

Handing bytes out is a promise kept by the file itself
(`FileData.hand_out`): a write or truncation below what was handed out
breaks it, and a snapshot names the stream only while it holds. A generation
whose snapshot does not name its stream is staged from the snapshot as
usual, and the stream is discarded; so are streams of files deleted before
their seal. A stream is started at most once per seal of a file, so a file
rewritten in place is uploaded at most twice.

Only staging changes: publication stays whole files, at their turn (C2, C3),
and a stream's staged upload is the generation's like any other.
"""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import trio

from . import storeio
from .journal import FileGen, Snapshot
from .state import State

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)

STREAM_FROM = 64 << 20  # a file written in order from its start is staged while written once its writer got this far
STEP = 16 << 20  # handed out at least this much at a time (CHUNK multiples: full chunks only)
STREAMS_MAX = 8  # at most this many files staged while written at once; others are staged at their seal


class Growing(Protocol):
    """A file's bytes as the engine sees them while they are written (fs.filedata.FileData)."""

    frontier: int  # the writer got this far from the start, in order
    resident: bool
    spilled: bool
    stream: object | None

    def hand_out(self, stream: object, end: int) -> Snapshot: ...


class _Stop(Exception):
    pass


class Stream:
    """One file staged while it is written. The trio thread puts snapshots
    of consecutive byte ranges in `feed`, the last one at the seal; the
    upload thread takes them in order. Whoever takes a snapshot out of the
    queue releases it."""

    def __init__(self, ino: int) -> None:
        self.ino = ino
        self.handed = 0  # bytes put in the queue
        self.feed: queue.SimpleQueue[tuple[Snapshot, bool] | None] = queue.SimpleQueue()  # (snapshot, last); None: stop
        self.scope = trio.CancelScope()  # the upload's deadline, set at the seal
        self.gen: FileGen | None = None  # bound at the seal
        self.attempt = 0  # the generation's staging attempt it is (a late end of another is discarded)
        self.stopped = False  # broken, superseded, deleted or ended: nothing more is handed to it

    def cancelled(self) -> bool:  # read from the upload thread
        return self.stopped or (self.gen is not None and self.gen.state is State.DROPPED)

    def pieces(self, release) -> Iterator[memoryview]:
        """The file's bytes in order, as they are handed out (upload thread)."""
        while True:
            item = self.feed.get()
            if item is None:
                raise storeio.Cancelled()
            snapshot, last = item
            try:
                yield from snapshot.pieces()
            finally:
                release(snapshot)
            if last:
                return

    def stop(self) -> None:
        """No more bytes: the upload thread ends (its staging is removed), now
        or once the store call it is in returns. Owning thread."""
        self.stopped = True
        self.feed.put(None)


class Streams:
    """The engine's streams, by inode (trio thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._by_ino: dict[int, Stream] = {}
        self.running = 0

    def grew(self, ino: int, data: Growing) -> None:
        """A file open for writing was written on from where its writer got to."""
        stream = self._by_ino.get(ino)
        if stream is None:
            if (data.frontier < STREAM_FROM or data.spilled or not data.resident or self.running >= STREAMS_MAX
                    or self.engine._nursery is None or not self.engine.ns.paths_of(ino)):
                return
            stream = self._by_ino[ino] = Stream(ino)
            self.running += 1
            self.engine._nursery.start_soon(self._run, stream, data)
        elif stream.stopped:
            return
        elif data.stream is not stream and stream.handed:  # written below what it was handed: staged at the seal instead
            log.debug("inode %d was rewritten below the %d bytes staged while it was written", ino, stream.handed)
            stream.stop()
            return
        end = data.frontier // STEP * STEP
        if end > stream.handed:
            stream.feed.put((data.hand_out(stream, end), False))
            stream.handed = end

    def sealed(self, gen: FileGen, snapshot: Snapshot) -> bool:
        """True if `gen` is being staged by its stream (which then has the
        rest of its bytes); False: stage it from its snapshot."""
        stream = self._by_ino.pop(gen.ino, None)
        if stream is None:
            return False
        if stream.stopped or getattr(snapshot, "stream", None) is not stream or gen.size < stream.handed:
            stream.stop()
            return False
        gen.move(State.UPLOADING)
        gen.attempt += 1
        stream.gen, stream.attempt = gen, gen.attempt
        stream.feed.put((snapshot.tail(stream.handed), True))  # type: ignore[attr-defined]
        stream.scope.deadline = trio.current_time() + self.engine.calls.deadlines.for_bytes(gen.size)
        self.engine.notify()
        return True

    def gone(self, ino: int) -> None:
        """The file lost its last name: what its stream staged is of no use."""
        stream = self._by_ino.pop(ino, None)
        if stream is not None:
            stream.stop()

    def stop_all(self) -> None:
        for stream in self._by_ino.values():
            stream.stop()
        self._by_ino.clear()

    async def _run(self, stream: Stream, data: Growing) -> None:
        engine = self.engine
        token = trio.lowlevel.current_trio_token()
        names = engine.ns.paths_of(stream.ino)
        elsewhere = engine.link is not None and not engine.link.publishes  # by the cluster's publishing node, without the bytes

        def release(snapshot: Snapshot) -> None:  # upload thread
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(snapshot.release)

        def body():
            pieces = stream.pieces(release)
            try:
                return storeio.stage(engine.backend, pieces, -1, stream.cancelled, names[0] if names else None, elsewhere)
            finally:
                pieces.close()  # now, not when collected: the snapshot it was in the middle of is released

        staged = digest = None
        error: Exception | None = None
        try:
            staged, digest = await engine.calls.run(f"stage {names[0] if names else stream.ino} while it is written", body,
                                                    scope=stream.scope)
        except storeio.Cancelled:
            pass
        except Exception as exc:
            error = exc
        finally:
            self.running -= 1
            stream.stopped = True  # left in place until the seal: at most one stream per seal of a file
            while True:  # what the thread will never take: released here
                try:
                    item = stream.feed.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].release()
            stream.feed.put(None)  # a thread still in a store call ends when it returns
        gen = stream.gen
        ours = gen is not None and gen.state is State.UPLOADING and gen.attempt == stream.attempt
        if error is not None:
            if ours:
                assert gen is not None
                gen.attempt += 1  # fence: a late end of this attempt is discarded
                engine.failed(gen, "upload", error)  # staged again from its snapshot
            else:
                log.debug("staging inode %d while it was written failed: %s", stream.ino, error)
            return
        if staged is None:
            return
        if not ours or digest.size != gen.size:  # type: ignore[union-attr]
            if ours:  # cannot happen: the stream had every byte of the snapshot
                assert gen is not None
                log.error("%s: staged %d bytes while it was written, sealed %d; staging it again", gen.path, digest.size, gen.size)  # type: ignore[union-attr]
                gen.attempt += 1
                engine.failed(gen, "upload", OSError(f"staged {digest.size} bytes, sealed {gen.size}"))  # type: ignore[union-attr]
            engine.discard_soon(staged, f"inode {stream.ino}")
            return
        staged.size = digest.size  # staged before its size was known
        engine.counters.staged_while_written += 1
        log.info("%s: staged while it was written (%d of its %d bytes before its close)", gen.path, stream.handed, gen.size)
        engine.staged(gen, staged, digest)
