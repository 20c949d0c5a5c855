"""The namespace at one position of the cluster log, in one Redis key.

Without it the log would grow for as long as the cluster runs, and a node
joining late would replay all of it. The publishing node takes a snapshot
of its replica every `EVERY` entries, at a moment when every entry up to
its position has had its turn at the store (nothing of its journal waits:
so the snapshot's files are published, except those the publishing node
holds or parked, which it lists apart: `Events.held`). The log is then
trimmed to the snapshot, but never past where a node that still beats has
applied it. A node joining late loads the snapshot, then replays the
entries after it.

What a snapshot holds of each inode with a name: its number (every replica
numbers alike), kind and mode, owner, times, symlink target, extended
attributes, links, and for a regular file the generation, size and mtime of
its last seal in the log, or of its restore from the store (not what a
writer on the snapshotting node has made of it since: that is this node's
until its seal has a place in the log). Inodes alive only
for an open handle or the kernel's reference, and file contents, are local
to each node and not in it.
"""

from __future__ import annotations

import json
import stat
import sys
import zlib
from collections.abc import Iterable

from ckptfs.fs.filedata import FileData
from ckptfs.fs.tree import ROOT, Inode, InodeTree

EVERY = 10_000  # log entries between snapshots
TRIM_GRACE_S = 300.0  # a node silent longer no longer holds back trimming (it cannot rejoin the log where it was)

Sealed = dict[int, tuple[int, int, int]]  # inode -> (generation, size, mtime_ns) of its last seal in the log


_ENC, _ERR = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()  # os.fsdecode / os.fsencode, without a call each


def rows(inodes: Iterable[Inode], sealed: Sealed) -> list[tuple]:
    """The rows of a snapshot for `inodes` of a replica at one log position
    (JSON-able; plain tuples, as this is most of what taking one costs)."""
    out: list[tuple] = []
    append = out.append
    for inode in inodes:
        links = inode.links
        if not links and inode.ino != ROOT:
            continue
        if inode.data is not None:  # as the log has it: a seal made here and not in the log yet is not
            generation, size, mtime_ns = sealed.get(inode.ino) or (0, 0, inode.mtime_ns)
        else:
            generation, size, mtime_ns = inode.generation, 0, inode.mtime_ns
        append((inode.ino, inode.mode, inode.uid, inode.gid, inode.rdev, inode.atime_ns, mtime_ns, inode.ctime_ns,
                generation, size, inode.target.decode(_ENC, _ERR) if inode.target else "",
                {k.decode(_ENC, _ERR): v.decode(_ENC, _ERR) for k, v in inode.xattrs.items()} if inode.xattrs else None,
                [(parent, name.decode(_ENC, _ERR)) for parent, name in links]))
    return out


def load(tree: InodeTree, state: dict) -> Sealed:
    """Make `tree` (empty) the snapshot's namespace. Files sealed in the log
    come evicted (they load from the store); what they were sealed as."""
    inodes, sealed = [], {}
    pool = tree.pool
    for ino, mode, uid, gid, rdev, atime_ns, mtime_ns, ctime_ns, generation, size, target, xattrs, links in state["inodes"]:
        inode = Inode(ino, mode, uid, gid, rdev=rdev, atime_ns=atime_ns, mtime_ns=mtime_ns, ctime_ns=ctime_ns)
        inode.links = {(parent, name.encode(_ENC, _ERR)) for parent, name in links}
        if target:
            inode.target = target.encode(_ENC, _ERR)
        if xattrs:
            inode.xattrs = {k.encode(_ENC, _ERR): v.encode(_ENC, _ERR) for k, v in xattrs.items()}
        inode.generation = generation
        if stat.S_ISREG(mode):
            inode.data = data = FileData(pool)
            if generation:  # sealed (else never sealed: empty and resident, as its mknod left it)
                data.size = size
                data.resident = False
                inode.sealed_version = inode.version
                sealed[ino] = (generation, size, mtime_ns)
        inodes.append(inode)
    tree.load(inodes, state["next_ino"])
    return sealed


def encode(position: int, state: dict) -> bytes:
    return zlib.compress(json.dumps({"position": position, **state}, separators=(",", ":")).encode(), 1)


def decode(blob: bytes) -> tuple[int, dict]:
    state = json.loads(zlib.decompress(blob))
    return state.pop("position"), state
