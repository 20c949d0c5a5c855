"""Files written to the store while this daemon did not answer, taken into
the mount.

The torch helpers write straight to the store when the daemon does not
answer in time (C7); `storeio.write_file` leaves a mark under
`manifest.OUTSIDE` before it changes anything (the manifest index is then
not to be trusted), and one naming the path once the file is published
there. A daemon that was only slow or frozen, not dead, lives on: its
mount kept showing the bytes it had (a trainer restarted from it loaded
the checkpoint before), and the store the newer ones, until the next
mount. Now it lists the marks every `POLL_S` and at each `ckptfs flush`,
in the order they were made; for each path it gives the mount the store's
file under that name, as a writer of the mount would: read from the store
a block at a time into a hidden name (the mount serves in between, and
the daemon holds no more of it than the file in RAM), checked against its
record, and renamed over the name, so a failure halfway, bytes that are
not the record's, or a change the mount made meanwhile, leave the mount's
file as it was, and a reader holding the old file open reads on. The file is then published again (the same
bytes). The mount's file is kept instead when it changed after the write
to the store (it is newer, and published over it in its turn), and a name
the mount removed or renamed away since is not made again (its directory
changed after the write). The marks stay for the next mount
(`Engine.claim` removes them, once it has read every record).

Single-node mounts only: in cluster mode names change through the
cluster's log (the marks then wait for the next mount).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import trio

from . import manifest, storeio
from .backend import META, Backend
from .calls import permanent

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)

POLL_S = 5.0  # how often the daemon lists the marks of writes straight to the store
ROOM_PATIENCE_S = 30.0  # how long taking a file in waits for room in the RAM budget
HIDDEN = ".ckptfs-taking-in."  # the hidden name a file is written at before it takes its name
PIECE = 1 << 20  # written at a time; the mount serves its requests between two
READ = 16 << 20  # read from the store at a time (one store call, one ranged GET on S3)
# A file that can never be taken in as it is (gone, garbled, its bytes not its record's, or a failure the
# store gives again: `calls.permanent`) is left out with a warning, and what was written after it is taken
# in. Any other failure is the store's now: that file and those after it wait for the next look.
CANNOT = (FileNotFoundError, NotADirectoryError, storeio.IntegrityError, *manifest.UNREADABLE)


class Inode(Protocol):
    ino: int
    mode: int
    uid: int
    gid: int
    ctime_ns: int
    writers: int
    is_dir: bool
    is_reg: bool


class Handle(Protocol):
    fh: int
    inode: Inode


class Writable(Protocol):
    """What taking a file in does to the mount (fs.tree.InodeTree): what a
    writer of the mount does, journaled as its changes are."""

    def inode_at(self, path: str) -> Inode | None: ...
    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode: ...
    def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int) -> Handle: ...
    def write(self, fh: int, off: int, data: bytes) -> int: ...
    def setattr(self, ino: int, *, mtime_ns: int | None = None) -> Inode: ...
    def release(self, fh: int) -> Inode | None: ...
    def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int = 0) -> None: ...
    def unlink(self, parent: int, name: bytes) -> Inode: ...
    def free_bytes(self) -> int: ...
    def ram_for(self, size: int) -> int: ...


class Outside:
    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.taken: set[str] = set()  # marks dealt with (they stay in the store until the next mount)
        self._lock = trio.Lock()
        # What taking files in left (inode -> its ctime then, and a file's digest): a change
        # of its own is not a change of the mount's that would keep the store's next file out.
        self._left: dict[int, tuple[int, manifest.Digest | None]] = {}
        # Told of each name the mount's tree changed here, not through the kernel
        # (parent inode, name): the FUSE layer makes the kernel forget what it cached.
        self.entry_changed: Callable[[int, bytes], None] = lambda parent, name: None
        self.stopped = False  # the mount is gone (its daemon drains): nothing is taken in any more
        self._waiting: set[str] = set()  # paths to be taken in at a later look (said once)

    def stop(self) -> None:
        self.stopped = True

    async def run(self) -> None:
        while not self.stopped:
            await trio.sleep(POLL_S)
            try:
                await self.take()
            except Exception as exc:  # a store that fails now: the next poll tries again
                log.debug("cannot look for files written straight to the store: %s", exc)

    async def take(self) -> int:
        """Take into the mount what was written straight to the store since
        the last look, in the order it was written; how many files it took."""
        if self.e.link is not None or self.stopped:
            return 0
        async with self._lock:
            marks = [m for m in await self.e.calls.run("list the writes straight to the store", self.e.backend.find, manifest.OUTSIDE)
                     if m not in self.taken]
            n = 0
            for mark in sorted(marks):  # named by the time of the write
                try:
                    named = await self.e.calls.run(f"read {mark}", self.e.backend.read_all, mark)
                except FileNotFoundError:  # gone since it was listed
                    self.taken.add(mark)
                    continue
                if not named:  # a write begun (it may have failed): its mark naming the path comes once it is done
                    self.taken.add(mark)
                    continue
                path = named.decode("utf-8", "surrogateescape")
                if not path or not storeio.nameable(path) or path.split("/")[0] == META:  # no file a helper writes
                    log.warning("%s names %r, no file of the mount: left alone", mark, path)
                    self.taken.add(mark)
                    continue
                try:
                    done, took = await self._take_file(path)
                except Exception as caught:
                    exc = caught.__cause__ if isinstance(caught, _FromStore) else caught  # (a read halfway through the file)
                    if not isinstance(exc, CANNOT) and not permanent(exc):  # the store fails now: this mark and those after it wait
                        self._later(path, f"it cannot be read now ({exc})")
                        raise exc from None
                    log.warning("%s was written to the store while this daemon did not answer, and cannot be taken in: %s", path, exc)
                    done, took = True, False
                if not done:
                    break  # (in order: a completion marker is not taken in before the files written before it)
                self.taken.add(mark)
                n += took
            return n

    async def _take_file(self, path: str) -> tuple[bool, bool]:
        """(whether the mark of `path` is dealt with, whether the mount took the store's file)."""
        rec = await self.e.calls.run(f"read the record of {path}", manifest.read, self.e.backend, path)
        if rec is None or rec.kind != "file" or rec.current is None:
            return True, False  # gone again, or not a file: nothing to take
        why = self._keeps(path, rec)
        if why is not None:
            return why != "open", False
        tree: Writable = self.e.ns  # type: ignore[assignment]
        need = tree.ram_for(rec.current.size)
        if tree.free_bytes() < need and not await self.e.make_room(need, ROOM_PATIENCE_S):
            self._later(path, "no room in RAM to take it in now")
            return False, False
        try:
            took = await self._write(tree, path, rec)
        except (storeio.IntegrityError, _FromStore):
            raise  # (the store's file, or the store: judged in `take`)
        except OSError as exc:  # the mount's
            if exc.errno != errno.ENOSPC:
                log.warning("%s was written to the store while this daemon did not answer, and the mount cannot take it in: %s",
                            path, exc.strerror or exc)
                return True, False
            self._later(path, "no room in RAM to take it in now")
            return False, False
        if took:
            log.warning("%s: the store holds a newer file, written there directly while this daemon did not answer "
                        "(the torch helpers' fallback): the mount shows it now", path)
        return took is not None, bool(took)

    def _later(self, path: str, why: str) -> None:
        if path not in self._waiting:  # said once, not at every look
            self._waiting.add(path)
            log.warning("%s was written to the store while this daemon did not answer; %s: trying again at each look "
                        "(a remount shows it)", path, why)

    def _unchanged_since(self, node: Inode, written_ns: int) -> bool:
        """Whether the mount left `node` alone since `written_ns` (taking files in aside)."""
        left = self._left.get(node.ino)
        return node.ctime_ns < written_ns or (left is not None and left[0] == node.ctime_ns)

    def _keeps(self, path: str, rec: manifest.Record) -> str | None:
        """Why the mount keeps what it has at `path` (None: it takes the store's file)."""
        tree: Writable = self.e.ns  # type: ignore[assignment]
        node = tree.inode_at(path)
        if node is not None:
            if not node.is_reg:
                return "not a file in the mount"
            if node.writers:
                return "open"  # written to now: newer once sealed; looked at again if not
            left = self._left.get(node.ino)
            if left is not None and left == (node.ctime_ns, rec.current):
                return "taken in already"
            gen = self.e.pending.get(node.ino)  # sealed, not published yet: newer if sealed after, as the publisher has it
            if not self._unchanged_since(node, rec.written_ns) or (gen is not None and int(gen.sealed_at * 1e9) >= rec.written_ns):
                return "changed in the mount since"
            shown = self.e.publisher_shown(node.ino)  # where the store shows this file's newest published bytes
            if shown is not None and shown[0] == path and shown[1].digest == rec.current and gen is None:
                return "the same bytes"
            return None
        # Made anew only where nothing changed since the write to the store: a name the mount
        # removed or renamed away later changed its directory then.
        at = path
        while True:
            at = at.rpartition("/")[0]
            d = tree.inode_at(at)
            if d is not None:
                return None if d.is_dir and self._unchanged_since(d, rec.written_ns) else "its directory changed in the mount since"

    def _why_kept(self, path: str, rec: manifest.Record) -> str | None:
        return "stopped" if self.stopped else self._keeps(path, rec)

    async def _write(self, tree: Writable, path: str, rec: manifest.Record) -> bool | None:
        """The store's bytes at `path` in the mount: written at a hidden name
        in the deepest directory on the way there that the mount has, as
        they come from the store, READ at a time (the mount serves in
        between, and the daemon holds no more of the file than its RAM
        does; a store call's failure raised as `_FromStore`), checked
        against the record, then
        renamed to `path` (its directories made first) unless the mount
        changed what the decision rests on meanwhile. True: taken in;
        False: the mount keeps its own; None: to be looked at again."""
        why = self._why_kept(path, rec)
        if why is not None:
            return None if why in ("open", "stopped") else False
        names = path.split("/")
        at = len(names) - 1
        while (d := tree.inode_at("/".join(names[:at]))) is None:
            at -= 1
        old = tree.inode_at(path)
        owner = (old.uid, old.gid) if old is not None else (rec.uid if rec.uid is not None else d.uid, rec.gid if rec.gid is not None else d.gid)
        mode = stat.S_IMODE(old.mode) if old is not None else rec.mode
        hidden = HIDDEN + secrets.token_hex(8)
        h = tree.create(d.ino, os.fsencode(hidden), mode, os.O_WRONLY | os.O_CREAT | os.O_EXCL, *owner)
        self._left[d.ino] = (d.ctime_ns, None)
        ours = "/".join([*names[:at], hidden])
        try:
            size, whole = rec.current.size, manifest.hasher()
            for pos in range(0, size, READ):
                if self.stopped:  # unmounted: the drain does not wait for the rest (dropped below)
                    break
                n = min(READ, size - pos)
                try:
                    pieces = await self.e.calls.run(f"read {path}", _read, self.e.backend, path, size, pos, n, whole, nbytes=n)
                except storeio.IntegrityError:
                    raise
                except Exception as exc:
                    raise _FromStore() from exc
                for off, piece in pieces:
                    tree.write(h.fh, off, piece)
                    await trio.sleep(0)
            else:
                if rec.matches(size, whole.hexdigest()) is None:
                    raise storeio.IntegrityError(f"{path}: checksum mismatch: the store has {size} bytes with xxh3 "
                                                 f"{whole.hexdigest()}, its record says {rec.current}")
        except BaseException:
            self._drop(tree, d, hidden, ours, h)
            raise
        # Nothing awaited from here on: the decision holds for what is done.
        if tree.inode_at(ours) is not h.inode:  # moved or removed by someone else meanwhile: theirs now
            tree.release(h.fh)
            return None
        why = self._why_kept(path, rec)
        if why is not None:
            self._drop(tree, d, hidden, ours, h)
            return None if why in ("open", "stopped") else False
        if rec.mtime_ns is not None:
            tree.setattr(h.inode.ino, mtime_ns=rec.mtime_ns)
        made: tuple[int, bytes] | None = None  # the first directory made: the kernel forgets that name
        top = d
        for name in names[at:-1]:
            made = made or (d.ino, os.fsencode(name))
            sub = tree.mkdir(d.ino, os.fsencode(name), 0o755, d.uid, d.gid)
            self._left[d.ino] = (d.ctime_ns, None)
            d = sub
        tree.release(h.fh)
        tree.rename(top.ino, os.fsencode(hidden), d.ino, os.fsencode(names[-1]))
        self._left[h.inode.ino] = (h.inode.ctime_ns, rec.current)
        self._left[top.ino] = (top.ctime_ns, None)
        self._left[d.ino] = (d.ctime_ns, None)
        self.entry_changed(*(made or (d.ino, os.fsencode(names[-1]))))
        return True

    def _drop(self, tree: Writable, parent: Inode, hidden: str, ours: str, h: Handle) -> None:
        """The hidden file goes, unlinked before its seal: never published (C4);
        its directory's change is taking files in's, not the mount's."""
        if tree.inode_at(ours) is h.inode:
            tree.unlink(parent.ino, os.fsencode(hidden))
            self._left[parent.ino] = (parent.ctime_ns, None)
        tree.release(h.fh)


class _FromStore(Exception):
    """A store call taking a file in failed halfway (`__cause__`): the
    store's failure, not the mount's."""


def _read(backend: Backend, path: str, size: int, at: int, n: int, whole) -> list[tuple[int, memoryview | bytes]]:
    """Worker thread: the bytes `at`..`at + n` of the store's file at `path`
    (of `size` bytes), in pieces of at most PIECE with their offsets, fed to
    the hash `whole` (in order). The file is opened and closed here, in the
    call's own thread: one abandoned at its deadline never reads a
    descriptor closed, and reused, meanwhile. (A file replaced between two
    calls fails the check at the end.)"""
    pieces = []
    with backend.open_source(path) as source:
        if source.size != size:
            raise storeio.IntegrityError(f"{path}: checksum mismatch: the store has {source.size} bytes, its record says {size}")
        for piece in source.read(at, n):
            whole.update(piece)
            view = memoryview(piece)
            for k in range(0, len(view), PIECE):
                pieces.append((at + k, view[k : k + PIECE]))
            at += len(view)
    return pieces
