"""POSIX behaviour on a real mount: every row of compat-matrix.md."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.mountutil import drop_caches, read_uncached, run_cli, start_mount, stop_mount


def test_create_trunc_and_sequential_writes(mnt: Path):
    p = mnt / "f"
    p.write_bytes(b"x" * 100_000)
    with open(p, "wb") as f:  # O_TRUNC through the atomic-open path
        f.write(b"abc")
    assert read_uncached(p) == b"abc"
    subprocess.run(f"echo hi > {p}", shell=True, check=True)
    assert read_uncached(p) == b"hi\n"


def test_o_excl(mnt: Path):
    p = mnt / "lock"
    os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    with pytest.raises(FileExistsError):
        os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600


def test_o_append(mnt: Path):
    p = mnt / "progress.txt"
    for i in range(3):
        with open(p, "a+") as f:
            f.write(f"line {i}\n")
    assert read_uncached(p) == b"line 0\nline 1\nline 2\n"


def test_o_direct_accepted(mnt: Path):
    p = mnt / "direct"
    buf = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
    buf.write(b"d" * (1 << 20))
    fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    try:
        assert os.write(fd, buf) == 1 << 20
    finally:
        os.close(fd)
    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    try:
        out = mmap.mmap(-1, 1 << 20)
        assert os.readv(fd, [out]) == 1 << 20
        assert out[:] == b"d" * (1 << 20)
    finally:
        os.close(fd)


def test_pwrite_at_offsets_and_sparse_extension(mnt: Path):
    p = mnt / "sparse"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.pwrite(fd, b"tail", 10 << 20)
        os.pwrite(fd, b"head", 0)
        os.pwrite(fd, b"mid", 5 << 20)
    finally:
        os.close(fd)
    data = read_uncached(p)
    assert len(data) == (10 << 20) + 4
    assert data[:4] == b"head" and data[5 << 20 : (5 << 20) + 3] == b"mid" and data[-4:] == b"tail"
    assert data[4 : 5 << 20] == bytes((5 << 20) - 4)


def test_ftruncate_grow_and_shrink(mnt: Path):
    p = mnt / "t"
    with open(p, "wb") as f:
        f.write(b"0123456789")
        f.truncate(4)
        f.truncate(1 << 20)  # safetensors set_len before writing
        f.seek(100)
        f.write(b"x")
    data = read_uncached(p)
    assert len(data) == 1 << 20 and data[:4] == b"0123" and data[4:100] == bytes(96) and data[100:101] == b"x"


def test_huge_truncate_is_sparse(mnt: Path, shared_mount):
    p = mnt / "huge"
    subprocess.run(["truncate", "-s", "999999999999999", str(p)], check=True)
    assert p.stat().st_size == 999999999999999
    assert p.stat().st_blocks == 0
    with open(p, "rb") as f:
        f.seek(10**14)
        assert f.read(4096) == bytes(4096)
    p.unlink()
    assert os.path.ismount(shared_mount.mountpoint)


def test_fsync_file_and_directory(mnt: Path):
    p = mnt / "f"
    with open(p, "wb") as f:
        f.write(b"data")
        f.flush()
        os.fsync(f.fileno())
    dfd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def test_rename_file_over_existing(mnt: Path):
    (mnt / ".metadata").write_bytes(b"old")
    (mnt / ".metadata.tmp").write_bytes(b"new")
    os.replace(mnt / ".metadata.tmp", mnt / ".metadata")
    assert read_uncached(mnt / ".metadata") == b"new"
    assert not (mnt / ".metadata.tmp").exists()


def test_rename_directory(mnt: Path):
    tmp = mnt / "100.orbax-checkpoint-tmp-1"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "sub" / "x").write_bytes(b"x")
    os.rename(tmp, mnt / "100")
    assert read_uncached(mnt / "100" / "sub" / "x") == b"x"
    assert not tmp.exists()


def test_rename_errors_match_linux(mnt: Path):
    (mnt / "d").mkdir()
    (mnt / "d" / "x").write_bytes(b"")
    (mnt / "e").mkdir()
    (mnt / "f").write_bytes(b"")
    with pytest.raises(OSError) as e:
        os.rename(mnt / "e", mnt / "d")
    assert e.value.errno == errno.ENOTEMPTY
    with pytest.raises(IsADirectoryError):
        os.rename(mnt / "f", mnt / "e")
    with pytest.raises(NotADirectoryError):
        os.rename(mnt / "e", mnt / "f")
    with pytest.raises(OSError) as e:
        os.rename(mnt / "d", mnt / "d" / "inside")
    assert e.value.errno == errno.EINVAL


def test_unlink_and_rmtree(mnt: Path):
    for step in range(3):
        d = mnt / f"checkpoint-{step}"
        (d / "sub").mkdir(parents=True)
        for i in range(5):
            (d / f"shard{i}.bin").write_bytes(os.urandom(1000))
    shutil.rmtree(mnt / "checkpoint-0")
    assert sorted(p.name for p in mnt.iterdir()) == ["checkpoint-1", "checkpoint-2"]
    with pytest.raises(OSError) as e:
        os.rmdir(mnt / "checkpoint-1")
    assert e.value.errno == errno.ENOTEMPTY


def test_unlink_open_file_keeps_data(mnt: Path):
    p = mnt / "f"
    payload = os.urandom(3 << 20)
    p.write_bytes(payload)
    with open(p, "rb") as f:
        p.unlink()
        assert not p.exists()
        drop_caches()
        assert f.read() == payload


def _read_rest_uncached(f) -> bytes:
    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the reads reach the daemon
    return f.read()


def _delete_or_replace(mnt: Path, p: Path, how: str) -> None:
    """`p` deleted (`unlink`) or replaced by another file (`replace`), and
    the store's copy of it gone after a flush."""
    if how == "unlink":
        p.unlink()
    else:
        (mnt / "new").write_bytes(b"new")
        os.replace(mnt / "new", p)
    assert run_cli("flush", str(mnt)).returncode == 0


