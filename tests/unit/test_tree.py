"""The inode store with no FUSE: namespace, lifetimes, errors, generations."""

import errno
import os
import stat

import pytest
from ckptfs.fs.memory import MemoryPool
from ckptfs.fs.tree import RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT, InodeTree
from hypothesis import given, settings
from hypothesis import strategies as st

W = os.O_WRONLY
RW = os.O_RDWR


@pytest.fixture
def s():
    return InodeTree(MemoryPool(1 << 30))


def errno_of(fn, *args, **kwargs):
    with pytest.raises(OSError) as exc:
        fn(*args, **kwargs)
    return exc.value.errno


def new_file(s, name, data=b"", parent=ROOT):
    h = s.create(parent, name, 0o644, W | os.O_CREAT, 0, 0)
    if data:
        s.write(h.fh, 0, data)
    s.release(h.fh)
    return h.inode


def test_create_write_read(s):
    ino = new_file(s, b"f", b"hello")
    h = s.open(ino.ino, os.O_RDONLY)
    assert s.read(h.fh, 0, 100) == b"hello"
    assert s.read(h.fh, 3, 100) == b"lo"
    assert s.read(h.fh, 10, 100) == b""


def test_o_excl_and_o_trunc(s):
    new_file(s, b"f", b"hello")
    assert errno_of(s.create, ROOT, b"f", 0o644, W | os.O_CREAT | os.O_EXCL, 0, 0) == errno.EEXIST
    h = s.create(ROOT, b"f", 0o644, W | os.O_CREAT | os.O_TRUNC, 0, 0)
    assert h.inode.size == 0


def test_o_append_writes_at_end(s):
    ino = new_file(s, b"log", b"abc")
    h = s.open(ino.ino, W | os.O_APPEND)
    s.write(h.fh, 0, b"def")
    assert ino.data.read(0, 10) == b"abcdef"


def test_write_on_read_only_handle_is_ebadf(s):
    ino = new_file(s, b"f", b"x")
    h = s.open(ino.ino, os.O_RDONLY)
    assert errno_of(s.write, h.fh, 0, b"y") == errno.EBADF


def test_name_too_long(s):
    assert errno_of(s.mknod, ROOT, b"a" * 256, stat.S_IFREG | 0o644, 0, 0) == errno.ENAMETOOLONG
    new_file(s, b"a" * 255)


def test_mkdir_rmdir_nlink_and_enotempty(s):
    root = s.get(ROOT)
    d = s.mkdir(ROOT, b"d", 0o755, 0, 0)
    assert root.nlink == 3 and d.nlink == 2
    s.mkdir(d.ino, b"sub", 0o755, 0, 0)
    assert d.nlink == 3
    assert errno_of(s.rmdir, ROOT, b"d") == errno.ENOTEMPTY
    assert errno_of(s.unlink, ROOT, b"d") == errno.EISDIR
    s.rmdir(d.ino, b"sub")
    s.rmdir(ROOT, b"d")
    assert root.nlink == 2
    assert errno_of(s.lookup, ROOT, b"d") == errno.ENOENT


def test_directory_mtime_changes_on_add_and_remove(s):
    d = s.mkdir(ROOT, b"d", 0o755, 0, 0)
    t0 = d.mtime_ns
    new_file(s, b"f", parent=d.ino)
    t1 = d.mtime_ns
    s.unlink(d.ino, b"f")
    assert t0 < t1 < d.mtime_ns


def test_unlinked_open_file_stays_readable_until_release(s):
    ino = new_file(s, b"f", b"data" * 1000)
    used = s.pool.used
    h = s.open(ino.ino, os.O_RDONLY)
    s.unlink(ROOT, b"f")
    assert ino.ino in s.inodes and s.pool.used == used
    assert s.read(h.fh, 0, 4) == b"data"
    s.release(h.fh)
    assert ino.ino not in s.inodes and s.pool.used == 0


def test_kernel_reference_keeps_inode(s):
    ino = new_file(s, b"f", b"x")
    s.ref(s.lookup(ROOT, b"f"))
    s.unlink(ROOT, b"f")
    assert ino.ino in s.inodes
    s.forget(ino.ino, 1)
    assert ino.ino not in s.inodes


