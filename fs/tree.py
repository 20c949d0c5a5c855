"""The inode tree: the mount's namespace and file contents, FUSE-free.

Owns inodes (files, directories, symlinks, device/fifo/socket nodes), their
attributes, directory entries, open handles and the reference counts that
decide when an inode's memory is freed. Every method is synchronous and runs
on the caller's thread (the trio thread in the daemon); errors are `OSError`
with the errno a Linux file system would return.

Lifetime: an inode lives while it has a name (`nlink`), an open handle, or a
reference held by the client (`refs`, the kernel's lookup count). So a file
unlinked or replaced while open or mmapped stays readable until released.

Generations: the release of a file's last writable handle *seals* it; each
seal bumps `Inode.generation`. The write-back engine tracks files by
inode + generation, never by path.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import stat
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from .filedata import FileData, Snapshot, SpillCopy
from .loading import Borrowing, Loading
from .memory import MemoryPool, ram_for

log = logging.getLogger(__name__)

ROOT = 1
NAME_MAX = 255
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 65536
# The extended attributes of one inode, names and values, at most (as tmpfs
# bounds user.* ones): they live in the daemon's memory, outside the budget,
# and a loop of setxattr by any user of the mount must not exhaust it.
XATTR_TOTAL_MAX = 128 << 10
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
DOTS = ((b".", 1), (b"..", 2))  # the first entries of every listing, with their offsets; the entries' cookies come after
LISTINGS_KEPT = 64  # directories whose listing in progress is kept for resuming
MAX_SYMLINKS = 40  # followed in one path resolution, as Linux allows
RESERVED = b".ckptfs"  # the store's hidden prefix: no entry's name (below the root, a store's mount refuses it as another store)
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


class Journal(Protocol):
    """What the tree tells the write-back engine, as it happens. Paths are
    relative to the root, as of the moment of the event."""

    def sealed(self, ino: int, generation: int, snapshot: Snapshot) -> None: ...
    def grew(self, ino: int, data: FileData) -> None: ...  # written on from where the writer got to (`FileData.frontier`): the engine may stage it already
    def renamed(self, src: str, dst: str, ino: int, is_dir: bool, replaced: int | None = None) -> None: ...
    def exchanged(self, a: str, b: str) -> None: ...
    def linked(self, ino: int, path: str) -> None: ...
    def removed(self, path: str, ino: int, is_dir: bool) -> None: ...
    def made_dir(self, path: str, ino: int) -> None: ...
    def made_symlink(self, path: str, ino: int, target: str) -> None: ...
    def changed_attrs(self, ino: int) -> None: ...  # mode, owner or mtime set (not by a write): see `meta_of`
    def freed(self, ino: int) -> None: ...  # gone for good: no name, no open handle, no reference the kernel holds


def _err(code: int, what: str = "") -> OSError:
    return OSError(code, os.strerror(code) + (f": {what}" if what else ""))


@dataclass(eq=False, slots=True)  # slots: one per file of 100,000, a __dict__ each would be most of its memory
class Inode:
    ino: int
    mode: int
    uid: int
    gid: int
    rdev: int = 0
    nlink: int = 1
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    data: FileData | None = None  # regular files
    target: bytes = b""  # symlinks
    children: dict[bytes, int] | None = None  # directories: name -> ino
    cookies: dict[bytes, int] | None = None  # directories: name -> readdir offset
    next_cookie: int = len(DOTS) + 1
    parent: int = ROOT  # directories: for rename loop checks
    xattrs: dict[bytes, bytes] | None = None  # made at the first setxattr: few files have any
    refs: int = 0  # references held by the client (kernel lookup count)
    opens: int = 0
    writers: int = 0
    generation: int = 0  # bumped at every seal
    version: int = 0  # bumped at every data change
    sealed_version: int = -1  # `version` at the last seal
    links: set[tuple[int, bytes]] = field(default_factory=set)  # (parent ino, name)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def size(self) -> int:
        if self.data is not None:
            return self.data.size
        if stat.S_ISLNK(self.mode):
            return len(self.target)
        if self.children is not None:
            return 4096
        return 0

    @property
    def allocated(self) -> int:
        """Bytes the file takes (its st_blocks): in RAM or in its spill
        file, where holes take none; in the store only (evicted, or not
        loaded since a restart), its size. Never 0 for bytes that are
        somewhere: `tar --sparse` reads a file of 0 blocks as all holes and
        archives zeros."""
        if self.data is None:
            return 0
        if not self.data.resident:
            return self.size
        return self.data.spilled_bytes() if self.data.spilled else self.data.allocated


def _always() -> bool:
    return True


@dataclass(eq=False)
class Handle:
    fh: int
    inode: Inode
    writable: bool
    append: bool
    # Whether the opener may keep set-user/group-ID bits when it writes
    # (CAP_FSETID); asked only when a write finds such a bit set.
    keeps_setid: Callable[[], bool] = _always


@dataclass(frozen=True)
class Usage:
    used: int
    limit: int
    inodes: int


class InodeTree:
    def __init__(self, pool: MemoryPool, uid: int = 0, gid: int = 0, journal: Journal | None = None,
                 spill_dir: str | None = None, check_path: Callable[[str], None] | None = None) -> None:
        self.pool = pool
        # Raises OSError for a path the store cannot hold (an object store's
        # key rules): such an entry is refused when made or renamed, not
        # accepted and then never published. None: any path will do.
        self.check_path = check_path
        self.journal = journal
        self.spill_dir = spill_dir
        # Where every time the tree sets comes from: a cluster's replicas set
        # it to the time of the change they apply, so that all agree.
        self.clock: Callable[[], int] = time.time_ns
        self.inodes: dict[int, Inode] = {}
        self.handles: dict[int, Handle] = {}
        self.touched: set[int] = set()  # regular files whose size, data, names or seal changed (for status)
        self._next_ino = ROOT
        self._next_fh = 1
        self._listings: dict[int, list[tuple[int, bytes]]] = {}  # directory -> its names when a listing began
        # Files whose last descriptor open for writing was closed (`closed`)
        # while the open file itself lives on: ino -> (its version then, when),
        # oldest first. Sealed, unless written since, before any later change
        # to the tree, at a flush barrier, or once quiet (`seal_closed`).
        self._closed: dict[int, tuple[int, float]] = {}
        root = self._new_inode(stat.S_IFDIR | 0o755, uid, gid)
        root.nlink = 2
        root.refs = 1  # the kernel holds the root forever

    # -- lookup --------------------------------------------------------------
    def get(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise _err(errno.ENOENT, f"inode {ino}") from None

    def ref(self, inode: Inode) -> Inode:
        """The client now holds one more reference to `inode` (see `forget`)."""
        inode.refs += 1
        return inode

    def lookup(self, parent: int, name: bytes) -> Inode:
        d = self._dir(parent)
        _check_name(name)
        if name == b".":
            child = d
        elif name == b"..":
            child = self.get(d.parent)
        else:
            try:
                child = self.inodes[d.children[name]]  # type: ignore[index]
            except KeyError:
                raise _err(errno.ENOENT, name.decode(errors="replace")) from None
        return child

    def forget(self, ino: int, n: int) -> None:
        inode = self.inodes.get(ino)
        if inode is None:
            return
        inode.refs -= n
        self._maybe_free(inode)

    def _named(self, ino: int) -> str:
        """`ino` as a log line names it: its first path in the mount."""
        paths = self.paths_of(ino)
        return paths[0] if paths else f"inode {ino} (no name left)"

    def paths_of(self, ino: int) -> list[str]:
        """Every current path of `ino`, relative to the root ([] once unlinked)."""
        inode = self.inodes.get(ino)
        if inode is None:
            return []
        if ino == ROOT:
            return [""]
        out = []
        for parent, name in sorted(inode.links):
            prefix = self._dir_path(parent)
            if prefix is not None:
                out.append(f"{prefix}/{os.fsdecode(name)}" if prefix else os.fsdecode(name))
        return out

    def held_unnamed(self, ino: int) -> bool:
        """Whether `ino` is a file with no name left that a process may still
        read: open (or mmapped), or looked up by the kernel for an open that
        waits for the file's load. Readable until its last release, while
        the store's copy of it goes with its last name. (The kernel forgets
        an inode with no name as soon as it holds it no more.)"""
        inode = self.inodes.get(ino)
        return inode is not None and inode.data is not None and not inode.links and (inode.opens > 0 or inode.refs > 0)

    def directories(self) -> list[tuple[str, int]]:
        """Every directory under the root, each after the one holding it: (path, inode)."""
        out: list[tuple[str, int]] = []
        below = [("", self.inodes[ROOT])]
        while below:
            base, d = below.pop()
            for name, ino in (d.children or {}).items():
                child = self.inodes[ino]
                if child.children is not None:
                    path = f"{base}/{os.fsdecode(name)}" if base else os.fsdecode(name)
                    out.append((path, ino))
                    below.append((path, child))
        return out

    def symlinks(self) -> list[tuple[str, int, str]]:
        """Every symlink's name: (path, inode, target); one per name."""
        out = []
        for base, dir_ino in [("", ROOT), *self.directories()]:
            for name, ino in (self.inodes[dir_ino].children or {}).items():
                inode = self.inodes[ino]
                if stat.S_ISLNK(inode.mode):
                    path = f"{base}/{os.fsdecode(name)}" if base else os.fsdecode(name)
                    out.append((path, ino, os.fsdecode(inode.target)))
        return out

    def _dir_path(self, ino: int) -> str | None:
        """The path of directory `ino` ("" the root; None once unlinked).
        A loop up its parents, not a recursion: a tree may be deeper than
        Python's recursion limit (a directory has one name)."""
        names: list[bytes] = []
        while ino != ROOT:
            inode = self.inodes.get(ino)
            if inode is None or not inode.links:
                return None
            ino, name = min(inode.links)
            names.append(name)
        return "/".join(os.fsdecode(n) for n in reversed(names))

    def inode_at(self, path: str) -> Inode | None:
        node = self.inodes[ROOT]
        for part in path.split("/") if path else []:
            if node.children is None or (ino := node.children.get(os.fsencode(part))) is None:
                return None
            node = self.inodes[ino]
        return node

    def resolve(self, path: str, mountpoint: str) -> str:
        """The path of what `path` (from the root) names, every symlink on
        the way followed as the kernel would through the mount at
        `mountpoint`: FileNotFoundError if nothing is there, ValueError if a
        symlink leads out of the mount, OSError(ELOOP) past MAX_SYMLINKS."""
        todo = [p for p in path.split("/") if p][::-1]  # the components left, the next last
        done: list[str] = []
        hops = 0
        while todo:
            part = todo.pop()
            if part == ".":
                continue
            if part == "..":
                if not done:
                    raise ValueError("it leads out of the mount")
                done.pop()
                continue
            node = self.inode_at("/".join([*done, part]))
            if node is None:
                raise FileNotFoundError(errno.ENOENT, "no such file or directory", path)
            if not stat.S_ISLNK(node.mode):
                done.append(part)
                continue
            hops += 1
            if hops > MAX_SYMLINKS:
                raise OSError(errno.ELOOP, "too many levels of symbolic links")
            target = os.fsdecode(node.target)
            if target.startswith("/"):
                top = mountpoint.rstrip("/")
                if target != top and not target.startswith(top + "/"):
                    raise ValueError(f"a symlink in it leads out of the mount (to {target})")
                target, done = target[len(top):], []
            todo.extend(p for p in reversed(target.split("/")) if p)
        return "/".join(done)

    def _path(self, parent: int, name: bytes) -> str:
        prefix = self.paths_of(parent)
        base = prefix[0] if prefix else ""
        return f"{base}/{os.fsdecode(name)}" if base else os.fsdecode(name)

    # -- creation ------------------------------------------------------------
    def mknod(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0) -> Inode:
        if stat.S_IFMT(mode) == 0:
            mode |= stat.S_IFREG
        if stat.S_ISDIR(mode):
            raise _err(errno.EINVAL)
        d = self._prepare_new_entry(parent, name)
        inode = self._new_inode(mode, uid, gid, d)
        inode.rdev = rdev
        if inode.is_reg:
            inode.data = FileData(self.pool)
        self._link(d, name, inode)
        return inode

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        self.seal_closed()  # what was closed before this change is sealed before it
        d = self._prepare_new_entry(parent, name)
        inode = self._new_inode(stat.S_IFDIR | (mode & 0o7777), uid, gid, d)
        if d.mode & stat.S_ISGID:
            inode.mode |= stat.S_ISGID
        inode.nlink = 2
        inode.parent = d.ino
        self._link(d, name, inode)
        d.nlink += 1
        if self.journal is not None:
            self.journal.made_dir(self._path(parent, name), inode.ino)
        return inode

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        self.seal_closed()  # what was closed before this change is sealed before it
        d = self._prepare_new_entry(parent, name)
        inode = self._new_inode(stat.S_IFLNK | 0o777, uid, gid, d)
        inode.target = target
        self._link(d, name, inode)
        if self.journal is not None:
            self.journal.made_symlink(self._path(parent, name), inode.ino, os.fsdecode(target))
        return inode

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        self.seal_closed()  # what was closed before this change is sealed before it
        inode = self.get(ino)
        if inode.is_dir:
            raise _err(errno.EPERM)
        d = self._prepare_new_entry(parent, name)
        self._link(d, name, inode)
        inode.nlink += 1
        inode.ctime_ns = self.clock()
        if self.journal is not None:
            self.journal.linked(inode.ino, self._path(parent, name))
        return inode

    # -- removal -------------------------------------------------------------
    def unlink(self, parent: int, name: bytes) -> Inode:
        self.seal_closed()  # what was closed before this change is sealed before it
        d = self._dir(parent)
        inode = self.lookup(parent, name)
        if inode.is_dir:
            raise _err(errno.EISDIR)
        path = self._path(parent, name) if self.journal is not None else ""
        self._unlink_entry(d, name)
        inode.nlink -= 1
        inode.ctime_ns = d.mtime_ns
        if self.journal is not None:
            self.journal.removed(path, inode.ino, False)
        self._maybe_free(inode)
        return inode

    def rmdir(self, parent: int, name: bytes) -> Inode:
        self.seal_closed()  # what was closed before this change is sealed before it
        d = self._dir(parent)
        if name == b".":
            raise _err(errno.EINVAL)
        if name == b"..":
            raise _err(errno.ENOTEMPTY)
        inode = self.lookup(parent, name)
        if not inode.is_dir:
            raise _err(errno.ENOTDIR)
        if inode.children:
            raise _err(errno.ENOTEMPTY)
        path = self._path(parent, name) if self.journal is not None else ""
        self._unlink_entry(d, name)
        d.nlink -= 1
        inode.nlink = 0
        inode.ctime_ns = d.mtime_ns
        if self.journal is not None:
            self.journal.removed(path, inode.ino, True)
        self._maybe_free(inode)
        return inode

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, flags: int = 0) -> Inode | None:
        """Rename; returns the inode that lost its name (replaced), if any."""
        self.seal_closed()  # what was closed before this change is sealed before it
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == RENAME_NOREPLACE | RENAME_EXCHANGE:
            raise _err(errno.EINVAL)
        src_dir, dst_dir = self._dir(old_parent), self._dir(new_parent)
        if old_name in (b".", b"..") or new_name in (b".", b".."):
            raise _err(errno.EBUSY)
        inode = self.lookup(old_parent, old_name)
        _check_name(new_name)
        if new_name == RESERVED:
            raise _err(errno.EPERM, "reserved name")
        target_ino = dst_dir.children.get(new_name)  # type: ignore[union-attr]
        target = self.inodes[target_ino] if target_ino is not None else None
        if flags & RENAME_NOREPLACE and target is not None:
            raise _err(errno.EEXIST)
        if flags & RENAME_EXCHANGE and target is None:
            raise _err(errno.ENOENT)
        if target is inode:
            return None  # POSIX: renaming a name onto another link of itself does nothing (Linux: an exchange too)
        if flags & RENAME_EXCHANGE:
            if self.check_path is not None:
                src, dst = self._path(old_parent, old_name), self._path(new_parent, new_name)
                self._check_moved(inode, src, dst)
                self._check_moved(target, dst, src)
            return self._exchange(src_dir, old_name, inode, dst_dir, new_name, target)
        if inode.is_dir:
            self._check_not_ancestor(inode, dst_dir)
        if target is not None:
            if inode.is_dir:
                if not target.is_dir:
                    raise _err(errno.ENOTDIR)
                if target.children:
                    raise _err(errno.ENOTEMPTY)
            elif target.is_dir:
                raise _err(errno.EISDIR)
        if self.check_path is not None:
            self._check_moved(inode, self._path(old_parent, old_name), self._path(new_parent, new_name))
        if self.journal is not None:
            src_path, dst_path = self._path(old_parent, old_name), self._path(new_parent, new_name)
        now = self.clock()
        if target is not None:
            self._unlink_entry(dst_dir, new_name, now)
            if target.is_dir:
                dst_dir.nlink -= 1
                target.nlink = 0
            else:
                target.nlink -= 1
            target.ctime_ns = now
        self._unlink_entry(src_dir, old_name, now)
        self._link(dst_dir, new_name, inode, now)
        if inode.is_dir and src_dir is not dst_dir:
            src_dir.nlink -= 1
            dst_dir.nlink += 1
            inode.parent = dst_dir.ino
        inode.ctime_ns = now
        if self.journal is not None:
            self.journal.renamed(src_path, dst_path, inode.ino, inode.is_dir, target.ino if target is not None else None)
        if target is not None:
            self._maybe_free(target)
        return target

    def _exchange(self, src_dir: Inode, a_name: bytes, a: Inode, dst_dir: Inode, b_name: bytes, b: Inode) -> None:
        if a.is_dir:
            self._check_not_ancestor(a, dst_dir)
        if b.is_dir:
            self._check_not_ancestor(b, src_dir)
        now = self.clock()
        src_dir.children[a_name] = b.ino  # type: ignore[index]
        dst_dir.children[b_name] = a.ino  # type: ignore[index]
        a.links.discard((src_dir.ino, a_name))
        b.links.discard((dst_dir.ino, b_name))
        a.links.add((dst_dir.ino, b_name))
        b.links.add((src_dir.ino, a_name))
        if src_dir is not dst_dir:
            for moved, old, new in ((a, src_dir, dst_dir), (b, dst_dir, src_dir)):
                if moved.is_dir:
                    old.nlink -= 1
                    new.nlink += 1
                    moved.parent = new.ino
        for i in (src_dir, dst_dir):
            i.mtime_ns = i.ctime_ns = now
        a.ctime_ns = b.ctime_ns = now
        if self.journal is not None:
            self.journal.exchanged(self._path(src_dir.ino, a_name), self._path(dst_dir.ino, b_name))

    # -- attributes ----------------------------------------------------------
    def setattr(
        self,
        ino: int,
        *,
        size: int | None = None,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
    ) -> Inode:
        inode = self.get(ino)
        self.seal_closed()
        now = self.clock()
        if size is not None:
            if inode.is_dir:
                raise _err(errno.EISDIR)
            if inode.data is None:
                raise _err(errno.EINVAL)
            self.truncate(inode, size)
            if not inode.writers:  # a truncate by path: no close will seal it
                self.seal(inode)
        if mode is not None:
            inode.mode = stat.S_IFMT(inode.mode) | (mode & 0o7777)
        if uid is not None and uid != -1 and uid != 0xFFFFFFFF:
            inode.uid = uid
        if gid is not None and gid != -1 and gid != 0xFFFFFFFF:
            inode.gid = gid
        if atime_ns is not None:
            inode.atime_ns = atime_ns
        if mtime_ns is not None:
            inode.mtime_ns = mtime_ns
        if self.journal is not None and (mode, uid, gid, mtime_ns) != (None, None, None, None) and not _sealed_later(inode):
            self.journal.changed_attrs(inode.ino)
        inode.ctime_ns = now
        return inode

    def truncate(self, inode: Inode, size: int) -> None:
        assert inode.data is not None
        if size < 0:
            raise _err(errno.EINVAL)
        if size == 0:
            inode.data.clear()
        else:
            inode.data.truncate(size)
        inode.mtime_ns = inode.ctime_ns = self.clock()
        inode.version += 1
        self.touched.add(inode.ino)

    def readlink(self, ino: int) -> bytes:
        inode = self.get(ino)
        if not stat.S_ISLNK(inode.mode):
            raise _err(errno.EINVAL)
        return inode.target

    # -- extended attributes -------------------------------------------------
    def getxattr(self, ino: int, name: bytes) -> bytes:
        try:
            return (self.get(ino).xattrs or {})[name]
        except KeyError:
            raise _err(errno.ENODATA) from None

    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        if not name or len(name) > XATTR_NAME_MAX:
            raise _err(errno.ERANGE)
        if len(value) > XATTR_SIZE_MAX:
            raise _err(errno.E2BIG)
        if not name.startswith((b"user.", b"trusted.", b"security.")):
            raise _err(errno.EOPNOTSUPP)
        inode = self.get(ino)
        if inode.xattrs is None:
            inode.xattrs = {}
        others = sum(len(k) + len(v) for k, v in inode.xattrs.items() if k != name)
        if others + len(name) + len(value) > XATTR_TOTAL_MAX:
            raise _err(errno.ENOSPC, f"an inode's extended attributes take at most {XATTR_TOTAL_MAX} bytes")
        inode.xattrs[name] = bytes(value)
        inode.ctime_ns = self.clock()

    def listxattr(self, ino: int) -> list[bytes]:
        return list(self.get(ino).xattrs or ())

    def removexattr(self, ino: int, name: bytes) -> None:
        inode = self.get(ino)
        if inode.xattrs is None or inode.xattrs.pop(name, None) is None:
            raise _err(errno.ENODATA)
        inode.ctime_ns = self.clock()

    # -- open files ----------------------------------------------------------
    def open(self, ino: int, flags: int, keeps_setid: Callable[[], bool] = _always) -> Handle:
        """`keeps_setid`: whether the opener has CAP_FSETID; without it, its
        writes and an O_TRUNC clear set-ID bits (as Linux file systems do)."""
        inode = self.get(ino)
        if inode.is_dir and flags & os.O_ACCMODE != os.O_RDONLY:
            raise _err(errno.EISDIR)
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        if writable and inode.data is None and not inode.is_dir:
            # fifos, sockets and devices are opened by the kernel, never here
            raise _err(errno.EINVAL)
        if flags & os.O_TRUNC and writable and inode.data is not None:
            if inode.data.size:
                self.truncate(inode, 0)
            elif not inode.data.resident:
                # Empty, its bytes elsewhere (in the store, or lost with another node): none of them
                # will be read, so none need loading. A write after this open used to load them first.
                inode.data.clear()
            self._drop_setid(inode, keeps_setid)
        handle = Handle(self._next_fh, inode, writable, bool(flags & os.O_APPEND), keeps_setid)
        self._next_fh += 1
        self.handles[handle.fh] = handle
        inode.opens += 1
        if writable:
            inode.writers += 1
        return handle

    def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int,
               keeps_setid: Callable[[], bool] = _always) -> Handle:
        d = self._dir(parent)
        _check_name(name)
        if name in d.children:  # type: ignore[operator]
            if flags & os.O_EXCL:
                raise _err(errno.EEXIST)
            inode = self.lookup(parent, name)
            if inode.is_dir:
                raise _err(errno.EISDIR)
            return self.open(inode.ino, flags, keeps_setid)
        inode = self.mknod(parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid)
        return self.open(inode.ino, flags, keeps_setid)

    def handle(self, fh: int) -> Handle:
        try:
            return self.handles[fh]
        except KeyError:
            raise _err(errno.EBADF) from None

    def read(self, fh: int, off: int, size: int) -> bytes | bytearray | memoryview:
        inode = self.handle(fh).inode
        if inode.data is None:
            raise _err(errno.EISDIR if inode.is_dir else errno.EINVAL)
        return inode.data.read(off, size)

    def write(self, fh: int, off: int, data: bytes) -> int:
        handle = self.handle(fh)
        inode = handle.inode
        if not handle.writable or inode.data is None:
            raise _err(errno.EBADF)
        if handle.append:
            off = inode.data.size
        frontier = inode.data.frontier
        n = inode.data.write(off, data)
        if inode.data.frontier > frontier and self.journal is not None:
            self.journal.grew(inode.ino, inode.data)
        inode.mtime_ns = inode.ctime_ns = self.clock()
        inode.version += 1
        self.touched.add(inode.ino)
        self._drop_setid(inode, handle.keeps_setid)
        return n

    def _drop_setid(self, inode: Inode, keeps_setid: Callable[[], bool]) -> None:
        """A write or truncation by a process without CAP_FSETID clears
        set-user-ID, and set-group-ID where group-executable (Linux's rule:
        without group execute, set-group-ID marks mandatory locking)."""
        bits = stat.S_ISUID | (stat.S_ISGID if inode.mode & stat.S_IXGRP else 0)
        if inode.mode & bits and not keeps_setid():
            inode.mode &= ~bits
            inode.ctime_ns = self.clock()
            if self.journal is not None and not _sealed_later(inode):
                self.journal.changed_attrs(inode.ino)

    def release(self, fh: int) -> Inode | None:
        """Close a handle; returns the inode if this sealed it (last writer)."""
        handle = self.handles.pop(fh, None)
        if handle is None:
            return None
        inode = handle.inode
        inode.opens -= 1
        sealed = None
        if handle.writable:
            inode.writers -= 1
            if inode.writers == 0 and self.seal(inode):
                sealed = inode
        self._maybe_free(inode)
        return sealed

    def seal(self, inode: Inode) -> bool:
        """Make the file's current bytes a generation that must reach the
        store; False if nothing changed since the last seal. Files closed
        before are sealed first (`seal_closed`)."""
        self.seal_closed()
        return self._seal(inode)

    def closed(self, fh: int) -> None:
        """A descriptor of handle `fh` was closed (the kernel's FLUSH, which
        close(2) waits for). The kernel lets go of the open file (RELEASE,
        which seals it) only later, in the background, and not at all while
        a process forked meanwhile holds it (a DataLoader worker, for its
        life): if this was its last writer's descriptor, the file is marked
        closed, to be sealed by `seal_closed`. A descriptor closed in such a
        child (at its exec or exit) while the writer goes on marks it too;
        the writer's next write undoes the mark."""
        handle = self.handles.get(fh)
        if handle is None or not handle.writable:
            return
        inode = handle.inode
        if inode.writers == 1 and inode.version != inode.sealed_version:
            self._closed.pop(inode.ino, None)  # newest last
            self._closed[inode.ino] = (inode.version, time.monotonic())

    def seal_closed(self, quiet_s: float = 0.0) -> None:
        """Seal the files marked `closed` and not written since, oldest
        first; with `quiet_s`, only those marked that long ago."""
        if not self._closed:
            return
        now = time.monotonic()
        for ino, (version, at) in list(self._closed.items()):
            if now - at < quiet_s:
                break  # the rest were marked later still
            del self._closed[ino]
            inode = self.inodes.get(ino)
            if inode is not None and inode.version == version and inode.writers == 1:
                self._seal(inode)

    def _seal(self, inode: Inode) -> bool:
        if inode.data is None or inode.version == inode.sealed_version or not inode.data.resident:
            return False
        inode.data.fit()  # its size is likely final now
        inode.generation += 1
        inode.sealed_version = inode.version
        self.touched.add(inode.ino)
        if self.journal is not None and inode.nlink > 0:
            self.journal.sealed(inode.ino, inode.generation, inode.data.snapshot())
        return True

    def reseal(self, ino: int) -> bool:
        """Seal the file's bytes again, unchanged: the store lost the only
        copy of a published generation while the mount still has the file
        under a name the store does not show yet. False if it is not in RAM
        or is open for writing (its close seals it)."""
        inode = self.inodes.get(ino)
        if inode is None or inode.data is None or inode.writers or not inode.data.resident:
            return False
        inode.version += 1
        return self.seal(inode)

    def sealed_elsewhere(self, ino: int, generation: int, size: int, mtime_ns: int, keep: bool = False) -> Inode | None:
        """Another node sealed `generation` of this file (cluster mode): its
        bytes are there, and then in the store; here the file comes back
        evicted, with that size (loaded on first use). `keep`: this node's
        own bytes stay (it sealed them later, or writes them still: the
        last seal wins). The inode, None if it is gone."""
        inode = self.inodes.get(ino)
        if inode is None or inode.data is None:
            return None
        if not keep and not inode.writers:
            inode.data.evict()  # a load of the older generation under way is fenced out
            inode.data.size = size
            inode.data.resident = False
            inode.version += 1
            inode.sealed_version = inode.version
            inode.mtime_ns = mtime_ns
            inode.ctime_ns = self.clock()
        inode.generation = max(inode.generation, generation)
        self.touched.add(ino)
        return inode

    def evict(self, ino: int, generation: int) -> int:
        """Drop a file's bytes from RAM, or its spill file, if `generation` is
        its current, closed content (so the store has exactly these bytes);
        returns the bytes freed (in RAM, or on the spill directory's disk)."""
        inode = self.inodes.get(ino)
        if (inode is None or inode.data is None or not inode.data.resident or inode.writers
                or inode.generation != generation or inode.version != inode.sealed_version):
            return 0
        self.touched.add(ino)
        freed = inode.data.spilled_bytes() if inode.data.spilled else inode.data.allocated
        inode.data.evict()
        return freed

    def spill(self, inode: Inode) -> None:
        """RAM cannot hold this file: continue it in the spill directory
        (copied on this thread; `fs.ops` copies in a worker thread)."""
        begun = self.begin_spill(inode)
        if begun is None:
            return
        copy, version = begun
        try:
            copy.run()
        except OSError as exc:
            self.end_spill(inode, copy, version, exc)
            raise
        self.end_spill(inode, copy, version)

    def begin_spill(self, inode: Inode) -> tuple[SpillCopy, int] | None:
        """RAM cannot hold this file: start continuing it in the spill
        directory. The copy of its bytes (`SpillCopy.run`) may run in any
        thread, then `end_spill` with the version returned. None if the file
        is spilled already."""
        if inode.data is None or inode.data.spilled:
            return None
        if self.spill_dir is None:
            raise _err(errno.ENOSPC, "RAM budget exhausted and no spill directory")
        try:
            return inode.data.spill_copy(self.spill_dir), inode.version
        except OSError as exc:
            if exc.errno != errno.ENOSPC:  # full: the caller may wait for room (`spill_full` if it gives up)
                self.spill_full(inode, exc)
            raise

    def end_spill(self, inode: Inode, copy: SpillCopy, version: int, failed: OSError | None = None) -> bool:
        """After the copy (`failed`: why it could not be made): the file
        continues in it, True; or, if the file changed meanwhile, the copy is
        dropped and the caller tries again, False."""
        data = inode.data
        if failed is not None or data is None or data.spilled or not data.resident or inode.version != version:
            copy.discard()
            if failed is not None and failed.errno != errno.ENOSPC:
                self.spill_full(inode, failed)
            return False
        data.spilled_to(copy)
        log.warning("RAM budget full: continuing %s (%d bytes so far) on disk in %s, at disk speed",
                    self._named(inode.ino), data.size, self.spill_dir)
        self.touched.add(inode.ino)
        return True

    def spill_full(self, inode: Inode, exc: OSError) -> None:
        """Say why a write that RAM could not hold fails in the spill directory."""
        log.error("cannot continue %s on disk in %s (%s): its write fails with that error; give --spill-dir a writable "
                  "local disk with room", self._named(inode.ino), self.spill_dir, exc.strerror)

    def spilled(self, ino: int) -> bool:
        inode = self.inodes.get(ino)
        return inode is not None and inode.data is not None and inode.data.spilled

    def resident(self, ino: int) -> bool:
        inode = self.inodes.get(ino)
        return inode is None or inode.data is None or inode.data.resident

    def free_bytes(self) -> int:
        return self.pool.available

    @staticmethod
    def ram_for(size: int) -> int:
        return ram_for(size)

    def begin_load(self, ino: int, spill: bool) -> Loading | None:
        """Start bringing an evicted file's bytes back: into RAM (the budget
        reserved for all of it: ENOSPC if it cannot be), or into a spill
        file; None if the file is resident (or being loaded) already."""
        inode = self.get(ino)
        if inode.data is None or inode.data.resident or inode.data.loading is not None:
            return None
        if spill and self.spill_dir is None:
            raise _err(errno.ENOSPC, "RAM budget exhausted and no spill directory")
        self.touched.add(ino)
        return Loading(inode.data, self.spill_dir if spill else None)

    def begin_borrow(self, ino: int) -> Borrowing | None:
        """Start serving an evicted file's reads from its file in a local
        store (`fs.loading.Borrowing`); None if it is resident, or being loaded
        or borrowed already."""
        inode = self.get(ino)
        data = inode.data
        if data is None or data.resident or data.loading is not None or data.borrowed is not None:
            return None
        return Borrowing(data)

    def borrow_covers(self, ino: int, off: int, end: int | None) -> bool:
        """Whether reads of the bytes `off`..`end` are served from the store
        in place now (never all of them: `end` None asks for them in RAM)."""
        inode = self.inodes.get(ino)
        if end is None or inode is None or inode.data is None or inode.data.borrowed is None:
            return False
        return inode.data.borrowed.covers(off, end)

    def borrowed_fd(self, ino: int) -> int:
        """The descriptor of the store file every byte of an evicted file is
        served from, verified (-1: none such). It keeps those bytes when the
        store's name for them goes."""
        inode = self.inodes.get(ino)
        borrowed = None if inode is None or inode.data is None else inode.data.borrowed
        return borrowed.fd if borrowed is not None and borrowed.covers(0, None) else -1

    def unborrow(self, ino: int) -> None:
        inode = self.inodes.get(ino)
        if inode is not None and inode.data is not None:
            inode.data.unborrow()

    def let_go_held(self, ino: int) -> int:
        """Let go of the blocks a file read in place holds for its reader;
        returns the bytes of the budget freed."""
        inode = self.inodes.get(ino)
        if inode is None or inode.data is None or inode.data.borrowed is None:
            return 0
        return inode.data.borrowed.let_go_held()

    def meta_of(self, ino: int) -> tuple[int, int, int, int] | None:
        """(mode, uid, gid, mtime_ns) of an inode, None if it is gone."""
        inode = self.inodes.get(ino)
        return None if inode is None else (inode.mode, inode.uid, inode.gid, inode.mtime_ns)

    def restore(self, path: str, mode: int, size: int = 0, mtime_ns: int | None = None, target: str = "", uid: int | None = None,
                gid: int | None = None) -> Inode:
        """Recreate an entry found in the store (restart), with exactly the
        given mode, owner (None: the mount's owner) and mtime. Regular files
        come back evicted (their bytes load on first use); parents are
        created as needed, and a directory that exists already (made as a
        parent) takes the given attributes. Nothing is journaled: the store
        already has it. "" is the root."""
        journal, self.journal = self.journal, None
        try:
            root = self.inodes[ROOT]
            owner = (root.uid if uid is None else uid, root.gid if gid is None else gid)
            parent, inode = root, root
            if path:
                parts = path.encode(_FS_ENCODING, _FS_ERRORS).split(b"/")  # os.fsencode, once per path, not per part
                for part in parts[:-1]:
                    child = parent.children.get(part)  # type: ignore[union-attr]
                    parent = self.inodes[child] if child is not None else self.mkdir(parent.ino, part, 0o755, root.uid, root.gid)
                existing = parent.children.get(parts[-1])  # type: ignore[union-attr]
                if existing is not None:
                    inode = self.inodes[existing]
                    if not (stat.S_ISDIR(mode) and inode.is_dir):
                        return inode
                elif stat.S_ISDIR(mode):
                    inode = self.mkdir(parent.ino, parts[-1], mode, *owner)
                elif stat.S_ISLNK(mode):
                    inode = self.symlink(parent.ino, parts[-1], os.fsencode(target), *owner)
                else:
                    inode = self.mknod(parent.ino, parts[-1], stat.S_IFREG | (mode & 0o7777), *owner)
                    assert inode.data is not None
                    inode.data.size = size
                    inode.data.resident = False
                    inode.generation = 1
                    inode.sealed_version = inode.version
            elif not stat.S_ISDIR(mode):
                return root
            if not stat.S_ISLNK(mode):
                inode.mode = stat.S_IFMT(inode.mode) | (mode & 0o7777)  # as recorded, whatever the parent's set-group-ID says
            inode.uid, inode.gid = owner
            if mtime_ns is not None:  # None: not recorded (0 is 1970)
                inode.mtime_ns = mtime_ns
            return inode
        finally:
            self.journal = journal

    def restore_files(self, parent: str, files: Iterable[tuple[str, int, int, int | None, int | None, int | None]]) -> list[Inode]:
        """`restore` of many regular files in one directory, `parent` (made
        as needed, "" the root): (name, mode, size, mtime_ns or None, uid,
        gid) each. A restart restores every file of the store: this is the loop
        over them, with the directory found once. A name taken already keeps
        what holds it (as `restore`)."""
        d = self.inode_at(parent)
        if d is None:
            d = self.restore(parent, stat.S_IFDIR | 0o755)
        if not d.is_dir:
            return [self.restore(f"{parent}/{name}" if parent else name, stat.S_IFREG | mode, size, mtime_ns, "", uid, gid)
                    for name, mode, size, mtime_ns, uid, gid in files]
        assert d.children is not None and d.cookies is not None
        root = self.inodes[ROOT]
        now = self.clock()
        made = []
        for name, mode, size, mtime_ns, uid, gid in files:
            key = name.encode(_FS_ENCODING, _FS_ERRORS)
            existing = d.children.get(key)
            if existing is not None:
                made.append(self.inodes[existing])
                continue
            _check_name(key)
            if d.ino == ROOT and key == RESERVED:
                raise _err(errno.EPERM, "reserved name")
            inode = Inode(self._next_ino, stat.S_IFREG | (mode & 0o7777), root.uid if uid is None else uid, root.gid if gid is None else gid,
                          atime_ns=now, mtime_ns=now if mtime_ns is None else mtime_ns, ctime_ns=now, generation=1, sealed_version=0)
            self._next_ino += 1
            inode.data = data = FileData(self.pool)
            data.size, data.resident = size, False
            self.inodes[inode.ino] = inode
            inode.links.add((d.ino, key))
            self.touched.add(inode.ino)
            d.children[key] = inode.ino
            d.cookies[key] = d.next_cookie
            d.next_cookie += 1
            made.append(inode)
        d.mtime_ns = d.ctime_ns = now
        return made

    @property
    def next_ino(self) -> int:
        """The number the next new inode takes."""
        return self._next_ino

    def load(self, inodes: list[Inode], next_ino: int) -> None:
        """Take a whole namespace at once, as a cluster node that joins late
        takes another replica's (`cluster.snapshot`): `inodes` are every
        inode with a name, the root among them, each with its `links`; the
        directory entries, link counts and parents follow from those. Only
        into a tree that holds nothing but its root. Nothing is journaled."""
        if len(self.inodes) != 1 or self.handles:
            raise RuntimeError("a namespace is loaded only into an empty tree")
        refs = self.inodes[ROOT].refs
        self.inodes = {inode.ino: inode for inode in inodes}
        self.inodes[ROOT].refs = refs
        for inode in inodes:
            if inode.is_dir:
                inode.children, inode.cookies, inode.nlink = {}, {}, 2
            else:
                inode.nlink = len(inode.links)
        for inode in inodes:
            for parent, name in sorted(inode.links):
                d = self.inodes[parent]
                d.children[name] = inode.ino  # type: ignore[index]
                d.cookies[name] = d.next_cookie  # type: ignore[index]
                d.next_cookie += 1
                if inode.is_dir:
                    inode.parent = parent
                    d.nlink += 1
        self._next_ino = next_ino
        self.touched.update(self.inodes)

    # -- directories ---------------------------------------------------------
    def readdir(self, ino: int, offset: int) -> Iterator[tuple[bytes, Inode, int]]:
        """Entries after `offset`, each with the offset to resume after it:
        "." and ".." first (`DOTS`), as a local file system lists them.

        Offsets are per-entry cookies that only grow, so a listing resumed
        after concurrent creates and deletes neither repeats nor skips the
        entries that stayed.
        """
        d = self._dir(ino)
        assert d.children is not None and d.cookies is not None
        for name, cookie in DOTS:
            if offset < cookie:
                yield name, (d if name == b"." else self.inodes[d.parent]), cookie
        listing = self._listings.get(ino) if offset > DOTS[-1][1] else None
        if listing is None:  # a listing starts (past the dots): the names as they are now, in cookie order
            listing = self._listings[ino] = [(cookie, name) for name, cookie in d.cookies.items()]
            while len(self._listings) > LISTINGS_KEPT:
                del self._listings[next(iter(self._listings))]
        last = listing[-1][0] if listing else 0
        # Resumed by bisection, not by a scan from the start: a listing of n
        # entries costs O(n), not O(n^2) over its many readdir calls.
        for i in range(bisect.bisect_right(listing, offset, key=lambda e: e[0]), len(listing)):
            cookie, name = listing[i]  # by index: a slice would copy the rest at every call
            if d.cookies.get(name) == cookie:  # still there, and not re-created since
                yield name, self.inodes[d.children[name]], cookie
        newer = []  # created since the listing started: at the dict's end
        for name in reversed(d.cookies):
            if d.cookies[name] <= last:
                break
            newer.append(name)
        for name in reversed(newer):
            if d.cookies[name] > offset:
                yield name, self.inodes[d.children[name]], d.cookies[name]

    def files_under(self, prefix: str = "") -> Iterator[tuple[str, Inode]]:
        """Every regular file at or under `prefix` with its path, depth first:
        the cost of the subtree, not of the whole tree."""
        start = self.inode_at(prefix)
        if start is not None:
            yield from ((path, node) for path, node in _walk(self, prefix, start) if node.is_reg and node.data is not None)

    def open_for_write(self) -> list[Inode]:
        return [i for i in self.inodes.values() if i.writers > 0]

    def usage(self) -> Usage:
        return Usage(self.pool.used, self.pool.limit, len(self.inodes))

    # -- internals -----------------------------------------------------------
    def _new_inode(self, mode: int, uid: int, gid: int, parent: Inode | None = None) -> Inode:
        if parent is not None and parent.mode & stat.S_ISGID:
            gid = parent.gid
        now = self.clock()
        inode = Inode(self._next_ino, mode, uid, gid, atime_ns=now, mtime_ns=now, ctime_ns=now)
        self._next_ino += 1
        if stat.S_ISDIR(mode):
            inode.children, inode.cookies = {}, {}
        self.inodes[inode.ino] = inode
        return inode

    def _dir(self, ino: int) -> Inode:
        d = self.get(ino)
        if not d.is_dir:
            raise _err(errno.ENOTDIR)
        if d.nlink == 0:
            raise _err(errno.ENOENT)  # a removed directory can hold no entries
        return d

    def _prepare_new_entry(self, parent: int, name: bytes) -> Inode:
        d = self._dir(parent)
        _check_name(name)
        if name in (b".", b"..") or name in d.children:  # type: ignore[operator]
            raise _err(errno.EEXIST)
        if name == RESERVED:
            raise _err(errno.EPERM, "reserved name")
        if self.check_path is not None:
            self.check_path(self._path(parent, name))
        return d

    def _check_moved(self, inode: Inode, old: str, new: str) -> None:
        """`inode` (at `old`) goes to `new`: every path it brings there must be
        one the store can hold. Its names below did not change: only a longer
        path can make a key too long."""
        if self.check_path is None:
            return
        self.check_path(new)
        if inode.is_dir and len(os.fsencode(new)) > len(os.fsencode(old)):
            longest = max((p for p, _ in _walk(self, "", inode)), key=lambda p: len(os.fsencode(p)))
            if longest:
                self.check_path(f"{new}/{longest}")

    def _link(self, d: Inode, name: bytes, inode: Inode, now: int | None = None) -> None:
        inode.links.add((d.ino, name))
        self.touched.add(inode.ino)
        d.children[name] = inode.ino  # type: ignore[index]
        d.cookies[name] = d.next_cookie  # type: ignore[index]
        d.next_cookie += 1
        d.mtime_ns = d.ctime_ns = now or self.clock()

    def _unlink_entry(self, d: Inode, name: bytes, now: int | None = None) -> None:
        self.inodes[d.children[name]].links.discard((d.ino, name))  # type: ignore[index]
        self.touched.add(d.children[name])  # type: ignore[index]
        del d.children[name]  # type: ignore[union-attr]
        del d.cookies[name]  # type: ignore[union-attr]
        d.mtime_ns = d.ctime_ns = now or self.clock()

    def _check_not_ancestor(self, moved: Inode, dst_dir: Inode) -> None:
        node = dst_dir
        while True:
            if node is moved:
                raise _err(errno.EINVAL, "cannot move a directory into itself")
            if node.ino == ROOT:
                return
            node = self.inodes[node.parent]

    def _maybe_free(self, inode: Inode) -> None:
        if inode.nlink > 0 or inode.opens > 0 or inode.refs > 0 or inode.ino == ROOT:
            return
        if inode.data is not None:
            inode.data.clear()
        del self.inodes[inode.ino]
        self._listings.pop(inode.ino, None)  # a directory's names, kept while a listing of it may resume
        self.touched.add(inode.ino)
        if self.journal is not None:
            self.journal.freed(inode.ino)


def _walk(tree: InodeTree, path: str, start: Inode) -> Iterator[tuple[str, Inode]]:
    """`start` (at `path`) and every entry under it with its path, depth
    first: a loop, not a recursion (a tree may be deeper than Python's
    recursion limit)."""
    stack = [(path, start)]
    while stack:
        path, node = stack.pop()
        yield path, node
        if node.children is not None:
            for name, ino in node.children.items():
                stack.append((f"{path}/{os.fsdecode(name)}" if path else os.fsdecode(name), tree.inodes[ino]))


def _check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise _err(errno.ENAMETOOLONG)
    if not name or b"/" in name or b"\0" in name:
        raise _err(errno.EINVAL)


def _sealed_later(inode: Inode) -> bool:
    """Whether the inode is a new file never sealed yet, open for writing:
    its first seal hands the engine the attributes with the bytes, so a
    change of them now (tar's and `cp -a`'s fchmod and fchown before close)
    needs no op of its own. Not a file sealed before: the store may show an
    older generation of it, whose mode must follow the mount's at once (a
    chmod 600 of a log file kept open must not leave the store's copy
    readable until the close)."""
    return inode.data is not None and inode.writers > 0 and inode.generation == 0 and inode.version != inode.sealed_version
