"""The pyfuse3 adapter: translates kernel requests into `InodeTree` calls.

Handlers stay thin: argument unpacking, errno mapping, `EntryAttributes`, and
the page-cache policy. Only `pyfuse3.FUSEError` leaves a handler; anything
unexpected is logged and answered with EIO so the mount keeps serving.

Page-cache policy: opens for writing only get `direct_io` (no page-cache
copies, 2-3x faster saves; an O_WRONLY descriptor can never be mmapped).
Every readable open goes through the page cache so mmap works, and keeps the
cache only while the file's data is unchanged since it was cached.

Files whose bytes are only in the store (evicted, or found there at restart)
are loaded by the engine when opened; a write that finds the RAM budget full
waits for the engine to make room.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import pyfuse3
import trio

from .loading import WouldBlock
from .tree import Inode, InodeTree

if TYPE_CHECKING:
    from ckptfs.cluster.namespace import SharedNamespace
    from ckptfs.daemon.metrics import Metrics
    from ckptfs.writeback.engine import Engine

log = logging.getLogger(__name__)

ATTR_TIMEOUT = 5.0  # every change goes through this mount, so attrs stay valid
CLUSTER_ATTR_TIMEOUT = 0.5  # cluster mode: other nodes change names and files too; seen here within this
BLKSIZE = 1 << 20  # st_blksize: tools size their I/O buffers from it
FILES_MAX = 1 << 32
ROOM_PATIENCE_S = 2.0  # how long a write waits for write-back to free RAM before spilling
XATTR_PREFIX = b"user.ckptfs."  # virtual, read-only: each file's write-back state

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def _errors(fn: F) -> F:
    """Errno mapping, and each request counted and timed."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        code = 0
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError as exc:
            code = exc.errno
            raise
        except OSError as exc:
            code = exc.errno or errno.EIO
            if code == errno.EIO:  # why, where the cause logged nothing (a lost file's read, say)
                log.debug("%s answered EIO: %s", name, exc)
            raise pyfuse3.FUSEError(code) from None
        except MemoryError:
            log.error("out of memory in %s", name)
            code = errno.ENOSPC
            raise pyfuse3.FUSEError(code) from None
        except Exception:
            log.exception("unexpected error in %s; answering EIO", name)
            code = errno.EIO
            raise pyfuse3.FUSEError(code) from None
        finally:
            if self.metrics is not None:
                self.metrics.request(name, time.perf_counter() - t0, code)

    return wrapper  # type: ignore[return-value]


