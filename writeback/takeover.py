"""How a node that followed the cluster's publishing node becomes it.

The publishing node's `Publisher` keeps the store's namespace as a replica,
at the journal position it reached; when that node dies, its replica dies
with it. Every node holds the same journal, so the node that takes over
rebuilds the replica from two things it has:

- the store, scanned: what the old publisher left there, every op up to the
  last position `P` it reported applied but the removals it reported held
  back (and maybe a few ops after it, which are applied again: harmless,
  see `unreported`; or up to an exchange's position, which it cannot
  apply again); each of those removals is held back again where the ops
  after it moved what it removes, and so is one after the report that the
  store shows was not applied;
- the journal after `P`, still in this node's queue: each name the scan
  finds is followed through its namespace changes to the name it has in the
  live mount now, and bound to the inode found there (`bind_to_live`);
- generations sealed at or before `P` and not published were *held* by the
  old publisher (renamed or deleted before their turn, a completion marker
  waiting, a parked file). They are held again at the names they had at
  `P`: their names now, followed back through the same changes (`names_then`),
  and take their turn again before everything after `P`.

Pure data, no I/O (the engine scans the store and swaps publishers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from . import journal
from .journal import Exchange, Op, Remove, Rename
from .manifest import Digest, Meta
from .replica import Dir, File, Link, Node, Replica, Shown

if TYPE_CHECKING:
    from .publisher import Publisher
    from .storeio import Scanned


def _twin(paths: Iterable[tuple[str, object]], dirs: bool = False) -> tuple[Replica, dict[Node, object]]:
    """A throwaway replica of stand-ins for `paths` (parents before their
    children), each mapped to what it stands for: a directory's stand-in is
    a directory (`dirs`: every one is), so that binding what is under it
    keeps it rather than putting a new directory in its place."""
    twin = Replica()
    of: dict[Node, object] = {}
    for path, what in paths:
        stand_in = Dir(ino=0) if dirs or isinstance(what, Dir) else Node(ino=0)
        twin.bind(path, stand_in)
        of[stand_in] = what
    return twin, of


def _swap(twin: Replica, a: str, b: str) -> None:
    na, nb = twin.lookup(a), twin.lookup(b)
    for n in (na, nb):
        if n is not None:
            twin.detach(n)
    if na is not None:
        twin.bind(b, na)
    if nb is not None:
        twin.bind(a, nb)


def _replay(twin: Replica, ops: list[Op], backward: bool = False, removed: dict[Node, int] | None = None) -> None:
    """Move `twin`'s stand-ins as `ops` moved names (`backward`: undo them,
    last first). Forward, a removal or a rename over a name takes it away
    (`removed`: the stand-in it took, with the inode it removed or
    replaced, where the kinds agree); backward, a name a hard link, a
    mkdir or a symlink made had not existed."""
    for op in reversed(ops) if backward else ops:
        if isinstance(op, Rename):
            src, dst = (op.dst, op.src) if backward else (op.src, op.dst)
            moving = twin.lookup(src)
            if moving is not None:
                there = twin.lookup(dst)
                if not backward and isinstance(moving, Dir) and isinstance(there, Dir) and there is not moving:
                    twin.merge_moved(moving, there)  # a move the gone publisher left halfway
                elif removed is not None and there is not None and there is not moving and isinstance(there, Dir) == op.is_dir:
                    removed[there] = op.replaced
                twin.bind(dst, moving)
        elif isinstance(op, Exchange):
            _swap(twin, op.a, op.b)
        elif (isinstance(op, Remove) and not backward) or (isinstance(op, journal.Link | journal.Mkdir | journal.Symlink) and backward):
            gone = twin.lookup(op.name)
            if gone is not None and not (backward and isinstance(gone, Dir) != isinstance(op, journal.Mkdir)):
                twin.detach(gone)
                if removed is not None and isinstance(gone, Dir) == op.is_dir:
                    removed[gone] = op.ino


def replicate(publisher: Publisher, scanned: Scanned, ops: list[Op], inode_at: Callable[[str], int | None],
              published: Callable[[int], tuple[int, Digest | None]], directories: list[tuple[str, int]],
              applied: list[Op] = (), waiting: list[Remove] = (), unsure: list[Remove] = (),
              symlinks: list[tuple[str, int, str, Meta]] = ()) -> None:
    """Give `publisher` a replica of what the store shows (`scanned`), each
    name bound to its live inode (`bind_to_live`). Every directory is
    dirty: its record is compared with the mount at the next idle moment.

    `applied`: the ops before `ops` that the gone node applied since the
    position it reported last, but the removals it held back (`waiting`):
    what each of those removes is where the ops after it moved it in the
    store, and waits there again (the publisher's `deferred`), bound to the
    removed inode. `unsure`: removals among `applied` that it had its turn
    at after its last report (an exchange's plan showed it got further),
    applied or held back: each waits again only where the store still shows
    what it removes (`_still_shown`). No later op of that span took its name
    again: that op would have applied the removal first, and waited for a
    report before changing the name (`unreported`).

    `directories`: the live mount's (path, inode), parents first. Those it
    had at `P` (followed back through `ops`) that the store does not show
    join the replica too: the old publisher made them, and writes a
    directory's record only once its queue is quiet, so on an object store
    (where an empty directory is its record alone) it may have gone first,
    and they were recorded by nobody.

    `symlinks`: the live mount's (path, inode, target, meta), one per name.
    Those it had at `P` (followed back through `ops`) where the store shows
    nothing join the replica unshown, as the old publisher's replica had
    them: one whose turn found it gone from its name already was bound
    there and not recorded, for the queued op that moved it (a rename of it
    or of its directory, an exchange) to record it at its new name. Not
    known, the move had nothing to record, and the store never showed it."""
    for e in scanned.entries:
        rec = scanned.records.get(e.path)
        if e.is_dir:
            publisher.restored(e.path, Dir(0))
        elif rec is not None and rec.kind == "file":
            publisher.restored(e.path, File(0, shown=Shown(0, 0, rec.current, rec.meta)))
        else:
            publisher.restored(e.path, File(0, shown=Shown(0, 0, None, Meta())))
    for rec in scanned.records.values():
        if rec.kind == "symlink":
            publisher.restored(rec.path, Link(0, target=rec.target, shown=True, meta=rec.meta))
        elif rec.kind == "dir":
            d = publisher.replica.lookup(rec.path)
            if not isinstance(d, Dir):
                d = Dir(0)
                publisher.restored(rec.path, d)
            d.recorded = rec.meta
    then = names_then({ino: [path] for path, ino in directories}, ops, dirs=True)
    for path in sorted((p for paths in then.values() for p in paths), key=lambda p: p.count("/")):
        if publisher.replica.lookup(path) is None:
            publisher.replica.bind(path, Dir(0))  # recorded at the next sync (not made: on a local store the scan would have found it)
    by_ino: dict[int, list[str]] = {}
    for path, ino, _target, _meta in symlinks:
        by_ino.setdefault(ino, []).append(path)
    then = names_then(by_ino, ops)
    for _path, ino, target, meta in symlinks:
        for path in then.pop(ino, []):
            if publisher.replica.lookup(path) is None:
                publisher.replica.bind(path, Link(0, target=target, shown=False, meta=meta))
    held_back = {}
    for op, path in _forward(applied, [*waiting, *unsure]).items():
        node = publisher.replica.lookup(path) if path is not None else None
        if node is not None and node is not publisher.replica.root and (op not in unsure or _still_shown(node, op, published)):
            held_back[node] = op
    bind_to_live(publisher.replica, ops, inode_at, published, skip=held_back.keys())
    for node, op in sorted(held_back.items(), key=lambda held: held[1].seq):  # held back in journal order
        _bind(publisher.replica, node, op.ino, published)
        publisher.hold_back(node, op)
    publisher.dirty = {n for _, n in publisher.replica.walk(publisher.replica.root) if isinstance(n, Dir)} | {publisher.replica.root}


def _still_shown(node: Node, op: Remove, published: Callable[[int], tuple[int, Digest | None]]) -> bool:
    """Whether `node` (where the store has what `op` removes, if it was not
    applied) is what it removes: a directory for a directory; a symlink; a
    file showing a published generation of the removed inode (its bytes, if
    their digest was heard)."""
    if op.is_dir or isinstance(node, Dir):
        return op.is_dir and isinstance(node, Dir)
    if isinstance(node, Link):
        return True
    generation, digest = published(op.ino)
    return isinstance(node, File) and node.shown is not None and generation > 0 and digest in (None, node.shown.digest)


def bind_to_live(replica: Replica, ops: list[Op], inode_at: Callable[[str], int | None],
                 published: Callable[[int], tuple[int, Digest | None]], skip: Iterable[Node] = ()) -> None:
    """Bind every name of `replica` (the store as scanned, inodes unknown)
    but those of `skip` to the inode the live mount has there after `ops`;
    a name one of `ops` removes (or renames another over), to the inode it
    removed: the file may live on under a hard link made before, which its
    turn copies from that name (`Publisher._shown_source`); bound to none,
    the name was taken for another file's, and the link showed nothing.
    Names under a directory `ops` remove stay bound to no inode (0)."""
    skip = set(skip)
    twin, of = _twin(list(replica.walk(replica.root)))
    removed: dict[Node, int] = {}
    _replay(twin, ops, removed=removed)
    found = [(stand_in, inode_at(path) or 0) for path, stand_in in twin.walk(twin.root)]
    for stand_in, ino in [*found, *removed.items()]:
        node = of.get(stand_in)
        if isinstance(node, Node) and node not in skip:
            _bind(replica, node, ino, published)


def _bind(replica: Replica, node: Node, ino: int, published: Callable[[int], tuple[int, Digest | None]]) -> None:
    """Bind `node` to `ino`. A file's name shows the generation last
    `published` (with its digest, if heard), unless its record names other
    bytes: older ones, at a name the gone node died before showing that
    generation at (a hard link's), which must not be read or copied as that
    generation (generation 0: some older one)."""
    replica.rebind_ino(node, ino)
    if isinstance(node, File) and node.shown is not None:
        generation, digest = published(ino)
        if digest is not None and node.shown.digest != digest:
            generation = 0
        node.shown = Shown(ino, generation, node.shown.digest, node.shown.meta)


def _forward(applied: list[Op], waiting: list[Remove]) -> dict[Remove, str | None]:
    """Where what each removal of `waiting` removes is in the store after
    `applied` (None: gone, or replaced): its name, followed through the ops
    after it (one pass over them: there may be many)."""
    twin = Replica()
    stand_ins: dict[Remove, Node] = {}
    held = set(waiting)
    for op in applied:
        if op not in held:
            _replay(twin, [op])
            continue
        there = twin.lookup(op.name)
        if op.is_dir and isinstance(there, Dir):
            stand_ins[op] = there  # the directory of removals held back before it
        else:
            stand_ins[op] = Dir(ino=0) if op.is_dir else Node(ino=0)
            twin.bind(op.name, stand_ins[op])
    return {op: twin.path_of(node) for op, node in stand_ins.items()}


def names_then(now: Mapping[object, list[str]], ops: list[Op], dirs: bool = False) -> dict[object, list[str]]:
    """The names each key's paths in the live mount (`now`) had before
    `ops` happened: the paths followed back through them. A name that one
    of them made (a hard link) had no earlier name and is left out.
    `dirs`: the keys are directories (parents first)."""
    twin, of = _twin([(path, key) for key, paths in now.items() for path in paths], dirs)
    _replay(twin, ops, backward=True)
    then: dict[object, list[str]] = {key: [] for key in now}
    for path, stand_in in twin.walk(twin.root):
        if stand_in in of:
            then[of[stand_in]].append(path)
    return then