def test_rename_over_existing_file_frees_it(s):
    new_file(s, b"old", b"old data")
    tmp = new_file(s, b".metadata.tmp", b"new")
    replaced = s.rename(ROOT, b".metadata.tmp", ROOT, b"old")
    assert replaced is not None and replaced.ino not in s.inodes
    assert s.lookup(ROOT, b"old") is tmp


def test_rename_errors(s):
    d = s.mkdir(ROOT, b"d", 0o755, 0, 0)
    sub = s.mkdir(d.ino, b"sub", 0o755, 0, 0)
    new_file(s, b"f")
    new_file(s, b"x", parent=sub.ino)
    assert errno_of(s.rename, ROOT, b"d", sub.ino, b"inside") == errno.EINVAL
    assert errno_of(s.rename, ROOT, b"f", ROOT, b"d") == errno.EISDIR
    assert errno_of(s.rename, ROOT, b"d", ROOT, b"f") == errno.ENOTDIR
    assert errno_of(s.rename, ROOT, b"missing", ROOT, b"z") == errno.ENOENT
    assert errno_of(s.rename, ROOT, b"f", ROOT, b"d", RENAME_NOREPLACE) == errno.EEXIST


def test_rename_directory_over_nonempty_directory(s):
    s.mkdir(ROOT, b"a", 0o755, 0, 0)
    b = s.mkdir(ROOT, b"b", 0o755, 0, 0)
    new_file(s, b"f", parent=b.ino)
    assert errno_of(s.rename, ROOT, b"a", ROOT, b"b") == errno.ENOTEMPTY
    s.unlink(b.ino, b"f")
    s.rename(ROOT, b"a", ROOT, b"b")
    assert s.get(ROOT).nlink == 3


def test_rename_directory_moves_parent_links(s):
    a = s.mkdir(ROOT, b"a", 0o755, 0, 0)
    b = s.mkdir(ROOT, b"b", 0o755, 0, 0)
    c = s.mkdir(a.ino, b"c", 0o755, 0, 0)
    s.rename(a.ino, b"c", b.ino, b"c2")
    assert a.nlink == 2 and b.nlink == 3 and c.parent == b.ino
    assert s.lookup(c.ino, b"..") is b


def test_rename_exchange(s):
    f = new_file(s, b"f", b"1")
    g = new_file(s, b"g", b"2")
    s.rename(ROOT, b"f", ROOT, b"g", RENAME_EXCHANGE)
    assert s.lookup(ROOT, b"f") is g and s.lookup(ROOT, b"g") is f


def test_hard_links_and_symlinks(s):
    f = new_file(s, b"f", b"x")
    s.link(f.ino, ROOT, b"g")
    assert f.nlink == 2
    s.unlink(ROOT, b"f")
    assert f.nlink == 1 and s.lookup(ROOT, b"g") is f
    ln = s.symlink(ROOT, b"l", b"g", 0, 0)
    assert s.readlink(ln.ino) == b"g" and ln.size == 1
    assert errno_of(s.readlink, f.ino) == errno.EINVAL
    assert errno_of(s.link, s.get(ROOT).ino, ROOT, b"rootlink") == errno.EPERM


def test_truncate_and_setattr(s):
    f = new_file(s, b"f", b"0123456789")
    s.setattr(f.ino, size=4)
    assert f.data.read(0, 100) == b"0123"
    s.setattr(f.ino, size=8)
    assert f.data.read(0, 100) == b"0123\0\0\0\0"
    s.setattr(f.ino, mode=0o600, uid=5, gid=6, mtime_ns=123)
    assert stat.S_IMODE(f.mode) == 0o600 and stat.S_ISREG(f.mode)
    assert (f.uid, f.gid, f.mtime_ns) == (5, 6, 123)
    d = s.mkdir(ROOT, b"d", 0o755, 0, 0)
    assert errno_of(s.setattr, d.ino, size=0) == errno.EISDIR


def test_xattrs(s):
    f = new_file(s, b"f")
    assert errno_of(s.getxattr, f.ino, b"user.x") == errno.ENODATA
    s.setxattr(f.ino, b"user.x", b"1")
    assert s.getxattr(f.ino, b"user.x") == b"1"
    assert s.listxattr(f.ino) == [b"user.x"]
    s.removexattr(f.ino, b"user.x")
    assert errno_of(s.removexattr, f.ino, b"user.x") == errno.ENODATA
    assert errno_of(s.setxattr, f.ino, b"user.big", b"x" * 70000) == errno.E2BIG


