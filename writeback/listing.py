"""The walk of a local store's directory tree, never following a symlink.

It runs in the daemon (`LocalBackend.walk`), or, for the whole listing of a
big store at a restart, in a process of its own (`Aside`; this file is its
program, and imports nothing but the standard library). A restart lists the
store while it decodes the store's records: in a thread, the walk gives up
the GIL at each of its stat calls and waits to win it back from the
decoding, and the two took longer side by side than one after the other
(100,000 files: 1.4-1.8 s, against 0.4-0.6 s for the walk alone and about
as much for the decoding). In a process of its own the walk runs on another
core, and hands over its result in one piece (marshal).
"""

from __future__ import annotations

import errno
import marshal
import os
import stat
import sys
from collections.abc import Callable, Iterator

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Found = tuple[str, int, bool]  # a path, its size (0 for a directory), whether it is a directory
Warn = Callable[[str, str], None]  # a path left out of the listing, and why


def tree(rel: str, top: int, skip: str, dirs: bool, warn: Warn) -> Iterator[Found]:
    """Top down, depth first, below directory `top` (at `rel`; closed when
    done): each directory, then its files in listing order (`listed`), then
    its directories the same way; `skip` (a name at the top) left out, and
    directories too unless `dirs`. A directory that cannot be opened is left
    out, with `warn`. Descriptors held: one per level of depth (each
    directory's, while its subdirectories are walked), never one per
    subdirectory: a directory of thousands of them ran the daemon out of
    descriptors, and the mount failed."""
    stack = [(rel, top, iter(()))]  # a directory, its descriptor, its subdirectories not yet walked (closed below)
    try:
        found, below = listed(rel, top, skip, warn)
        stack[-1] = (rel, top, iter(below))
        yield from found
        while stack:
            parent, fd, rest = stack[-1]
            name = next(rest, None)
            if name is None:
                os.close(stack.pop()[1])
                continue
            path = f"{parent}/{name}" if parent else name
            try:
                sub = os.open(name, DIR_FLAGS, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError):
                continue  # gone, or another kind now, since it was listed
            except PermissionError as exc:
                warn(path, f"cannot list it ({exc.strerror}): what it holds is not shown")
                continue
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                continue  # a directory replaced by a symlink since it was listed: never followed
            stack.append((path, sub, iter(())))
            found, below = listed(path, sub, "", warn)
            stack[-1] = (path, sub, iter(below))
            if dirs:
                yield path, 0, True
            yield from found
    finally:
        for _, fd, _ in stack:
            os.close(fd)


def listed(rel: str, fd: int, skip: str, warn: Warn) -> tuple[list[Found], list[str]]:
    """The regular files in directory `fd` (at `rel`), and the names of its
    directories but `skip`: `os.scandir` gives each name's type, so only
    regular files are stat'ed (for their sizes). Symlinks are left out
    (ckptfs keeps its own as records, and follows none), and so are fifos,
    sockets and device nodes, with `warn`: another tool put them there."""
    found: list[Found] = []
    below: list[str] = []
    with os.scandir(fd) as listing:
        for e in listing:
            try:
                if e.is_dir(follow_symlinks=False):
                    if e.name != skip:
                        below.append(e.name)
                elif e.is_file(follow_symlinks=False) and stat.S_ISREG((st := os.stat(e.name, dir_fd=fd, follow_symlinks=False)).st_mode):
                    found.append((f"{rel}/{e.name}" if rel else e.name, st.st_size, False))
                elif not e.is_symlink():
                    warn(f"{rel}/{e.name}" if rel else e.name, "not a file, a directory or a symlink (a fifo, a socket or a device "
                         "node another tool made?): not shown, never read")
            except (FileNotFoundError, NotADirectoryError):
                pass  # gone, or another kind now, since it was listed
            except PermissionError as exc:
                warn(f"{rel}/{e.name}" if rel else e.name, f"cannot stat it ({exc.strerror}): not shown")
    return found, below



class Aside:
    """`tree` of a whole directory in a process of its own, started now:
    `result` waits for it. Takes over descriptor `top`."""

    def __init__(self, rel: str, top: int, skip: str) -> None:
        import subprocess  # here: the walk's own process need not import it

        try:
            self._proc = subprocess.Popen([sys.executable, "-I", "-S", __file__, str(top), rel, skip], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, pass_fds=(top,))
        finally:
            os.close(top)

    def result(self, warn: Warn) -> list[Found]:
        """What the walk found; OSError if it failed (as the walk in the
        daemon would have raised), or if the process did not finish."""
        out = self._proc.communicate()[0]
        if self._proc.returncode != 0:
            raise OSError(errno.EIO, f"the store's listing ended with status {self._proc.returncode}")  # EIO: tried again, as a store failing
        found, warnings, failed = marshal.loads(out)
        for path, why in warnings:
            warn(path, why)
        if failed is not None:
            raise OSError(*failed)
        return found

    def close(self) -> None:
        """Stop it, if it still runs (the restart failed meanwhile)."""
        if self._proc.returncode is None:
            self._proc.kill()
            self._proc.communicate()


def _main(top: str, rel: str, skip: str) -> None:
    warnings: list[tuple[str, str]] = []
    found: list[Found] = []
    failed = None
    try:
        found = list(tree(rel, int(top), skip, True, lambda path, why: warnings.append((path, why))))
    except OSError as exc:
        failed = (exc.errno, exc.strerror, exc.filename)
    sys.stdout.buffer.write(marshal.dumps((found, warnings, failed)))


if __name__ == "__main__":
    _main(*sys.argv[1:])