def attributes(inode: Inode, timeout: float = ATTR_TIMEOUT) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.st_ino = inode.ino
    a.generation = 0  # inode numbers are never reused within a mount
    a.entry_timeout = a.attr_timeout = timeout
    a.st_mode = inode.mode
    a.st_nlink = inode.nlink
    a.st_uid = inode.uid
    a.st_gid = inode.gid
    a.st_rdev = inode.rdev
    a.st_size = inode.size
    a.st_blksize = BLKSIZE
    a.st_blocks = (inode.allocated + 511) // 512
    a.st_atime_ns = inode.atime_ns
    a.st_mtime_ns = inode.mtime_ns
    a.st_ctime_ns = inode.ctime_ns
    return a


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, tree: InodeTree, engine: Engine, fsync_durable: bool = False, metrics: Metrics | None = None,
                 virtual_xattr: Callable[[Inode, bytes], bytes] | None = None, shared: SharedNamespace | None = None) -> None:
        super().__init__()
        self.tree = tree
        self.engine = engine
        # Cluster mode: names, links and attributes change through the
        # cluster's log (`_change`), and a close seals the file before it
        # returns, so that the seal has its place before what follows it.
        self.shared = shared
        self.timeout = ATTR_TIMEOUT if shared is None else CLUSTER_ATTR_TIMEOUT
        self._invalidations = _Invalidations()
        self._connected = False  # the kernel's INIT came (`init`): before it, it caches nothing, and refuses notifications
        if shared is not None:
            shared.elsewhere = self._changed_elsewhere
        engine.outside.entry_changed = self._taken_in
        self.fsync_durable = fsync_durable
        self.metrics = metrics
        self.virtual_xattr = virtual_xattr
        self._cached_version: dict[int, int] = {}
        self._spilling: dict[int, trio.Event] = {}  # files whose bytes are being copied into the spill directory

    async def _resident(self, inode: Inode, off: int = 0, end: int | None = None) -> None:
        """Wait until the file's bytes `off`..`end` (None: all, as before any
        change: writers wait for the whole load) are in and verified."""
        if inode.data is not None and not inode.data.resident:
            await self.engine.load(inode.ino, off, end)

    def _entry(self, inode: Inode) -> pyfuse3.EntryAttributes:
        """Attributes for a reply that gives the kernel a new reference."""
        return attributes(self.tree.ref(inode), self.timeout)

    def init(self) -> None:
        self._connected = True

    def _changed_elsewhere(self, op: str, args: list) -> None:
        """Cluster mode: another node's change is applied here; the kernel
        forgets what it cached of it (names, attributes, a file's pages)."""
        if not self._connected:  # a node joining: the log applied before the kernel set up the connection
            return
        if op in ("unlink", "rmdir"):
            pyfuse3.invalidate_entry_async(args[0], args[1], ignore_enoent=True)
        elif op == "rename":
            pyfuse3.invalidate_entry_async(args[0], args[1], ignore_enoent=True)
            pyfuse3.invalidate_entry_async(args[2], args[3], ignore_enoent=True)
        elif op in ("sealed", "setattr", "setxattr", "removexattr"):
            self._invalidations.put((args[0], op != "sealed"))

    def _taken_in(self, parent: int, name: bytes) -> None:
        """A file written straight to the store took this name in the tree
        (`writeback.outside`), not through the kernel: it forgets the name."""
        if self._connected:
            self._invalidations.put((parent, name))

    async def _change(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """A change of names, links or attributes: the tree's method `op`,
        through the cluster's log in cluster mode."""
        if self.shared is None:
            return getattr(self.tree, op)(*args, **kwargs)
        return await self.shared.change(op, *args, **kwargs)

    def _file_info(self, inode: Inode, fh: int, flags: int) -> pyfuse3.FileInfo:
        fi = pyfuse3.FileInfo(fh=fh)
        if flags & os.O_ACCMODE == os.O_WRONLY:
            fi.direct_io = True
        else:
            fi.keep_cache = self._cached_version.get(inode.ino) == inode.version
            self._cached_version[inode.ino] = inode.version
        return fi

    # -- names ---------------------------------------------------------------
    @_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        try:
            return self._entry(self.tree.lookup(parent_inode, name))
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
            if self.shared is None:
                return self._absent()
        await self.shared.refresh()  # cluster mode: a name made elsewhere before this lookup is found
        return self._entry(self.tree.lookup(parent_inode, name))

    def _absent(self) -> pyfuse3.EntryAttributes:
        """A name that is not there, answered so that the kernel remembers it
        (a negative entry, for the attribute timeout): a process probing for
        files (an import, a framework looking for optional files) asks the
        daemon once. A mount of one node only: every name is made through
        this kernel, which turns such an entry into the name it makes (in
        cluster mode other nodes make names too, and a lookup asks the
        cluster's log each time)."""
        a = pyfuse3.EntryAttributes()
        a.st_ino = 0
        a.entry_timeout = self.timeout
        return a

    @_errors
    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            self.tree.forget(ino, n)
            if ino not in self.tree.inodes:
                self._cached_version.pop(ino, None)

    @_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return attributes(self.tree.get(inode), self.timeout)

    @_errors
    async def setattr(
        self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields, fh: int | None, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if fields.update_size and attr.st_size:
            await self._resident(self.tree.get(inode))
        size = attr.st_size if fields.update_size else None
        if size is not None and self.shared is not None:  # the bytes are this node's: shared when sealed
            self.tree.setattr(inode, size=size)
            size = None
        node = await self._change(
            "setattr",
            inode,
            size=size,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        return attributes(node, self.timeout)

    @_errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return self.tree.readlink(inode)

    @_errors
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        inode = await self._change("mknod", parent_inode, name, mode, ctx.uid, ctx.gid, rdev)
        if inode.is_reg:  # no handle of it will close: it is whole as made (empty)
            self.tree.seal(inode)
        return self._entry(inode)

    @_errors
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(await self._change("mkdir", parent_inode, name, mode, ctx.uid, ctx.gid))

    @_errors
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(await self._change("symlink", parent_inode, name, target, ctx.uid, ctx.gid))

    @_errors
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(await self._change("link", inode, new_parent_inode, new_name))

    @_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self._change("unlink", parent_inode, name)

    @_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self._change("rmdir", parent_inode, name)

    @_errors
    async def rename(
        self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes, flags: int, ctx: pyfuse3.RequestContext
    ) -> None:
        await self._change("rename", parent_inode_old, name_old, parent_inode_new, name_new, flags)

    # -- files ---------------------------------------------------------------
    @_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if self.shared is not None:
            await self.shared.refresh()  # close-to-open: a file closed elsewhere before this open is seen as closed
        node = self.tree.get(inode)
        if flags & os.O_ACCMODE == os.O_RDONLY:
            await self._resident(node, 0, 0)  # a reader starts the load, and each read waits for its own bytes
        elif not flags & os.O_TRUNC:
            await self._resident(node)
        handle = self.tree.open(inode, flags, _keeps_setid(ctx))
        return self._file_info(handle.inode, handle.fh, flags)

    @_errors
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        if self.shared is None:
            handle = self.tree.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid, _keeps_setid(ctx))
        else:
            handle = await self.shared.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid, _keeps_setid(ctx))
        return self._file_info(handle.inode, handle.fh, flags), self._entry(handle.inode)

    @_errors
    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray | memoryview:
        inode = self.tree.handle(fh).inode
        while True:
            await self._resident(inode, off, off + size)  # served as soon as these bytes are in (or evicted while open)
            self.engine.touch(inode.ino)
            try:
                return self.tree.read(fh, off, size)
            except WouldBlock as slow:  # a file read in place from a store whose disk must be waited for
                data = await trio.to_thread.run_sync(slow.reader())
                if slow.still_served():
                    return data

    @_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        inode = self.tree.handle(fh).inode
        await self._resident(inode)
        made_room = False
        while True:
            while (spilling := self._spilling.get(inode.ino)) is not None:  # its bytes so far are on their way to disk
                await spilling.wait()
            try:
                return self.tree.write(fh, off, buf)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                full = exc
            if not self.tree.spilled(inode.ino):
                # RAM is full (C7): evict published files, give write-back a moment to
                # publish more, else continue this file on disk.
                if not made_room:
                    made_room = True
                    if await self.engine.make_room(len(buf) + (8 << 20), patience_s=ROOM_PATIENCE_S):
                        continue
                try:
                    await self._spill(inode)
                    continue
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    full = exc
            # The spill directory's disk is full too: published spilled files give
            # their room back, and the write goes on as write-back publishes more
            # (store speed); it fails only when nothing can free any.
            if not await self.engine.make_spill_room():
                self.tree.spill_full(inode, full)
                raise full
            made_room = False  # something changed: RAM may have room again too

    async def _spill(self, inode: Inode) -> None:
        """Continue the file on disk (RAM is full): its bytes so far are
        copied into the spill directory in a worker thread, gigabytes
        perhaps, while every other request is answered (on this thread a
        2 GiB budget held the whole mount 2.4 s); writes to the file wait
        for it. ENOSPC: the spill directory's disk is full."""
        spilling = self._spilling.get(inode.ino)
        if spilling is not None:
            await spilling.wait()
            return
        begun = self.tree.begin_spill(inode)
        if begun is None:
            return
        copy, version = begun
        self._spilling[inode.ino] = spilling = trio.Event()
        try:
            try:
                await trio.to_thread.run_sync(copy.run)
            except OSError as exc:
                self.tree.end_spill(inode, copy, version, exc)
                raise
            except BaseException:
                copy.discard()
                raise
            self.tree.end_spill(inode, copy, version)
        finally:
            del self._spilling[inode.ino]
            spilling.set()

    @_errors
    async def flush(self, fh: int) -> None:
        # close(2) waits for FLUSH, not for RELEASE: that one comes in the
        # background, and only once no process holds the open file (a child
        # forked meanwhile, such as a DataLoader worker, holds it for its
        # life). See `InodeTree.closed`.
        if self.shared is None:
            self.tree.closed(fh)  # sealed at once if nothing holds the open file (its RELEASE), else soon after
            return
        handle = self.tree.handle(fh)
        if handle.writable and handle.inode.writers == 1:
            # Cluster: sealed now, and its place in the cluster's log taken before close returns.
            self.tree.seal(handle.inode)
            await self.shared.placed()

    @_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        inode = self.tree.handle(fh).inode  # --fsync=ram: the data is in RAM already (C1)
        if self.fsync_durable and inode.data is not None:
            self.tree.seal(inode)
            if self.shared is not None:
                await self.shared.placed()
            await self.engine.wait_published(inode.ino, inode.generation)

    @_errors
    async def release(self, fh: int) -> None:
        self.tree.release(fh)

    # -- directories ---------------------------------------------------------
    @_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if not self.tree.get(inode).is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        for name, inode, cookie in self.tree.readdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, attributes(inode, self.timeout), cookie):
                break
            if name not in (b".", b".."):  # (the kernel takes no reference to those)
                self.tree.ref(inode)  # readdirplus hands the kernel a reference

    @_errors
    async def releasedir(self, fh: int) -> None:
        pass

    @_errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        self.tree.get(fh)

    @_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        usage = self.tree.usage()
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = usage.limit // 4096
        s.f_bfree = s.f_bavail = max(0, usage.limit - usage.used) // 4096
        s.f_files = FILES_MAX
        s.f_ffree = s.f_favail = FILES_MAX - usage.inodes
        s.f_namemax = 255
        return s

    # -- extended attributes -------------------------------------------------
    # `user.ckptfs.*` are virtual and read-only: each file's write-back state
    # (see daemon/status.py). Not listed, so `cp -a`/`rsync -X` do not copy them.
    @_errors
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if name.startswith(XATTR_PREFIX):
            if self.virtual_xattr is None:
                raise pyfuse3.FUSEError(errno.ENODATA)
            return self.virtual_xattr(self.tree.get(inode), name)
        return self.tree.getxattr(inode, name)

    @_errors
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        if name.startswith(XATTR_PREFIX):
            raise pyfuse3.FUSEError(errno.EPERM)
        await self._change("setxattr", inode, name, value)

    @_errors
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return self.tree.listxattr(inode)

    @_errors
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        if name.startswith(XATTR_PREFIX):
            raise pyfuse3.FUSEError(errno.EPERM)
        await self._change("removexattr", inode, name)


