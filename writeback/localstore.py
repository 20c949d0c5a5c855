"""A local directory as a store (file://): `LocalBackend`.

Staged files are temp files in the daemon's staging directory, fsynced;
published by rename(2). Directories move by one rename(2), and a group of
small files shares one syncfs. Nothing in the store is reached through a
symlink: every path is walked from the root with O_NOFOLLOW (or openat2's
RESOLVE_BENEATH), and calls act relative to their parent's descriptor.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator

from ckptfs.holes import is_hole, read_sparse

from . import listing
from .backend import META, STAGING, Backend, Entry, Source, Staged, _FileSource
from .calls import InTheWay

log = logging.getLogger(__name__)

# Local stores: a staged file this big is fsynced at once, by its upload worker
# (in parallel with others); a smaller one at publication, where a group of
# them shares one syncfs (`LocalBackend.publish_group`).
SYNCED_AT_PUBLISH = 1 << 20


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _OpenDirs:
    """Descriptors of the directories a run of calls goes to, opened once
    each when the calls come a directory at a time, and only the last few
    kept open: never one per directory of thousands (the daemon ran out of
    descriptors)."""

    KEEP = 16

    def __init__(self, opener: Callable[[str], int]) -> None:
        self._open = opener
        self._fds: collections.OrderedDict[str, int] = collections.OrderedDict()

    def get(self, head: str) -> int:
        """Valid until the next call."""
        fd = self._fds.get(head)
        if fd is not None:
            self._fds.move_to_end(head)
            return fd
        if len(self._fds) >= self.KEEP:
            os.close(self._fds.popitem(last=False)[1])
        fd = self._fds[head] = self._open(head)
        return fd

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])


class FileInTheWay(InTheWay, NotADirectoryError):
    """A file in the store where a path needs a directory: permanent for a
    publication (InTheWay), and, as any ENOTDIR, nothing there to read,
    find or delete."""


class SymlinkInStore(OSError):
    """A symlink where a local store should have a directory (ELOOP)."""


class LocalBackend(Backend):
    """A directory. Nothing in it is reached through a symlink: every path is
    walked from the root one component at a time with O_NOFOLLOW, and calls
    act on the last component relative to its parent's descriptor (a planted
    `store/d -> /elsewhere` cannot make a publish write outside the store,
    nor `store/x -> /etc/shadow` be read as a file). ckptfs keeps symlinks as
    manifest records, so a symlink in the store is never its own: it is not
    listed, and one in the way of a path is an error (ELOOP)."""

    dirs = True
    reads_in_place = True
    stage_ahead_from = 64 << 10

    def __init__(self, root: str, url: str) -> None:
        self.root = root
        self.url = url

    def prepare(self, daemon_id: str, started: float, sole: bool = True) -> None:
        super().prepare(daemon_id, started, sole)
        with self._at(f"{STAGING}/x") as (staging, _):
            for name in os.listdir(staging):  # emptied directories of dead daemons
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=staging)

    def _dir(self, path: str, create: bool = False) -> int:
        """A descriptor of directory `path`, reached without following a
        symlink, and never above the store's root; missing components are
        made if `create`."""
        _below_root(path)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        if path.strip("/"):
            below = _open_beneath(fd, path, _DIR)  # one call for the whole path, where the kernel can
            if below is not None:
                os.close(fd)
                return below
        try:
            # One component at a time: where openat2 is missing, to make what
            # is missing, and to tell why the path cannot be reached.
            for part in filter(None, path.split("/")):
                try:
                    try:
                        below = os.open(part, _DIR, dir_fd=fd)
                    except FileNotFoundError:
                        if not create:
                            raise
                        with contextlib.suppress(FileExistsError):  # 0700 until its record gives it the mount's mode (never more open)
                            os.mkdir(part, 0o700, dir_fd=fd)
                        below = os.open(part, _DIR, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise SymlinkInStore(errno.ELOOP, "a symlink in the store is in the way (ckptfs never follows one)", path) from None
                    if exc.errno == errno.ENOTDIR and not path.startswith(META + "/"):
                        raise FileInTheWay(errno.ENOTDIR, f"the store has a file at {part!r}, where the mount has a directory (made there by "
                                           "another tool?)", path) from None
                    raise
                os.close(fd)
                fd = below
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def _at(self, path: str, create: bool = False) -> Iterator[tuple[int, str]]:
        """(descriptor of the parent directory, last component) of `path`."""
        head, _, name = path.rpartition("/")
        _below_root(name)
        fd = self._dir(head, create)
        try:
            yield fd, name
        finally:
            os.close(fd)

    def stage(self, pieces: Iterable[memoryview | bytes], size: int, name: str | None = None, elsewhere: bool = False) -> Staged:
        return self.stage_many([(pieces, size)])[0]

    def stage_many(self, files: list[tuple[Iterable[memoryview | bytes], int]]) -> list[Staged]:
        """The staging directory is opened once for them all (reached from
        the store's root for each file, that was a tenth of a group commit's
        time)."""
        d = self._dir(self.staging, create=True)
        try:
            out = []
            for pieces, size in files:
                large = not 0 <= size < SYNCED_AT_PUBLISH
                out.append(Staged(size, self._write_staged(d, pieces, sync=large, direct=large)))
            return out
        finally:
            os.close(d)

    def _write_staged(self, d: int, pieces: Iterable[memoryview | bytes], sync: bool, direct: bool = False) -> str:
        """A new file in the staging directory (open as `d`); its token."""
        tmp = self._staging_name()
        _write_new(d, tmp.rpartition("/")[2], pieces, sync, direct)
        return tmp

    def publish(self, staged: Staged, path: str, pieces: Iterable[memoryview | bytes] = (), mode: int | None = None) -> None:
        if staged.token is None:  # a small file, written whole now and synced at once
            d = self._dir(self.staging, create=True)
            try:
                tmp = self._write_staged(d, pieces, sync=True)
            finally:
                os.close(d)
            self._replace(tmp, path, mode)
            return
        self._replace(staged.token, path, mode, sync_src=0 <= staged.size < SYNCED_AT_PUBLISH)

    def publish_group(self, records: list[tuple[str, bytes]], files: list[tuple[Staged, str, int | None, Iterable]]) -> None:
        """Group commit: the records and the small files are written, one
        syncfs makes them (and files staged without fsync) durable, every
        record and file is renamed into place, and a second syncfs makes the
        renames durable: two syncs for the group, not three fsyncs a file.
        Each directory is opened once for the group."""
        dirs: dict[str, int] = {}  # where files are written, then renamed from: open until the end
        dests = _OpenDirs(lambda head: self._dir(head, create=True))  # where they go: the last few open

        def at(path: str) -> tuple[int, str]:
            head, _, name = path.rpartition("/")
            if head not in dirs:
                dirs[head] = self._dir(head, create=True)
            return dirs[head], name

        def to(path: str) -> tuple[int, str]:
            head, _, name = path.rpartition("/")
            return dests.get(head), name

        written: list[tuple[int, str]] = []  # not renamed into place yet: removed if the group fails
        try:
            for _path, data in records:
                written.append(at(self._staging_name()))
                _write_new(*written[-1], [data], sync=False)
            sources = []
            for staged, _path, _mode, pieces in files:
                if staged.token is None:
                    written.append(at(self._staging_name()))
                    _write_new(*written[-1], pieces, sync=False)
                    sources.append(written[-1])
                else:
                    sources.append(at(staged.token))
            self.sync()
            moves = [(src, path, None) for src, (path, _data) in zip(written, records, strict=False)]  # records stay 0600
            moves += [(src, path, mode) for src, (_staged, path, mode, _pieces) in zip(sources, files, strict=True)]
            for (sd, sname), path, mode in moves:
                dd, dname = to(path)
                if mode is not None:
                    os.chmod(sname, _mode_in_store(mode, stat.S_IFREG), dir_fd=sd)
                try:
                    os.rename(sname, dname, src_dir_fd=sd, dst_dir_fd=dd)
                except IsADirectoryError:
                    _rmdir_in_the_way(dd, dname, path)
                    os.rename(sname, dname, src_dir_fd=sd, dst_dir_fd=dd)
            written = []
        finally:
            for d, name in written:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=d)
            for fd in dirs.values():
                os.close(fd)
            dests.close()
        self.sync()

    def sync(self) -> None:
        """Make everything written to the store's file system durable (syncfs(2))."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if _libc.syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), self.root)
        finally:
            os.close(fd)

    def _replace(self, src: str, dst: str, mode: int | None = None, sync: bool = True, sync_src: bool = False) -> None:
        """Rename `src` over `dst`; `sync`: made durable (the directory
        fsynced), `sync_src`: the file's bytes first (staged unsynced)."""
        with self._at(src) as (sd, sname), self._at(dst, create=True) as (dd, dname):
            if sync_src:
                fd = os.open(sname, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sd)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            if mode is not None:
                os.chmod(sname, _mode_in_store(mode, stat.S_IFREG), dir_fd=sd)
            if _kind(dname, dd) == stat.S_IFDIR:
                _rmdir_in_the_way(dd, dname, dst)
            os.rename(sname, dname, src_dir_fd=sd, dst_dir_fd=dd)
            if sync:
                os.fsync(dd)

    def put(self, path: str, data: bytes) -> None:
        self.publish(self.stage([data], len(data)), path, mode=0o600)  # ckptfs's own records: nobody else's business

    def read(self, path: str) -> Iterator[bytes]:
        with self._at(path) as (d, name):
            # O_NONBLOCK: a FIFO planted in the store must not block the open
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
        with open(fd, "rb", buffering=0):
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            yield from read_sparse(fd, st.st_size)  # holes stay holes on the way back

    def open_source(self, path: str) -> Source:
        with self._at(path) as (d, name):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
        except BaseException:
            os.close(fd)
            raise
        return _FileSource(fd, st.st_size)

    def read_many(self, paths: list[str]) -> Iterator[tuple[str, bytes]]:
        """Each directory is opened once, not once per file (a restart reads
        one record per file in the store), when `paths` come a directory at
        a time (sorted): the last few directories stay open, never all of
        them (thousands ran the daemon out of descriptors)."""
        heads = _OpenDirs(self._dir)
        try:
            for path in paths:
                head, _, name = path.rpartition("/")
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=heads.get(head))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                with open(fd, "rb", buffering=0) as f:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        raise OSError(errno.EINVAL, "not a regular file", path)
                    yield path, f.read()
        finally:
            heads.close()

    def stat_many(self, paths: list[str]) -> Iterator[tuple[str, os.stat_result]]:
        """As `read_many`, each directory opened once when `paths` come a
        directory at a time; a symlink is not followed (and is no entry of
        the store's)."""
        heads = _OpenDirs(self._dir)
        try:
            for path in paths:
                head, _, name = path.rpartition("/")
                try:
                    yield path, os.stat(name, dir_fd=heads.get(head), follow_symlinks=False)
                except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
                    continue
        finally:
            heads.close()

    def delete(self, path: str) -> None:
        # Under a symlink or a file nothing of ours can be: nothing to delete.
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, SymlinkInStore), self._at(path) as (d, name):
            os.unlink(name, dir_fd=d)

    def move(self, src: str, dst: str) -> None:
        self._replace(src, dst)

    def copy(self, src: str, dst: str) -> None:
        with self._at(src) as (d, name):
            mode = os.stat(name, dir_fd=d, follow_symlinks=False).st_mode
        self.publish(self.stage(self.read(src), -1), dst, mode=mode)

    def chmod(self, path: str, mode: int) -> None:
        with self._at(path) as (d, name):
            if (kind := _kind(name, d)) in (stat.S_IFREG, stat.S_IFDIR):  # never through a symlink
                os.chmod(name, _mode_in_store(mode, kind), dir_fd=d)

    def identity(self, path: str) -> object | None:
        try:
            with self._at(path) as (d, name):
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
            return None
        return st.st_dev, st.st_ino

    def exchange(self, a: str, b: str) -> None:
        """Files or directories, in one rename(2)."""
        with self._at(a) as (da, na), self._at(b) as (db, nb):
            _renameat2(da, na, db, nb, RENAME_EXCHANGE)
            os.fsync(da)
            os.fsync(db)

    def mkdir(self, path: str) -> None:
        os.close(self._dir(path, create=True))

    def rmdir(self, path: str) -> None:
        with contextlib.suppress(OSError), self._at(path) as (d, name):
            os.rmdir(name, dir_fd=d)

    def move_dir(self, src: str, dst: str) -> bool:
        with self._at(src) as (sd, sname), self._at(dst, create=True) as (dd, dname):
            try:
                os.rename(sname, dname, src_dir_fd=sd, dst_dir_fd=dd)  # replaces an empty directory
            except OSError as exc:
                if exc.errno == errno.ENOENT and _kind(dname, dd) == stat.S_IFDIR:
                    return True  # moved already (an earlier attempt whose answer was lost)
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOENT):
                    return False  # something is in the way, or nothing to move: the caller moves members
                raise
            os.fsync(dd)
            os.fsync(sd)
        return True

    def unit_dir(self) -> str:
        path = f"{self.staging}/d-{uuid.uuid4().hex}"
        os.close(self._dir(path, create=True))
        return path

    def walk(self, prefix: str = "") -> Iterator[Entry]:
        """Directories and regular files under `prefix` (ckptfs's own `.ckptfs/`
        left out); symlinks and special files are not the store's."""
        try:
            with self._at(prefix) as (d, name):
                kind = _kind(name, d) if prefix else stat.S_IFDIR
                if kind == stat.S_IFREG:  # a single file
                    yield Entry(prefix, os.stat(name, dir_fd=d, follow_symlinks=False).st_size, False)
                    return
        except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
            return
        if kind != stat.S_IFDIR:
            return
        yield from self._tree(prefix, skip_meta=True)

    def _tree(self, prefix: str, skip_meta: bool, dirs: bool = True) -> Iterator[Entry]:
        """Top down, depth first (`listing.tree`): each directory, then its
        files, then its directories the same way."""
        rel = prefix.strip("/")
        if skip_meta and (rel == META or rel.startswith(META + "/")):
            return
        try:
            top = self._dir(rel)
        except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
            return
        for path, size, is_dir in listing.tree(rel, top, META if skip_meta and not rel else "", dirs, _left_out):
            yield Entry(path, size, is_dir)

    @contextlib.contextmanager
    def walking(self, many: bool = False) -> Iterator[Callable[[], list[Entry]]]:
        if not many:
            with super().walking() as listed:
                yield listed
            return
        try:
            top = self._dir("")
        except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
            yield lambda: []
            return
        aside = listing.Aside("", top, META)  # on a core of its own (see `listing`)
        try:
            yield lambda: list(map(Entry._make, aside.result(_left_out)))
        finally:
            aside.close()

    def find(self, prefix: str) -> list[str]:
        return [e.path for e in self._tree(prefix, skip_meta=False, dirs=False)]

    def stamped(self, prefix: str) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        try:
            top = self._dir(prefix)
        except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
            return out
        try:
            for rel, _, filenames, fd in os.fwalk(".", dir_fd=top):  # never follows symlinks
                rel = os.path.normpath(os.path.join(prefix, rel))
                rel = "" if rel == "." else rel
                for n in filenames:
                    with contextlib.suppress(FileNotFoundError):
                        st = os.stat(n, dir_fd=fd, follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode):
                            out[f"{rel}/{n}" if rel else n] = st.st_ctime_ns / 1e9
        finally:
            os.close(top)
        return out

    def stamp(self, path: str) -> float | None:
        with self._at(path) as (d, name):
            return os.stat(name, dir_fd=d, follow_symlinks=False).st_ctime_ns / 1e9

    def exists(self, path: str) -> bool:
        try:
            with self._at(path) as (d, name):
                return _kind(name, d) is not None
        except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
            return False


