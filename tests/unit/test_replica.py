"""The replica: the store's namespace as the publisher replayed it."""

from ckptfs.writeback.replica import Dir, File, Replica


def test_a_moved_node_is_found_under_its_new_name_only():
    r = Replica()
    r.bind("ckpt.tmp", Dir(2))
    r.bind("ckpt.tmp/inner.tmp", Dir(3))
    f = File(4)
    r.bind("ckpt.tmp/inner.tmp/a", f)
    r.bind("ckpt.tmp/inner", r.lookup("ckpt.tmp/inner.tmp"))
    r.bind("ckpt", r.lookup("ckpt.tmp"))
    assert [rel for rel, _ in r.walk(r.root)] == ["ckpt", "ckpt/inner", "ckpt/inner/a"]
    assert r.path_of(f) == "ckpt/inner/a" and r.lookup("ckpt.tmp") is None
    assert r.nodes_of(4) == [("ckpt/inner/a", f)]


def test_binding_over_a_name_detaches_what_was_there():
    r = Replica()
    old, new = File(5), File(6)
    r.bind("latest", old)
    r.bind("latest.tmp", new)
    assert r.bind("latest", new) is old
    assert not r.attached(old) and r.nodes_of(5) == [] and r.path_of(new) == "latest"
    assert [rel for rel, _ in r.walk(r.root)] == ["latest"]


def test_walk_gives_each_entry_then_what_is_under_it_at_any_depth():
    r = Replica()
    r.bind("a", Dir(2))
    r.bind("a/x", File(3))
    r.bind("a/d", Dir(4))
    r.bind("a/d/y", File(5))
    r.bind("b", File(6))
    assert [rel for rel, _ in r.walk(r.root)] == ["a", "a/x", "a/d", "a/d/y", "b"]
    assert [rel for rel, _ in r.walk(r.lookup("a"), "a")] == ["a/x", "a/d", "a/d/y"]
    deep = "/".join(["c"] * 3000)  # deeper than Python's recursion limit
    for i in range(1, 3001):
        r.bind("/".join(["c"] * i), Dir(100 + i))
    r.bind(f"{deep}/z", File(7))
    assert [rel for rel, _ in r.walk(r.root)][-1] == f"{deep}/z"