class _Invalidations:
    """Inodes whose cached attributes (and pages) the kernel must drop, and
    names it must forget, sent from a thread of their own: dropping pages
    waits for their locks, which a read in progress holds until this daemon
    answers it. A kernel that let go of the mount meanwhile (an unmount)
    refuses them: nothing is left to forget."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, bool | bytes]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def put(self, item: tuple[int, bool | bytes]) -> None:
        """(inode, whether attributes only), or (directory inode, name)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ckptfs-invalidate", daemon=True)
            self._thread.start()
        self._queue.put(item)

    def _run(self) -> None:
        while True:
            ino, what = self._queue.get()
            try:
                if isinstance(what, bytes):
                    pyfuse3.invalidate_entry(ino, what)
                else:
                    pyfuse3.invalidate_inode(ino, what)
            except OSError as exc:  # ENOENT: the kernel holds no reference to it
                if exc.errno != errno.ENOENT:
                    log.debug("cannot invalidate %s of inode %d: %s", "an entry" if isinstance(what, bytes) else "the attributes", ino, exc)


CAP_FSETID = 4


def _keeps_setid(ctx: pyfuse3.RequestContext):
    """Whether the requesting process has CAP_FSETID (its writes keep set-ID
    bits), asked from /proc only when a write meets such a bit, and once per
    open (a privileged writer keeps the bits, so its every write meets them)."""
    uid, pid = ctx.uid, ctx.pid
    answer: list[bool] = []

    def keeps() -> bool:
        if not answer:
            try:
                with open(f"/proc/{pid}/status") as f:
                    caps = next(line for line in f if line.startswith("CapEff:"))
                answer.append(bool(int(caps.split()[1], 16) >> CAP_FSETID & 1))
            except (OSError, StopIteration, ValueError):  # gone already: root is the best guess
                answer.append(uid == 0)
        return answer[0]

    return keeps