def _mode_in_store(mode: int, kind: int) -> int:
    """The permission bits a store file (`kind` S_IFREG) or directory
    (S_IFDIR) takes for its mount counterpart's `mode`: never more open to
    anyone else, never a set-ID bit, and always open to its owner, the
    daemon's user, as far as the daemon needs: a file readable, a directory
    readable, writable and searchable. (Taken as is, a write-only file made
    a daemon not run as root fail to load it after a restart, and an
    append to it failed, EACCES, where the mount allows it; the mount's own
    mode is in the file's record.)"""
    if kind == stat.S_IFDIR:
        return (mode & 0o1777) | 0o700
    return (mode & 0o777) | 0o400


def _write_new(dir_fd: int, name: str, pieces: Iterable[memoryview | bytes], sync: bool, direct: bool = False) -> None:
    """A new file `name` (0600: a published file takes its mount
    counterpart's mode then, never more open) holding `pieces`; holes are
    kept (the store file stays sparse).

    `direct`: pieces aligned to pages (whole chunks of a snapshot) are
    written with O_DIRECT, straight from the daemon's memory to the disk. A
    buffered write of 2 GiB costs this VM 1-3 s of CPU copying into the page
    cache, a direct one 0.1 s, and the store's bytes need not fill the page
    cache of the machine that trains. From the first piece that is not
    aligned on (or on a file system that refuses O_DIRECT: tmpfs), writes
    are buffered."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    try:
        direct = direct and _set_direct(fd, True)
        off = end = 0  # end: where the bytes written so far end (a new file: its size)
        for piece in pieces:
            if is_hole(piece):
                off += len(piece)
                continue
            view = memoryview(piece).cast("B")
            if direct and not (off % _PAGE == 0 and len(view) % _PAGE == 0 and _address(view) % _PAGE == 0):
                direct = _set_direct(fd, False)
            while view:
                try:
                    n = os.pwrite(fd, view, off)
                except OSError as exc:
                    if not direct or exc.errno != errno.EINVAL:
                        raise
                    direct = _set_direct(fd, False)  # alignment the device wants is larger: buffered from here
                    continue
                view, off = view[n:], off + n
            end = off
        if off > end:  # it ends in a hole
            os.ftruncate(fd, off)
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise
    os.close(fd)


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; whether it is on now."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return on


def _address(view: memoryview) -> int:
    """Where `view`'s bytes are in memory (-1: unknown, read-only)."""
    if view.readonly:
        return -1
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _left_out(path: str, why: str) -> None:
    log.warning("left out of the store's listing: %s: %s", path, why)