def test_seal_bumps_generation_only_on_last_writer(s):
    f = new_file(s, b"f", b"x")
    assert f.generation == 1
    a = s.open(f.ino, W)
    b = s.open(f.ino, RW)
    r = s.open(f.ino, os.O_RDONLY)
    assert s.release(a.fh) is None
    assert s.release(r.fh) is None
    s.write(b.fh, 0, b"y")
    assert s.release(b.fh) is f and f.generation == 2
    c = s.open(f.ino, W)
    assert s.release(c.fh) is None and f.generation == 2  # nothing changed: no new generation


def test_a_sealed_file_takes_of_the_budget_what_its_bytes_take(s):
    """A file of 300 KiB written in pieces held a whole 4 MiB chunk of the
    budget for as long as it stayed in RAM; sealed, it takes its pages."""
    h = s.create(ROOT, b"f", 0o644, W | os.O_CREAT, 0, 0)
    for off in range(0, 300 << 10, 100 << 10):
        s.write(h.fh, off, b"w" * (100 << 10))
    assert s.pool.used == 4 << 20  # (a writer does not know the final size)
    s.release(h.fh)
    assert s.pool.used == 300 << 10 and h.inode.data.read(0, 1 << 20) == b"w" * (300 << 10)


def test_readdir_offsets_survive_concurrent_changes(s):
    for i in range(10):
        new_file(s, b"f%d" % i)
    first = list(s.readdir(ROOT, 0))[:4]
    resume = first[-1][2]
    s.unlink(ROOT, b"f1")  # already listed
    s.unlink(ROOT, b"f7")  # not listed yet: must not appear
    new_file(s, b"new")  # created during the listing: may appear, once
    rest = [name for name, _, _ in s.readdir(ROOT, resume)]
    listed = [n for n, _, _ in first] + rest
    assert listed[:2] == [b".", b".."]
    listed = listed[2:]
    assert sorted(set(listed) - {b"new"}) == sorted({b"f%d" % i for i in range(10)} - {b"f7"})
    assert len(listed) == len(set(listed))


def test_a_listing_starts_with_dot_and_dot_dot(s):
    """Every directory's listing starts with "." and ".." (the directory and
    its parent; the root's parent is the root), as on a local file system:
    `ls -a` showed neither."""
    d = s.mkdir(ROOT, b"d", 0o755, 0, 0)
    e = s.mkdir(d.ino, b"e", 0o755, 0, 0)
    new_file(s, b"f", parent=e.ino)
    assert [(name, inode.ino) for name, inode, _ in s.readdir(e.ino, 0)] == [(b".", e.ino), (b"..", d.ino), (b"f", s.lookup(e.ino, b"f").ino)]
    assert [(name, inode.ino) for name, inode, _ in s.readdir(ROOT, 0)][:2] == [(b".", ROOT), (b"..", ROOT)]
    # resumed after each of them: each comes once
    dot = next(s.readdir(e.ino, 0))[2]
    assert [name for name, _, _ in s.readdir(e.ino, dot)] == [b"..", b"f"]
    dotdot = list(s.readdir(e.ino, 0))[1][2]
    assert [name for name, _, _ in s.readdir(e.ino, dotdot)] == [b"f"]


def test_a_directory_gone_for_good_leaves_no_listing_behind(s):
    """A listing is kept so that a readdir can resume it (LISTINGS_KEPT
    directories at most); `rm -r` lists every directory it removes, and a
    listing of 100,000 names held some 13 MB after its directory was gone."""
    d = s.mkdir(ROOT, b"d", 0o755, 0, 0)
    for i in range(100):
        new_file(s, b"f%d" % i, parent=d.ino)
    assert len(list(s.readdir(d.ino, 0))) == 2 + 100
    for i in range(100):
        s.unlink(d.ino, b"f%d" % i)
    s.rmdir(ROOT, b"d")
    assert d.ino not in s.inodes
    assert s._listings == {}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["create", "unlink", "recreate"]), st.integers(0, 29)), max_size=40),
       st.integers(1, 7), st.integers(0, 10_000))
