"""Random operation sequences on the mount and on tmpfs give identical results."""

from __future__ import annotations

import itertools
import os
import shutil
import stat as stat_mod
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tests.mountutil import read_uncached

# Few names, mostly at the top, so that operations collide and succeed often.
paths = st.one_of(st.sampled_from(["a", "b", "c"]), st.sampled_from(["a", "b", "a/b", "a/c", "b/a", "a/b/c"]))
offsets = st.one_of(st.integers(0, 5000), st.integers((4 << 20) - 3000, (4 << 20) + 3000), st.integers(0, 9 << 20))
# Non-zero fills: stale bytes must never pass for the zeros of a hole.
payloads = st.one_of(
    st.builds(lambda n, v: bytes([v]) * n, st.integers(0, 6000), st.integers(1, 255)),
    st.binary(min_size=1, max_size=64).filter(any),
)
_counter = itertools.count()


def outcome(fn, *args):
    try:
        r = fn(*args)
        return ("ok", r)
    except OSError as exc:
        return ("err", exc.errno)


def snapshot(root: Path, uncached: bool) -> dict:
    tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        tree[rel] = ("dir", sorted(dirnames), sorted(filenames))
        for name in filenames:
            p = Path(dirpath, name)
            data = read_uncached(p) if uncached else p.read_bytes()
            tree[os.path.join(rel, name)] = ("file", len(data), data)
    return tree


class SideBySide(RuleBasedStateMachine):
    mount_dir: Path  # set by the test

    def __init__(self) -> None:
        super().__init__()
        n = next(_counter)
        self.roots = (self.mount_dir / f"case{n}", Path(tempfile.mkdtemp(prefix="ref", dir="/dev/shm")))
        self.roots[0].mkdir()

    def both(self, fn, *rel_paths_and_args):
        results = [fn(root, *rel_paths_and_args) for root in self.roots]
        assert results[0] == results[1], (fn.__name__, rel_paths_and_args, results)

    @rule(path=paths, data=payloads)
    def create(self, path, data):
        self.both(lambda r, p, d: outcome((r / p).write_bytes, d), path, data)

    @rule(path=paths, off=offsets, data=payloads)
    def write_at(self, path, off, data):
        def op(r, p, o, d):
            def go():
                fd = os.open(r / p, os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    return os.pwrite(fd, d, o)
                finally:
                    os.close(fd)
            return outcome(go)
        self.both(op, path, off, data)

    @rule(path=paths, data=payloads)
    def append(self, path, data):
        def op(r, p, d):
            def go():
                with open(r / p, "ab") as f:
                    return f.write(d)
            return outcome(go)
        self.both(op, path, data)

    @rule(path=paths, size=offsets)
    def truncate(self, path, size):
        self.both(lambda r, p, s: outcome(os.truncate, r / p, s), path, size)

    @rule(src=paths, dst=paths)
    def rename(self, src, dst):
        self.both(lambda r, s, d: outcome(os.rename, r / s, r / d), src, dst)

    @rule(path=paths)
    def unlink(self, path):
        self.both(lambda r, p: outcome(os.unlink, r / p), path)

    @rule(path=paths)
    def mkdir(self, path):
        self.both(lambda r, p: outcome(os.mkdir, r / p), path)

    @rule(path=paths)
    def rmdir(self, path):
        self.both(lambda r, p: outcome(os.rmdir, r / p), path)

    @rule(path=paths, off=offsets, size=st.integers(0, 70000))
    def read_range(self, path, off, size):
        def op(r, p, o, n):
            def go():
                fd = os.open(r / p, os.O_RDONLY)
                try:
                    return os.pread(fd, n, o)
                finally:
                    os.close(fd)
            return outcome(go)
        self.both(op, path, off, size)

    @rule(path=paths)
    def stat(self, path):
        def op(r, p):
            def go():
                st_ = os.stat(r / p)
                size = None if stat_mod.S_ISDIR(st_.st_mode) else st_.st_size  # dir sizes are per-fs
                return (st_.st_mode, size, st_.st_nlink)
            return outcome(go)
        self.both(op, path)

    @invariant()
    def trees_match(self):
        assert snapshot(self.roots[0], uncached=True) == snapshot(self.roots[1], uncached=False)

    def teardown(self):
        for root in self.roots:
            shutil.rmtree(root, ignore_errors=True)


def test_random_operations_match_tmpfs(mnt: Path):
    SideBySide.mount_dir = mnt
    run_state_machine_as_test(
        SideBySide,
        settings=settings(stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]),
    )
