"""Processes racing on a few names of a real mount with a small RAM budget:
files replaced whole (written at a temporary name, renamed over), renamed,
hard-linked, exchanged, deleted, read and mmapped, some held open while
they are deleted, published and evicted meanwhile. Every file carries its
own length and digest, so every read must find a whole one; none may fail
but for what the race itself explains (a name gone, a directory not empty).
Then the store holds what the mount does, and a restart shows it again.

Over a local store and over S3 (SeaweedFS on loopback). Seeded, but the
interleaving is the machine's: the outcome checked holds for every
interleaving."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import mmap
import multiprocessing
import os
import random
import time
from pathlib import Path

import pytest

from ckptfs.client import Client
from tests.mountutil import run_cli, start_mount, stop_mount

PATHS = ["a", "b", "c", "d0/a", "d0/b", "d1/a", "d1/b"]
SIZES = [0, 100, 70_000, 1 << 20, 5 << 20, 9 << 20]
OPS = ["put", "put", "put", "rename", "link", "unlink", "exchange", "read", "read", "mmap", "hold", "evict", "renamedir"]
WORKERS = 4
STEPS = 120
# What racing on shared names explains: gone, there already, not empty, not a
# directory, a directory, a directory into itself, busy
RACE = {errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR, errno.EINVAL, errno.EBUSY}
RENAME_EXCHANGE = 2

_libc = ctypes.CDLL(None, use_errno=True)


def whole(rnd: random.Random, n: int) -> bytes:
    body = rnd.randbytes(n)
    return len(body).to_bytes(8, "little") + hashlib.sha1(body).digest() + body


def is_whole(data: bytes) -> bool:
    return len(data) >= 28 and len(data) == 28 + int.from_bytes(data[:8], "little") and hashlib.sha1(data[28:]).digest() == data[8:28]


def exchange(a: Path, b: Path) -> None:
    if _libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def read_through_daemon(f) -> bytes:
    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return f.read()


def worker(root: Path, seed: int, problems) -> None:
    rnd = random.Random(seed)
    for k in range(STEPS):
        x, y = root / rnd.choice(PATHS), root / rnd.choice(PATHS)
        op = rnd.choice(OPS)
        try:
            if op == "put":
                tmp = root / f"tmp.{seed}.{k}"
                tmp.write_bytes(whole(rnd, rnd.choice(SIZES)))
                os.rename(tmp, x)
            elif op == "rename":
                os.rename(x, y)
            elif op == "link":
                os.link(x, y)
            elif op == "unlink":
                os.unlink(x)
            elif op == "exchange":
                exchange(x, y)
            elif op == "renamedir":
                os.rename(root / rnd.choice(["d0", "d1", "d2"]), root / rnd.choice(["d0", "d1", "d2"]))
            elif op == "read":
                with open(x, "rb") as f:
                    data = read_through_daemon(f)
                if not is_whole(data):
                    problems.append(f"{op} {x}: {len(data)} bytes, not a whole file")
            elif op == "mmap":
                with open(x, "rb") as f:
                    if os.fstat(f.fileno()).st_size:
                        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                            data = bytes(m)
                        if not is_whole(data):
                            problems.append(f"{op} {x}: {len(data)} bytes, not a whole file")
            elif op == "hold":  # a reader of a checkpoint that a rotation deletes
                with open(x, "rb") as f:
                    head = f.read(28)
                    time.sleep(rnd.random() * 0.2)
                    if rnd.random() < 0.5:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(x)
                    time.sleep(rnd.random() * 0.2)
                    data = head + read_through_daemon(f)
                if not is_whole(data):
                    problems.append(f"{op} {x}: {len(data)} bytes, not a whole file")
            elif op == "evict":
                Client(root).evict(root)
        except OSError as exc:
            if exc.errno not in RACE:
                problems.append(f"{op} {x} {y}: {exc}")


def files(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if ".ckptfs" in dirnames:
            dirnames.remove(".ckptfs")
        for name in filenames:
            p = Path(dirpath, name)
            out[str(p.relative_to(root))] = hashlib.sha1(p.read_bytes()).hexdigest()
    return out


def in_store(s3, bucket: str) -> dict[str, str]:
    """What an S3 store holds, as `files` tells a directory's (folder keys left out)."""
    return {key: hashlib.sha1(data).hexdigest() for key, data in s3.objects(bucket).items() if not key.endswith("/")}


@pytest.mark.parametrize(("store", "seed"), [("local", 1), ("local", 2), ("s3", 3)])
def test_racing_processes_read_whole_files_and_the_store_follows(tmp_path, request, store, seed):
    if store == "s3":  # loads there are whole GETs, moves copy and delete, exchanges go through hidden names
        s3 = request.getfixturevalue("s3")
        url = s3.bucket(f"racing{seed}")
        s3.keep_emptied_folders(f"racing{seed}")
        extra, options = ("--store", url, *s3.cli_options()), s3.cli_options()
    else:
        extra, options = (), []
    m = start_mount(tmp_path, memory_limit="24M", extra=extra)
    try:
        for d in ("d0", "d1"):
            m.path(d).mkdir()
        with multiprocessing.Manager() as manager:
            problems = manager.list()
            procs = [multiprocessing.Process(target=worker, args=(m.mountpoint, seed * 100 + i, problems)) for i in range(WORKERS)]
            for p in procs:
                p.start()
            try:
                for p in procs:
                    p.join(timeout=300)
                assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
            finally:
                for p in procs:  # one hung on the mount: stopped, not left behind
                    if p.is_alive():
                        p.kill()
            problems = list(problems)
        assert problems == []
        Client(m.mountpoint).flush(timeout=300)
        mine = files(m.mountpoint)
        assert all(is_whole(m.path(p).read_bytes()) for p in mine if not p.rpartition("/")[2].startswith("tmp."))
        assert (in_store(s3, f"racing{seed}") if store == "s3" else files(m.store)) == mine  # hard links: a copy per name
        r = run_cli("verify", str(m.mountpoint), *options)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        stop_mount(m)
    m = start_mount(tmp_path, memory_limit="24M", extra=extra)
    try:
        assert files(m.mountpoint) == mine
    finally:
        stop_mount(m)
