"""How a node taking over publishing maps the store's names to live inodes
(`takeover.bind_to_live`) and live names back to the old publisher's position
(`takeover.names_then`), through the namespace changes still queued."""

from __future__ import annotations

from ckptfs.writeback import storeio, takeover
from ckptfs.writeback.journal import Exchange, Link, Mkdir, Remove, Rename
from ckptfs.writeback.manifest import Digest
from ckptfs.writeback.publisher import Publisher
from ckptfs.writeback.replica import Dir, File, Replica, Shown

from tests.unit.test_engine import Rig


def _store(*paths: str) -> Replica:
    replica = Replica()
    for path in paths:
        if path.endswith("/"):
            replica.bind(path.rstrip("/"), Dir(0))
        else:
            replica.bind(path, File(0, shown=Shown(0, 0, None)))
    return replica


def test_store_names_are_bound_to_the_inodes_found_where_the_queued_changes_moved_them():
    replica = _store("tmp/", "tmp/shard", "old", "gone", "a", "b", "moved", "over")
    ops = [Rename(1, "tmp", "step", 0, True), Remove(2, "gone", 15, False), Exchange(3, "a", "b"),
           Rename(4, "old", "new", 0, False), Rename(5, "moved", "over", 18, False, replaced=17)]
    live = {"step": 10, "step/shard": 11, "new": 12, "a": 13, "b": 14, "over": 18}
    takeover.bind_to_live(replica, ops, live.get, lambda ino: ({11: 3}.get(ino, 0), None))
    ino = {path: node.ino for path, node in replica.walk(replica.root)}
    assert ino["tmp"] == 10 and ino["tmp/shard"] == 11 and ino["old"] == 12
    assert ino["gone"] == 15  # the inode its removal removed: it may live on under a hard link
    assert ino["moved"] == 18 and ino["over"] == 17  # the inode the rename over it replaced: the same
    assert ino["a"] == 14 and ino["b"] == 13  # exchanged since: each is the other's inode now
    shard = replica.lookup("tmp/shard")
    assert isinstance(shard, File) and shard.shown is not None and (shard.shown.ino, shard.shown.generation) == (11, 3)
    assert [p for p, _ in replica.nodes_of(11)] == ["tmp/shard"]


def test_a_name_whose_record_names_other_bytes_than_the_generation_last_published_shows_an_older_one():
    """A file with two names (a hard link): the gone node showed its newest
    generation at `q` and died before `x`, whose record still names the
    older bytes. Both names were taken to show the newest generation, so a
    load or a copy could take the older bytes at `x` for it."""
    new, old = Digest(1000, "7" * 32), Digest(300_000, "1" * 32)
    replica = Replica()
    replica.bind("q", File(0, shown=Shown(0, 0, new)))
    replica.bind("x", File(0, shown=Shown(0, 0, old)))
    takeover.bind_to_live(replica, [], {"q": 5, "x": 5}.get, lambda ino: (2, new) if ino == 5 else (0, None))
    shown = {path: (node.shown.ino, node.shown.generation) for path, node in replica.walk(replica.root)}
    assert shown == {"q": (5, 2), "x": (5, 0)}
    # the digest not heard: the generation last published, as before
    takeover.bind_to_live(replica, [], {"q": 5, "x": 5}.get, lambda ino: (2, None))
    assert {path: node.shown.generation for path, node in replica.walk(replica.root)} == {"q": 2, "x": 2}


def test_live_names_are_followed_back_to_the_names_they_had_before_the_queued_changes():
    ops = [Rename(1, "x.tmp", "mid", 0, False), Rename(2, "dir", "dir2", 0, True), Link(3, "hard", 7),
           Exchange(4, "p", "q"), Rename(5, "mid", "final", 0, False)]
    now = {"gen-x": ["final"], "gen-d": ["dir2/sub/f"], "gen-l": ["hard", "orig"], "gen-p": ["q"]}
    then = takeover.names_then(now, ops)
    assert then == {"gen-x": ["x.tmp"], "gen-d": ["dir/sub/f"], "gen-l": ["orig"], "gen-p": ["p"]}


def test_a_directory_the_store_does_not_show_is_bound_with_a_directory_moved_under_it_since(tmp_path):
    """The node taking over records the directories the store does not
    show: the live mount's, followed back to their names at the gone node's
    position (`names_then`). A directory's stand-in there was a plain node:
    binding the directory under it (`e/y/x`, renamed there from `d` since)
    put a new directory in its place, and `e/y` was followed back to no
    name, bound to no inode, never recorded: a restart lost its attributes."""
    rig = Rig(tmp_path / "store")
    publisher = Publisher(rig.engine)
    live = {"e": 3, "e/y": 6, "e/y/x": 2, "e/y/x/z": 7}
    takeover.replicate(publisher, storeio.Scanned([], {}, [], None, [], False), [Rename(1, "d", "e/y/x", 2, True)], live.get,
                       lambda ino: (0, None), list(live.items()))
    bound = {path: node.ino for path, node in publisher.replica.walk(publisher.replica.root)}
    assert bound == {"e": 3, "e/y": 6, "d": 2, "d/z": 7}  # d and d/z: their names at the position, renamed since