def _kind(name: str, dir_fd: int) -> int | None:
    """The file type of `name` in `dir_fd` (S_IFREG, S_IFDIR, S_IFLNK, ...), not following a symlink; None if missing."""
    try:
        return stat.S_IFMT(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return None


RENAME_EXCHANGE = 2


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_SYS_OPENAT2 = 437  # the same number on every architecture (Linux 5.6)
# No symlink, no magic link, no ".." above the root, no other mount.
_RESOLVE = 0x01 | 0x02 | 0x04 | 0x08  # RESOLVE_NO_XDEV | NO_MAGICLINKS | NO_SYMLINKS | BENEATH
_openat2_works = True


def _below_root(path: str) -> None:
    """EINVAL for a path with a `.` or `..` component: every path the
    daemon and the tools give a store is relative to its root and clean; one
    that is not must never reach above the root (openat2's RESOLVE_BENEATH
    refuses it, the walk by components would not)."""
    if "." in path and any(part in (".", "..") for part in path.split("/")):
        raise OSError(errno.EINVAL, "a store path with '.' or '..' in it", path)


def _open_beneath(dir_fd: int, path: str, flags: int) -> int | None:
    """openat2(2) of `path` below `dir_fd`, following no symlink: a
    descriptor, or None if it failed for any reason (or the kernel has no
    openat2), for the caller's component-by-component walk to redo it."""
    global _openat2_works
    if not _openat2_works:
        return None
    how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE)
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd >= 0:
        return fd
    if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # an old kernel, or a seccomp filter
        _openat2_works = False
    return None


def _rmdir_in_the_way(dir_fd: int, name: str, path: str) -> None:
    """A directory where a file goes: an empty one left by the mount goes;
    one holding what another tool made there stays, and the file cannot."""
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise InTheWay(exc.errno, "the store has a directory here, not empty, where the mount has a file (made there by another tool?)",
                           path) from None
        raise


def _renameat2(dir_a: int, a: str, dir_b: int, b: str, flags: int) -> None:
    if _libc.renameat2(dir_a, os.fsencode(a), dir_b, os.fsencode(b), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), a)