@pytest.mark.parametrize("how", ["unlink", "replace"])
@pytest.mark.parametrize("size", [6_000_000, 24 << 20], ids=["loaded-into-ram", "read-in-place"])
def test_a_file_deleted_while_open_and_in_the_store_only_stays_readable(mnt: Path, how, size):
    """A reader holds a published file open while it is evicted (RAM ran
    short, `ckptfs evict`, or never loaded since a restart) and deleted or
    replaced in the mount (a rotation deleting the checkpoint a process
    still reads): the store's copy, its only one, was deleted with its last
    name, and the reads after failed with EIO ("its data is in neither RAM
    nor the store"). It comes back to RAM before the store's copy goes."""
    p = mnt / "ckpt.bin"
    payload = os.urandom(size)
    p.write_bytes(payload)
    assert run_cli("flush", str(mnt)).returncode == 0
    with open(p, "rb") as f:
        head = f.read(10)
        r = run_cli("evict", str(p))
        assert r.returncode == 0 and "evicted 1 file" in r.stdout, r.stdout + r.stderr
        _delete_or_replace(mnt, p, how)
        assert head + _read_rest_uncached(f) == payload


@pytest.mark.parametrize("how", ["unlink", "replace"])
def test_a_file_read_in_place_and_deleted_while_open_is_not_copied_back(fresh_mount, how):
    """A large evicted file in a local store is read in place (from the
    store's file), then deleted or replaced in the mount while a process
    holds it open: the descriptor of the store file keeps its bytes when
    the store's name goes, so write-back goes on without copying the file
    into RAM first (it used to, and waited for the copy). The reads go on,
    and a write through the file reopened (`/proc/self/fd`) loads it from
    that descriptor."""
    from tests.integration.test_admin import status_json
    from tests.storeutil import wait_until

    mnt = fresh_mount.mountpoint
    p = mnt / "ckpt.bin"
    payload = bytearray(os.urandom(24 << 20))
    p.write_bytes(payload)
    assert run_cli("flush", str(mnt)).returncode == 0
    assert run_cli("evict", str(p)).returncode == 0
    with open(p, "rb") as f:
        assert _read_rest_uncached(f) == payload  # read in place
        # (its load is counted once over, just after its last block is served)
        wait_until(lambda: status_json(mnt)["totals"]["counters"]["loads"] == 1, 10, "the reader's load counted")
        _delete_or_replace(mnt, p, how)
        assert status_json(mnt)["totals"]["counters"]["loads"] == 1  # and nothing was copied back
        f.seek(0)
        assert _read_rest_uncached(f) == payload
        with open(f"/proc/self/fd/{f.fileno()}", "r+b") as w:
            w.seek(5 << 20)
            w.write(b"written after the delete")
        payload[5 << 20 : (5 << 20) + 24] = b"written after the delete"
        f.seek(0)
        assert _read_rest_uncached(f) == payload
    assert run_cli("flush", str(mnt)).returncode == 0
    assert sorted(x.name for x in fresh_mount.store.iterdir() if x.name != ".ckptfs") == ([] if how == "unlink" else ["ckpt.bin"])