def test_a_listing_in_batches_sees_every_entry_that_stays_exactly_once(changes, batch, seed):
    """readdir resumed batch by batch, with creates, deletes and re-creates
    between batches (as `ls` of a big directory being written): every entry
    present from start to end is listed exactly once, no entry deleted
    before the listing reached it is listed, nothing is listed twice."""
    import random

    t = InodeTree(MemoryPool(1 << 30))
    names = {b"f%d" % i for i in range(0, 30, 2)}
    for n in sorted(names):
        new_file(t, n)
    rng = random.Random(seed)
    listed: list[bytes] = []
    touched: set[bytes] = set()
    recreated: set[bytes] = set()  # names created during the listing
    offset = 0
    pending = list(changes)
    while True:
        got = []
        for name, _inode, cookie in t.readdir(ROOT, offset):
            got.append(name)
            offset = cookie
            if len(got) == batch:
                break
        listed += got
        for _ in range(rng.randint(0, 3)):
            if not pending:
                break
            what, i = pending.pop(0)
            name = b"f%d" % i
            touched.add(name)
            if what == "create" and name not in names:
                recreated.add(name)
                new_file(t, name)
                names.add(name)
            elif what == "unlink" and name in names:
                t.unlink(ROOT, name)
                names.discard(name)
            elif what == "recreate" and name in names:
                recreated.add(name)
                t.unlink(ROOT, name)
                new_file(t, name)
        if len(got) < batch:
            break
    assert listed[:2] == [b".", b".."] and b"." not in listed[2:] and b".." not in listed[2:]
    listed = listed[2:]
    assert all(listed.count(n) <= 1 for n in listed if n not in recreated)  # a name created meanwhile is a new entry
    stayed = {n for n in names if n not in touched}
    assert stayed <= set(listed)
    assert all(listed.count(n) == 1 for n in stayed)
    assert set(listed) <= names | touched


def test_removed_directory_accepts_no_entries(s):
    d = s.mkdir(ROOT, b"d", 0o755, 0, 0)
    s.ref(d)
    s.rmdir(ROOT, b"d")
    assert errno_of(s.mknod, d.ino, b"f", stat.S_IFREG | 0o644, 0, 0) == errno.ENOENT


def test_setgid_directory_inheritance(s):
    d = s.mkdir(ROOT, b"d", 0o2775, 0, 42)
    f = new_file(s, b"f", parent=d.ino)
    sub = s.mkdir(d.ino, b"sub", 0o755, 0, 0)
    assert f.gid == 42 and sub.gid == 42 and sub.mode & stat.S_ISGID


def test_budget_exhaustion_is_enospc(s):
    small = InodeTree(MemoryPool(1 << 20))
    h = small.create(ROOT, b"f", 0o644, W | os.O_CREAT, 0, 0)
    assert errno_of(small.write, h.fh, 0, b"x" * (2 << 20)) == errno.ENOSPC
    small.write(h.fh, 0, b"x" * 1000)


class Recorder:
    def __init__(self):
        self.events = []

    def sealed(self, ino, generation, snapshot):
        self.events.append(("sealed", ino, generation, b"".join(bytes(p) for p in snapshot.pieces())))
        snapshot.release()

    def grew(self, ino, data):
        pass

    def renamed(self, src, dst, ino, is_dir, replaced=None):
        self.events.append(("renamed", src, dst, is_dir))

    def exchanged(self, a, b):
        self.events.append(("exchanged", a, b))

    def linked(self, ino, path):
        self.events.append(("linked", ino, path))

    def removed(self, path, ino, is_dir):
        self.events.append(("removed", path, is_dir))

    def made_dir(self, path, ino):
        self.events.append(("mkdir", path))

    def made_symlink(self, path, ino, target):
        self.events.append(("symlink", path, target))

    def changed_attrs(self, ino):
        self.events.append(("attrs", ino))

    def freed(self, ino):
        pass


