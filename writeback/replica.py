"""The replica: the store's namespace as the publisher has replayed it.

The publisher applies the journal strictly in order. The replica is the
namespace the mount had at the journal position the publisher has reached,
each name bound to the inode the mount bound it to then. For every file name
it also knows what the store *shows* there (`Shown`: which inode, generation
and digest, or nothing), and whether a sealed, staged generation is *held*
there: its turn came while that name no longer existed in the live mount, so
it is not made visible under it (C4); it becomes visible when a later rename
or link gives it a name the live mount still has, or is dropped when its file
is deleted.

Nodes are objects with parent links, so a removal that has to wait (see
`Engine`, "removals wait") still finds its node after renames of its parents.
Pure data, no I/O: the engine decides, the backend acts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .manifest import Meta

if TYPE_CHECKING:
    from .journal import FileGen
    from .manifest import Digest


@dataclass
class Shown:
    """What the store holds at a path: one published generation of a file."""

    ino: int
    generation: int
    digest: Digest | None  # None: found in the store with no record
    meta: Meta = field(default_factory=Meta)


@dataclass(eq=False)
class Node:
    ino: int
    name: str = ""
    parent: Dir | None = None


@dataclass(eq=False)
class Dir(Node):
    children: dict[str, Node] = field(default_factory=dict)
    made: bool = False  # exists in the store as a directory (local stores)
    recorded: Meta | None = None  # what its record in the store says (None: no record yet)
    # Its path may hold a record it does not know of: a write of its record
    # failed and may have landed all the same (a store call that timed out,
    # or was cut short), or it took the path of a directory with one (a
    # rename over an empty directory). Its removal or move deletes that
    # path's record all the same.
    unsure: bool = False

    @property
    def may_be_recorded(self) -> bool:
        return self.recorded is not None or self.unsure


@dataclass(eq=False)
class File(Node):
    shown: Shown | None = None
    held: FileGen | None = None

    @property
    def shows_own(self) -> bool:
        """The store shows this inode's bytes here (not those of the file
        this name replaced, kept until this one's are published)."""
        return self.shown is not None and self.shown.ino == self.ino


@dataclass(eq=False)
class Link(Node):
    target: str = ""
    shown: bool = False
    meta: Meta = field(default_factory=Meta)


class Replica:
    def __init__(self) -> None:
        self.root = Dir(ino=1, made=True)
        self._by_ino: dict[int, set[Node]] = {}

    def nodes_of(self, ino: int) -> list[tuple[str, Node]]:
        """The attached nodes bound to `ino`, with their paths, by path. (A
        node leaves the index when it is detached; one under a directory
        detached with it leaves it here, once asked for.)"""
        out = []
        for node in list(self._by_ino.get(ino, ())):
            path = self.path_of(node)
            if path is None:
                self._unindex(node)
            else:
                out.append((path, node))
        return sorted(out, key=lambda pn: pn[0])

    def rebind_ino(self, node: Node, ino: int) -> None:
        """The mount now binds `node`'s name to another inode."""
        self._unindex(node)
        node.ino = ino
        self._by_ino.setdefault(ino, set()).add(node)

    def _unindex(self, node: Node) -> None:
        nodes = self._by_ino.get(node.ino)
        if nodes is not None:
            nodes.discard(node)
            if not nodes:
                del self._by_ino[node.ino]

    def lookup(self, path: str) -> Node | None:
        node: Node = self.root
        for part in path.split("/") if path else []:
            if not isinstance(node, Dir) or (node := node.children.get(part)) is None:  # type: ignore[assignment]
                return None
        return node

    def path_of(self, node: Node) -> str | None:
        """The node's path now, or None once it is detached."""
        parts = []
        while node is not self.root:
            if node.parent is None or node.parent.children.get(node.name) is not node:
                return None
            parts.append(node.name)
            node = node.parent
        return "/".join(reversed(parts))

    def attached(self, node: Node) -> bool:
        return self.path_of(node) is not None

    def parent_dir(self, path: str) -> Dir:
        """The directory that holds `path`, created (not made) if missing."""
        return self.directory(path.rpartition("/")[0])

    def directory(self, path: str) -> Dir:
        """The directory at `path` ("": the root), created (not made) if missing."""
        d = self.root
        for part in path.split("/") if path else []:
            child = d.children.get(part)
            if not isinstance(child, Dir):
                child = Dir(ino=0, name=part, parent=d)
                d.children[part] = child
            d = child
        return d

    def bind(self, path: str, node: Node) -> Node | None:
        """Put `node` at `path` (moving it from where it was); returns the
        node it replaced, detached."""
        self.detach(node)
        return self.bind_in(self.parent_dir(path), path.rpartition("/")[2], node)

    def bind_in(self, d: Dir, name: str, node: Node) -> Node | None:
        """`bind` of a node that is not attached, by its directory and name."""
        old = d.children.get(name)
        if old is not None:
            old.parent = None
            self._unindex(old)
        node.name, node.parent = name, d
        d.children[name] = node
        if node.ino:
            self._by_ino.setdefault(node.ino, set()).add(node)
        return old

    def merge_moved(self, moving: Dir, there: Dir) -> None:
        """Directory `moving` goes where `there` is: in the mount `there` was
        empty (a directory a rename replaces must be), so what it holds in the
        store a move of `moving` put there, left halfway by a publisher that
        died (member by member on an object store). It joins `moving`, where
        `moving` does not have it (a member both have was copied and not yet
        deleted: the move goes on from `moving`'s). `there`'s record, at the
        path `moving` takes, is `moving`'s to replace or delete."""
        moving.unsure = moving.unsure or (moving.recorded is None and there.may_be_recorded)
        for name, node in list(there.children.items()):
            mine = moving.children.get(name)
            if mine is None:
                self.detach(node)
                self.bind_in(moving, name, node)
            elif isinstance(mine, Dir) and isinstance(node, Dir):
                self.merge_moved(mine, node)

    def detach(self, node: Node) -> None:
        """Take `node` out of the tree (`bind` puts it back, a move), and out
        of the index by inode: what the store no longer shows is not kept
        for every file a long mount ever published."""
        if node.parent is not None and node.parent.children.get(node.name) is node:
            del node.parent.children[node.name]
        node.parent = None
        self._unindex(node)

    def walk(self, node: Node, prefix: str = "") -> Iterator[tuple[str, Node]]:
        """Every node under `node` (itself excluded), with its path relative
        to it: each directory's entries, each followed by what is under it.
        A loop, not a recursion: a tree may be deeper than Python's recursion limit."""
        if not isinstance(node, Dir):
            return
        below = [(prefix, iter(list(node.children.items())))]
        while below:
            base, entries = below[-1]
            for name, child in entries:
                rel = f"{base}/{name}" if base else name
                yield rel, child
                if isinstance(child, Dir):
                    below.append((rel, iter(list(child.children.items()))))
                break
            else:
                below.pop()