def test_a_file_deleted_while_open_is_not_evicted_to_make_room(tmp_path):
    """A file deleted while open, in RAM: its store copy goes with its name,
    so RAM must keep it; making room for other files evicted it, and its
    reader got EIO."""
    m = start_mount(tmp_path, memory_limit="24M")
    try:
        p = m.path("old.bin")
        payload = os.urandom(5 << 20)
        p.write_bytes(payload)
        assert run_cli("flush", str(m.mountpoint)).returncode == 0
        with open(p, "rb") as f:
            head = f.read(10)
            p.unlink()
            assert run_cli("flush", str(m.mountpoint)).returncode == 0
            for i in range(6):  # three times the budget: published files are evicted for room
                m.path(f"new{i}.bin").write_bytes(os.urandom(12 << 20))
            assert run_cli("flush", str(m.mountpoint)).returncode == 0
            assert head + _read_rest_uncached(f) == payload
    finally:
        stop_mount(m)


def test_replace_mmapped_file(mnt: Path):
    p = mnt / "weights"
    payload = os.urandom(2 << 20)
    p.write_bytes(payload)
    with open(p, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    (mnt / "weights.tmp").write_bytes(b"new")
    os.replace(mnt / "weights.tmp", p)
    drop_caches()
    assert m[:] == payload
    m.close()
    assert read_uncached(p) == b"new"


def test_mmap_shared_read_and_private(mnt: Path):
    p = mnt / "m"
    payload = os.urandom(5 << 20)
    p.write_bytes(payload)
    drop_caches()
    with open(p, "rb") as f:
        shared = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        private = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    assert shared[:] == payload and private[:] == payload
    shared.close()
    private.close()


def test_mmap_shared_write(mnt: Path):
    p = mnt / "rw"
    p.write_bytes(bytes(1 << 20))
    with open(p, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
        m[10:15] = b"hello"
        m.flush()
        m.close()
    drop_caches()
    assert read_uncached(p)[10:15] == b"hello"


def test_symlink_readlink(mnt: Path):
    (mnt / "epoch=3.ckpt").write_bytes(b"ckpt")
    os.symlink("epoch=3.ckpt", mnt / "last.ckpt")
    assert os.readlink(mnt / "last.ckpt") == "epoch=3.ckpt"
    assert (mnt / "last.ckpt").read_bytes() == b"ckpt"
    assert (mnt / "last.ckpt").is_symlink()


def test_xattrs(mnt: Path):
    p = mnt / "f"
    p.write_bytes(b"")
    os.setxattr(p, "user.k", b"v")
    assert os.getxattr(p, "user.k") == b"v"
    assert "user.k" in os.listxattr(p)
    os.removexattr(p, "user.k")
    with pytest.raises(OSError) as e:
        os.getxattr(p, "user.k")
    assert e.value.errno == errno.ENODATA
    shutil.copy2(p, mnt / "g")  # Lightning copies with copystat


def test_flock_and_fcntl_locks(mnt: Path):
    p = mnt / "manifest.ocdbt.__lock"
    with open(p, "w") as a, open(p, "w") as b:
        fcntl.flock(a, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):
            fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(a, fcntl.LOCK_UN)
        fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.lockf(a, fcntl.LOCK_EX | fcntl.LOCK_NB)  # POSIX locks are per process


def test_statfs_reports_budget_and_namemax(mnt: Path):
    st = os.statvfs(mnt)
    assert st.f_namemax == 255
    assert st.f_blocks * st.f_frsize == 4 << 30
    before = st.f_bfree
    (mnt / "f").write_bytes(b"x" * (8 << 20))
    assert os.statvfs(mnt).f_bfree < before
    assert shutil.disk_usage(mnt).total == 4 << 30


def test_the_mount_reads_ahead_as_set(mnt: Path):
    """The kernel's read-ahead of the mount (one value per mount, taken by
    each open): the daemon sets it once the mount is live."""
    from ckptfs.daemon.mount import READ_AHEAD_KB

    st = os.stat(mnt)
    with open(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb") as f:
        assert int(f.read()) == READ_AHEAD_KB


def test_name_and_path_too_long(mnt: Path):
    with pytest.raises(OSError) as e:
        (mnt / ("a" * 256)).write_bytes(b"")
    assert e.value.errno == errno.ENAMETOOLONG
    (mnt / ("a" * 255)).write_bytes(b"")
    with pytest.raises(OSError) as e:
        os.stat(str(mnt) + ("/" + "b" * 200) * 25)
    assert e.value.errno == errno.ENAMETOOLONG


def test_utimens_chmod_chown_ctime(mnt: Path):
    p = mnt / "f"
    p.write_bytes(b"x")
    os.utime(p, ns=(1_000_000_123, 2_000_000_456))
    st = p.stat()
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_123, 2_000_000_456)
    ctime = st.st_ctime_ns
    time.sleep(0.01)
    os.chmod(p, 0o640)
    os.chown(p, 1234, 5678)
    st = p.stat()
    assert stat.S_IMODE(st.st_mode) == 0o640 and (st.st_uid, st.st_gid) == (1234, 5678)
    assert st.st_ctime_ns > ctime


def test_stable_inodes_nlink_and_dir_mtime(mnt: Path):
    d = mnt / "d"
    d.mkdir()
    ino = d.stat().st_ino
    assert d.stat().st_nlink == 2
    (d / "sub").mkdir()
    assert d.stat().st_nlink == 3
    m0 = d.stat().st_mtime_ns
    time.sleep(0.01)
    (d / "f").write_bytes(b"")
    m1 = d.stat().st_mtime_ns
    time.sleep(0.01)
    (d / "f").unlink()
    assert m0 < m1 < d.stat().st_mtime_ns
    assert d.stat().st_ino == ino
    f = mnt / "file"
    f.write_bytes(b"")
    os.link(f, mnt / "hard")
    assert f.stat().st_nlink == 2 and f.stat().st_ino == (mnt / "hard").stat().st_ino
    assert os.path.samestat(f.stat(), (mnt / "hard").stat())


def test_mkfifo_and_mknod(mnt: Path):
    os.mkfifo(mnt / "fifo")
    assert stat.S_ISFIFO((mnt / "fifo").stat().st_mode)


def test_readdir_during_changes(mnt: Path):
    for i in range(300):
        (mnt / f"f{i:03d}").write_bytes(b"")
    seen = []
    with os.scandir(mnt) as it:
        for n, entry in enumerate(it):
            seen.append(entry.name)
            if n == 10:
                for i in range(250, 300):
                    (mnt / f"f{i:03d}").unlink()
    assert len(seen) == len(set(seen))
    assert {f"f{i:03d}" for i in range(11, 250)} <= set(seen)
    assert sorted(os.listdir(mnt)) == [f"f{i:03d}" for i in range(250)]


def test_a_listing_shows_dot_and_dot_dot(mnt: Path):
    """`ls -a` shows "." and ".." (the directory and its parent), as on a
    local file system; the kernel takes no reference to either, so the
    directories listed are freed all the same once removed."""
    free = os.statvfs(mnt).f_ffree
    d = mnt / "p" / "d"
    d.mkdir(parents=True)
    (d / "f").write_bytes(b"")
    listed = subprocess.run(["ls", "-a1i", str(d)], capture_output=True, text=True, check=True).stdout.split()
    assert dict(zip(listed[1::2], map(int, listed[0::2]), strict=True)) == {
        ".": d.stat().st_ino, "..": d.parent.stat().st_ino, "f": (d / "f").stat().st_ino}
    assert os.listdir(d) == ["f"]
    shutil.rmtree(mnt / "p")
    drop_caches()
    assert os.statvfs(mnt).f_ffree == free


def test_full_length_reads(mnt: Path):
    p = mnt / "big"
    payload = os.urandom(9 << 20)
    p.write_bytes(payload)
    drop_caches()
    with open(p, "rb", buffering=0) as f:
        assert len(f.read(7 << 20)) == 7 << 20


def test_standard_tools(mnt: Path, tmp_path: Path):
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "f").write_bytes(os.urandom(100_000))
    os.symlink("b/f", src / "a" / "link")
    subprocess.run(["cp", "-a", str(src), str(mnt / "copy")], check=True)
    subprocess.run(["tar", "-C", str(mnt), "-cf", str(tmp_path / "t.tar"), "copy"], check=True)
    subprocess.run(["tar", "-C", str(mnt), "-xf", str(tmp_path / "t.tar"), "--transform", "s/copy/untar/"], check=True)
    r = subprocess.run(["diff", "-r", "--no-dereference", str(src), str(mnt / "untar")], capture_output=True)
    assert r.returncode == 0, r.stdout


def test_budget_exhaustion_spills_to_disk_with_a_log_line(tmp_path: Path):
    m = start_mount(tmp_path, memory_limit="16M")
    m.allowed_log_errors += ["RAM budget full"]  # a WARNING: the write goes on, on disk
    try:
        payload = os.urandom(32 << 20)
        m.path("big").write_bytes(payload)  # twice the budget: continues on disk
        assert "RAM budget full" in m.log_text() and " ERROR " not in m.log_text()
        assert read_uncached(m.path("big")) == payload
        m.path("small").write_bytes(bytes(4 << 20))
    finally:
        stop_mount(m)
    assert not m.unexpected_log_errors()


def test_mount_serves_other_users_with_kernel_permission_checks():
    base = Path(tempfile.mkdtemp(prefix="ckptfs-perm-"))
    os.chmod(base, 0o755)  # pytest's own temp root is private to root
    m = start_mount(base)
    try:
        os.chmod(m.mountpoint, 0o755)
        m.path("private").write_bytes(b"secret")
        os.chmod(m.path("private"), 0o600)
        m.path("public").write_bytes(b"hello")
        r = subprocess.run(["cat", str(m.path("private"))], capture_output=True, user=65534)
        assert r.returncode != 0 and b"Permission denied" in r.stderr
        r = subprocess.run(["cat", str(m.path("public"))], capture_output=True, user=65534)
        assert r.returncode == 0 and r.stdout == b"hello"
        r = subprocess.run(["touch", str(m.path("new"))], capture_output=True, user=65534)
        assert r.returncode != 0  # the root directory is 0755, owned by root
    finally:
        stop_mount(m)
        shutil.rmtree(base, ignore_errors=True)


def test_status_of_daemon_after_errors_is_healthy(shared_mount):
    """After every test above (errors included), the mount still serves."""
    assert os.path.ismount(shared_mount.mountpoint)
    assert run_cli("--version").returncode == 0