def test_journal_events_carry_paths_at_event_time():
    rec = Recorder()
    s = InodeTree(MemoryPool(1 << 30), journal=rec)
    d = s.mkdir(ROOT, b"ckpt.tmp", 0o755, 0, 0)
    f = new_file(s, b"shard", b"data", parent=d.ino)
    s.rename(ROOT, b"ckpt.tmp", ROOT, b"ckpt")
    s.symlink(ROOT, b"last", b"ckpt", 0, 0)
    s.unlink(d.ino, b"shard")
    s.rmdir(ROOT, b"ckpt")
    assert rec.events == [
        ("mkdir", "ckpt.tmp"),
        ("sealed", f.ino, 1, b"data"),
        ("renamed", "ckpt.tmp", "ckpt", True),
        ("symlink", "last", "ckpt"),
        ("removed", "ckpt/shard", False),
        ("removed", "ckpt", True),
    ]


def test_a_file_closed_while_its_open_file_lives_on_is_sealed_before_what_follows():
    """`closed` (the kernel's FLUSH) marks a file whose RELEASE has not come
    (a forked process holds it): it is sealed, with what it held then,
    before any later change, at `seal_closed`, or once quiet; a write
    after the mark undoes it (the close was a child's, the writer goes on)."""
    rec = Recorder()
    s = InodeTree(MemoryPool(1 << 30), journal=rec)
    h = s.create(ROOT, b"data", 0o644, W, 0, 0)
    s.write(h.fh, 0, b"weights")
    s.closed(h.fh)
    s.mkdir(ROOT, b"next", 0o755, 0, 0)  # the RELEASE has not come: still sealed first
    assert rec.events == [("sealed", h.inode.ino, 1, b"weights"), ("mkdir", "next")]
    s.release(h.fh)  # nothing new to seal
    assert len(rec.events) == 2

    rec.events.clear()
    h = s.create(ROOT, b"model", 0o644, W, 0, 0)
    s.write(h.fh, 0, b"first half ")
    s.closed(h.fh)  # a child's copy closed
    s.write(h.fh, 11, b"second half")
    s.mkdir(ROOT, b"other", 0o755, 0, 0)
    assert rec.events == [("mkdir", "other")]  # never the half
    s.closed(h.fh)
    s.seal_closed(quiet_s=60)
    assert rec.events == [("mkdir", "other")]  # not quiet long enough
    s.seal_closed(quiet_s=0)
    assert rec.events[-1] == ("sealed", h.inode.ino, 1, b"first half second half")
    r = s.create(ROOT, b"ro", 0o644, os.O_RDONLY, 0, 0)
    s.closed(r.fh)  # a reader's close marks nothing
    assert not s._closed


def test_journal_has_hard_links_exchanges_and_path_truncates():
    """Hard links and RENAME_EXCHANGE reach the journal as what they are, and a
    truncate by path (no open handle, so no release) seals at once."""
    rec = Recorder()
    s = InodeTree(MemoryPool(1 << 30), journal=rec)
    a = new_file(s, b"a", b"AAAA")
    new_file(s, b"b", b"BB")
    rec.events.clear()
    s.link(a.ino, ROOT, b"a2")
    s.rename(ROOT, b"a", ROOT, b"b", RENAME_EXCHANGE)
    s.setattr(a.ino, size=0)
    assert rec.events == [("linked", a.ino, "a2"), ("exchanged", "a", "b"), ("sealed", a.ino, 2, b"")]



def test_an_exchange_of_a_name_with_itself_or_another_link_of_its_file_does_nothing():
    """Linux returns at once from any rename of a name onto one of the same
    inode, an exchange too. The tree journaled such an exchange, and an
    object store's publisher spun on its plan for good: a flush never
    returned (a random workload found it, calling the tree directly: through
    FUSE the kernel never asks)."""
    rec = Recorder()
    s = InodeTree(MemoryPool(1 << 30), journal=rec)
    a = new_file(s, b"a", b"AAAA")
    s.link(a.ino, ROOT, b"a2")
    rec.events.clear()
    assert s.rename(ROOT, b"a", ROOT, b"a", RENAME_EXCHANGE) is None
    assert s.rename(ROOT, b"a", ROOT, b"a2", RENAME_EXCHANGE) is None
    assert rec.events == [] and s.lookup(ROOT, b"a") is a and s.lookup(ROOT, b"a2") is a and a.nlink == 2