def test_a_directory_move_the_gone_publisher_left_halfway_binds_what_it_moved_already():
    """Node a moved `e` to `a/x` member by member (an object store) and died
    after two of three: the store shows `a/x/x` and `a/x/y` (and, copied
    but not yet deleted, `e/y` too), and `e/z`. The rename is queued again;
    its replay used to put the moving directory in place of `a/x` and its
    members with it, so `a/x/x` and `a/x/y` were bound to no inode: the new
    publisher did not know where they were, and reads of them got EIO."""
    replica = _store("a/", "a/x/", "a/x/x", "a/x/y", "e/", "e/y", "e/z")
    ops = [Rename(1, "e", "a/x", 0, True)]
    live = {"a": 20, "a/x": 21, "a/x/x": 22, "a/x/y": 23, "a/x/z": 24}
    takeover.bind_to_live(replica, ops, live.get, lambda ino: (0, None))
    ino = {path: node.ino for path, node in replica.walk(replica.root)}
    assert ino["e"] == 21 and ino["e/z"] == 24 and ino["a/x/x"] == 22
    assert ino["e/y"] == 23 and ino["a/x/y"] == 0  # the copy the move goes on from; the other is replaced by it


def test_a_removal_the_gone_node_held_back_waits_again_where_the_ops_it_applied_after_it_moved_what_it_removes(tmp_path):
    """Node a held back the removal of `d/old` (a file sealed before it was
    unsettled) and applied what came after it: `d` renamed to `e`, `x`
    renamed over `d2`. It reported both applied but that removal. The node
    taking over starts after them (applying them again is not harmless: see
    `unreported`), and holds the removal back again at `e/old`, bound to the
    removed inode, not to the live file now at that name (`e/old` again)."""
    rig = Rig(tmp_path / "store")
    publisher = Publisher(rig.engine)
    replica = _store("e/", "e/old", "d2")
    scanned = storeio.Scanned([], {}, [], None, [], False)
    for path, node in replica.walk(replica.root):
        publisher.restored(path, node)
    removal = Remove(1, "d/old", 5, False)
    applied = [removal, Rename(2, "d", "e", 3, True), Rename(3, "x", "d2", 4, False)]
    live = {"e": 3, "e/old": 9, "d2": 4}
    takeover.replicate(publisher, scanned, [], live.get, lambda ino: (1, None), [("e", 3)], applied, [removal])
    assert [(publisher.replica.path_of(node), node.ino, op) for node, op in publisher.deferred] == [("e/old", 5, removal)]
    bound = {path: node.ino for path, node in publisher.replica.walk(publisher.replica.root)}
    assert bound == {"e": 3, "e/old": 5, "d2": 4}


def test_a_directory_made_after_the_position_had_no_name_then():
    """The live mount's `y` is a directory made after the gone node's
    position; a file `y` was renamed to `c` before it. Followed back, the
    directory had no name (it did not exist): it was taken to have been at
    `y` then, joined the replica there in place of the file, and the
    rename applied again moved it over the store's `c`: `c`'s record was
    replaced by a directory's, and the file left in the store without one
    (found by a takeover explorer)."""
    ops = [Rename(1, "y", "c", 2, False), Mkdir(2, "y", 10)]
    assert takeover.names_then({"dir-y": ["y"], "dir-d": ["d"]}, ops, dirs=True) == {"dir-y": [], "dir-d": ["d"]}


def test_removals_held_back_of_a_directory_and_of_what_it_held_are_found_where_the_directory_went(tmp_path):
    """`d/f` and then `d` removed, both held back; `p` (d's parent) renamed
    to `q` after them: both wait at their names under `q`."""
    rig = Rig(tmp_path / "store")
    publisher = Publisher(rig.engine)
    store = _store("q/", "q/d/", "q/d/f")
    for path, node in store.walk(store.root):
        publisher.restored(path, node)
    f, d = Remove(1, "p/d/f", 5, False), Remove(2, "p/d", 4, True)
    applied = [f, d, Rename(3, "p", "q", 3, True)]
    takeover.replicate(publisher, storeio.Scanned([], {}, [], None, [], False), [], {"q": 3}.get, lambda ino: (0, None),
                       [("q", 3)], applied, [f, d])
    assert [(publisher.replica.path_of(node), node.ino, op) for node, op in publisher.deferred] == [("q/d/f", 5, f), ("q/d", 4, d)]


def test_a_removal_after_the_last_report_waits_again_only_where_the_store_shows_what_it_removes(tmp_path):
    """Removals between the gone node's last report and an exchange it
    applied (its plan in the store) may have been held back, unreported,
    or applied. Each waits again only where the store still shows what it
    removes: `kept` (the removed inode's published bytes), `d` (a
    directory for a directory's removal); not `other` (another file's
    bytes there), `gone` (nothing there: applied) or `mixed` (a directory
    where a file was removed)."""
    rig = Rig(tmp_path / "store")
    publisher = Publisher(rig.engine)
    digest = Digest(4, "0" * 32, ())
    replica = _store("d/", "mixed/")
    replica.bind("kept", File(0, shown=Shown(0, 0, digest)))
    replica.bind("other", File(0, shown=Shown(0, 0, Digest(4, "1" * 32, ()))))
    for path, node in replica.walk(replica.root):
        publisher.restored(path, node)
    kept, other, gone = Remove(1, "kept", 5, False), Remove(2, "other", 6, False), Remove(3, "gone", 7, False)
    d, mixed = Remove(4, "d", 8, True), Remove(5, "mixed", 9, False)
    unsure = [kept, other, gone, d, mixed]
    takeover.replicate(publisher, storeio.Scanned([], {}, [], None, [], False), [], {}.get, lambda ino: (1, digest), [],
                       unsure, [], unsure)
    assert [(publisher.replica.path_of(node), node.ino, op) for node, op in publisher.deferred] == [("kept", 5, kept), ("d", 8, d)]
