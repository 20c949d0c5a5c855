"""Set-user-ID and set-group-ID bits go as on Linux file systems: a write or
an O_TRUNC by a process without CAP_FSETID clears them (pjdfstest chmod/12.t),
and a restart never brings one back on a file whose owner it cannot."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from tests.mountutil import start_mount, stop_mount

NOBODY = 65534


def as_nobody(directory, name: str, flags: int, data: bytes = b"") -> None:
    """Open `name` in `directory` as nobody, relative to a descriptor root
    opened (the test's temporary directories are not searchable by nobody)."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    code = f"import os; fd = os.open({name!r}, {flags}, dir_fd={dfd}); os.write(fd, {data!r}); os.close(fd)"
    try:
        r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c", code],
                           pass_fds=(dfd,), capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        os.close(dfd)
    assert r.returncode == 0, r.stderr


def make(path, mode: int) -> None:
    path.write_bytes(b"#!/bin/sh\n")
    os.chmod(path, mode)


def test_a_write_by_a_process_without_cap_fsetid_clears_set_id_bits(mnt):
    d = mnt / "setid"
    d.mkdir()
    os.chmod(d, 0o777)
    for name, mode in (("write", 0o6777), ("trunc", 0o6777), ("root", 0o6777), ("sgid_no_x", 0o2666)):
        make(d / name, mode)
    # write through an O_WRONLY descriptor (the mount's direct I/O path)
    as_nobody(d, "write", os.O_WRONLY, b"x")
    assert stat.S_IMODE(os.stat(d / "write").st_mode) == 0o777
    # open(O_TRUNC) alone
    as_nobody(d, "trunc", os.O_WRONLY | os.O_TRUNC)
    assert stat.S_IMODE(os.stat(d / "trunc").st_mode) == 0o777
    # set-group-ID without group execute (mandatory locking) stays, as on Linux
    as_nobody(d, "sgid_no_x", os.O_WRONLY, b"x")
    assert stat.S_IMODE(os.stat(d / "sgid_no_x").st_mode) == 0o2666
    # root has CAP_FSETID: its writes keep them
    fd = os.open(d / "root", os.O_WRONLY)
    os.write(fd, b"y")
    os.close(fd)
    assert stat.S_IMODE(os.stat(d / "root").st_mode) == 0o6777


def test_a_restart_does_not_bring_back_set_id_bits_without_their_owner(tmp_path):
    m = start_mount(tmp_path)
    try:
        p = m.mountpoint / "tool"
        make(p, 0o4755)
        os.chown(p, NOBODY, NOBODY)
        os.chmod(p, 0o4755)  # chown cleared it; set it again, owned by nobody
    finally:
        stop_mount(m)
    m = start_mount(tmp_path)
    try:
        st = os.stat(m.mountpoint / "tool")
        assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID) or st.st_uid == NOBODY  # never setuid root
    finally:
        stop_mount(m)