def test_paths_of_and_inode_at(s):
    d = s.mkdir(ROOT, b"a", 0o755, 0, 0)
    f = new_file(s, b"f", b"x", parent=d.ino)
    s.link(f.ino, ROOT, b"g")
    assert s.paths_of(f.ino) == ["a/f", "g"] or sorted(s.paths_of(f.ino)) == ["a/f", "g"]
    assert s.inode_at("a/f") is f and s.inode_at("a") is d and s.inode_at("nope") is None
    s.rename(ROOT, b"a", ROOT, b"b")
    assert sorted(s.paths_of(f.ino)) == ["b/f", "g"]


def test_reserved_name_at_every_depth(s):
    """The store's hidden prefix names no entry: at the root it is ckptfs's
    own; below it, the store's next mount would refuse the store as holding
    another ckptfs store (a user of the mount could make every restart
    fail)."""
    assert errno_of(s.mkdir, ROOT, b".ckptfs", 0o755, 0, 0) == errno.EPERM
    d = s.mkdir(ROOT, b"d", 0o755, 0, 0)
    assert errno_of(s.mkdir, d.ino, b".ckptfs", 0o755, 0, 0) == errno.EPERM
    assert errno_of(s.create, d.ino, b".ckptfs", 0o644, W, 0, 0) == errno.EPERM
    assert errno_of(s.symlink, d.ino, b".ckptfs", b"x", 0, 0) == errno.EPERM
    s.mkdir(d.ino, b"x", 0o755, 0, 0)
    assert errno_of(s.rename, d.ino, b"x", d.ino, b".ckptfs") == errno.EPERM


def test_restore_creates_evicted_files_and_parents(s):
    f = s.restore("a/b/model.pt", 0o100600, size=1234, mtime_ns=42)
    assert f.size == 1234 and not f.data.resident and f.mtime_ns == 42
    assert stat.S_IMODE(f.mode) == 0o600
    assert s.paths_of(f.ino) == ["a/b/model.pt"]
    link = s.restore("last", stat.S_IFLNK | 0o777, target="a/b/model.pt")
    assert s.readlink(link.ino) == b"a/b/model.pt"


def _as_restored(s, path):
    node = s.inode_at(path)
    return (stat.S_IFMT(node.mode), stat.S_IMODE(node.mode), node.uid, node.gid, node.mtime_ns, node.size, node.generation,
            node.data.resident if node.data is not None else None, sorted(s.paths_of(node.ino)), node.sealed_version == node.version)


def test_restore_files_restores_as_restore_does_one_at_a_time():
    files = [("a", 0o4755, 10, 5, 1000, 1000), ("b", 0o600, 0, 0, None, None), ("c", 0o644, 7, 9, 0, 0)]
    one, many = InodeTree(MemoryPool(1 << 30), uid=7, gid=8), InodeTree(MemoryPool(1 << 30), uid=7, gid=8)
    for tree in (one, many):
        tree.clock = lambda: 123  # "now", where a record has no mtime
        tree.restore("d/e", stat.S_IFDIR | 0o2775, uid=3, gid=4)
        tree.restore("d/e/c", stat.S_IFREG | 0o600, 3, 1, "", 5, 5)  # already there: kept as it is
    for name, mode, size, mtime_ns, uid, gid in files:
        one.restore(f"d/e/{name}", stat.S_IFREG | mode, size, mtime_ns, "", uid, gid)
    made = many.restore_files("d/e", files)
    assert [sorted(many.paths_of(n.ino)) for n in made] == [["d/e/a"], ["d/e/b"], ["d/e/c"]]
    for path in ("d/e/a", "d/e/b", "d/e/c"):
        assert _as_restored(many, path) == _as_restored(one, path)
    assert [name for name, _, _ in many.readdir(many.inode_at("d/e").ino, 0)] == [b".", b"..", b"c", b"a", b"b"]
    # the parent is made as needed, in the root too; the root's reserved name is refused
    assert [sorted(many.paths_of(n.ino)) for n in many.restore_files("x/y", [("f", 0o644, 1, 1, None, None)])] == [["x/y/f"]]
    assert many.restore_files("", [("g", 0o644, 1, 1, None, None)])[0].size == 1
    assert errno_of(many.restore_files, "", [(".ckptfs", 0o644, 1, 1, None, None)]) == errno.EPERM
    assert errno_of(many.restore_files, "x", [("n" * 300, 0o644, 1, 1, None, None)]) == errno.ENAMETOOLONG


def test_paths_of_a_file_deeper_than_python_recursion(s):
    d = ROOT
    for _ in range(3000):
        d = s.mkdir(d, b"a", 0o755, 0, 0).ino
    f = new_file(s, b"f", b"x", parent=d)
    s.link(f.ino, ROOT, b"top")
    s.rename(ROOT, b"a", ROOT, b"b")
    assert sorted(s.paths_of(f.ino)) == ["/".join(["b"] + ["a"] * 2999) + "/f", "top"]


def test_resolve_follows_symlinks_as_the_kernel_would(s):
    d = s.mkdir(ROOT, b"step-3", 0o755, 0, 0)
    new_file(s, b"model.pt", b"m", parent=d.ino)
    s.symlink(ROOT, b"latest", b"step-3", 0, 0)
    s.symlink(ROOT, b"abs", b"/mnt/ckpt/step-3/model.pt", 0, 0)
    s.symlink(d.ino, b"up", b"../latest", 0, 0)
    s.symlink(ROOT, b"out", b"/etc", 0, 0)
    s.symlink(ROOT, b"above", b"..", 0, 0)
    s.symlink(ROOT, b"loop", b"loop", 0, 0)
    s.symlink(ROOT, b"dangling", b"nothing", 0, 0)
    assert s.resolve("latest/model.pt", "/mnt/ckpt") == "step-3/model.pt"
    assert s.resolve("latest", "/mnt/ckpt/") == "step-3"
    assert s.resolve("abs", "/mnt/ckpt") == "step-3/model.pt"
    assert s.resolve("step-3/up/model.pt", "/mnt/ckpt") == "step-3/model.pt"
    assert s.resolve("step-3/./model.pt", "/mnt/ckpt") == "step-3/model.pt"
    assert s.resolve("", "/mnt/ckpt") == ""
    for path in ("out/passwd", "above", "step-3/../.."):
        with pytest.raises(ValueError):
            s.resolve(path, "/mnt/ckpt")
    assert errno_of(s.resolve, "loop", "/mnt/ckpt") == errno.ELOOP
    for path in ("dangling", "latest/nothing", "nothing"):
        with pytest.raises(FileNotFoundError):
            s.resolve(path, "/mnt/ckpt")


def test_a_path_the_store_cannot_hold_is_refused_when_made_or_moved_there():
    """`check_path` (an object store's key rules: here UTF-8, at most 12
    bytes) is asked for every entry made and every rename, and for a
    directory moved deeper, for the longest path it brings along."""
    asked = []

    def check_path(path):
        asked.append(path)
        if not path.isascii():
            raise OSError(errno.EILSEQ, "not UTF-8", path)
        if len(path) > 12:
            raise OSError(errno.ENAMETOOLONG, "too long for the store", path)
    s = InodeTree(MemoryPool(1 << 30), check_path=check_path)
    d = s.mkdir(ROOT, b"d", 0o755, 0, 0)
    new_file(s, b"abcdefgh", parent=d.ino)  # d/abcdefgh: 10 bytes
    assert "d/abcdefgh" in asked
    assert errno_of(new_file, s, b"abcdefghijk", parent=d.ino) == errno.ENAMETOOLONG
    assert errno_of(s.mkdir, ROOT, b"\xff", 0o755, 0, 0) == errno.EILSEQ
    assert errno_of(s.symlink, ROOT, b"l\xfe", b"t", 0, 0) == errno.EILSEQ
    f = new_file(s, b"f")
    assert errno_of(s.link, f.ino, ROOT, b"0123456789abc") == errno.ENAMETOOLONG
    assert errno_of(s.rename, ROOT, b"f", ROOT, b"f\xff") == errno.EILSEQ
    s.mkdir(ROOT, b"ee", 0o755, 0, 0)
    # ee/d/abcdefgh is 13 bytes: d cannot move into ee, by rename or by exchange
    assert errno_of(s.rename, ROOT, b"d", s.lookup(ROOT, b"ee").ino, b"d") == errno.ENAMETOOLONG
    s.mkdir(s.lookup(ROOT, b"ee").ino, b"x", 0o755, 0, 0)
    assert errno_of(s.rename, ROOT, b"d", s.lookup(ROOT, b"ee").ino, b"x", RENAME_EXCHANGE) == errno.ENAMETOOLONG
    assert s.lookup(d.ino, b"abcdefgh") and s.lookup(ROOT, b"d") is d
    # a shorter or equal path asks no walk below, and is taken
    s.rename(ROOT, b"d", ROOT, b"e")
    assert s.lookup(s.lookup(ROOT, b"e").ino, b"abcdefgh")


def test_an_inode_s_extended_attributes_are_bounded_in_all(s):
    """Each value was bounded (64 KiB), not how many: a loop of setxattr by
    any user of the mount grew the daemon without limit (xattrs live outside
    the RAM budget). All of one inode's take at most 128 KiB, as on tmpfs;
    replacing one counts its new size only."""
    ino = new_file(s, b"f").ino
    value = b"v" * 60_000
    s.setxattr(ino, b"user.a", value)
    s.setxattr(ino, b"user.b", value)
    assert errno_of(s.setxattr, ino, b"user.c", value) == errno.ENOSPC
    s.setxattr(ino, b"user.b", value)  # the same size again: fits
    s.removexattr(ino, b"user.a")
    s.setxattr(ino, b"user.c", value)
    assert sorted(s.listxattr(ino)) == [b"user.b", b"user.c"]


def _tmpfiles_in(directory) -> int:
    """Descriptors of this process open on unlinked files in `directory` (spill files)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(f"{directory}/") and target.endswith("(deleted)")
    return n


def test_a_file_spills_from_a_copy_made_off_the_owning_thread(tmp_path):
    """RAM full, a file continues on disk. Its bytes so far (up to the whole
    budget) used to be copied into the spill file on the event loop: with a
    2 GiB budget the mount answered nothing for 2.4 s. The copy is now made
    from a snapshot in any thread (`begin_spill`, `SpillCopy.run`), the file
    serving reads from RAM meanwhile; `end_spill` switches to it."""
    import threading

    s = InodeTree(MemoryPool(1 << 30), spill_dir=str(tmp_path))
    data = os.urandom(9 << 20) + b"end"
    h = s.create(ROOT, b"f", 0o644, RW | os.O_CREAT, 0, 0)
    s.write(h.fh, 0, data)
    s.truncate(h.inode, len(data) + (8 << 20))  # a hole at the end stays a hole
    used = s.pool.used
    copy, version = s.begin_spill(h.inode)
    worker = threading.Thread(target=copy.run)
    worker.start()
    assert s.read(h.fh, len(data) - 3, 3) == b"end"  # still served from RAM meanwhile
    worker.join()
    assert s.end_spill(h.inode, copy, version) and s.spilled(h.inode.ino)
    assert s.pool.used < used - (8 << 20) and _tmpfiles_in(tmp_path) == 1
    assert s.read(h.fh, 0, len(data)) == data and s.read(h.fh, len(data), 4096) == bytes(4096)
    assert os.fstat(h.inode.data._spill.fd).st_blocks * 512 < len(data) + (4 << 20)
    s.release(h.fh)


@pytest.mark.parametrize("change", ["write", "truncate"])
def test_a_spill_copy_of_a_file_changed_meanwhile_is_dropped(tmp_path, change):
    """A write or truncate while the copy was made: the file stays in RAM as
    it is now (the caller tries again), and the copy's spill file is closed."""
    s = InodeTree(MemoryPool(1 << 30), spill_dir=str(tmp_path))
    h = s.create(ROOT, b"f", 0o644, RW | os.O_CREAT, 0, 0)
    s.write(h.fh, 0, b"a" * (5 << 20))
    copy, version = s.begin_spill(h.inode)
    copy.run()
    if change == "write":
        s.write(h.fh, 0, b"b")
    else:
        s.truncate(h.inode, 0)
    assert not s.end_spill(h.inode, copy, version) and not s.spilled(h.inode.ino)
    assert _tmpfiles_in(tmp_path) == 0
    assert s.read(h.fh, 0, 2) == (b"ba" if change == "write" else b"")
    s.release(h.fh)
