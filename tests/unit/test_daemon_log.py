"""The daemon's log file."""

import subprocess
import sys


def test_the_daemon_log_is_bounded_and_stderr_follows_it(tmp_path):
    """A daemon publishing millions of files logs a line for each; its log
    (by default in /run, often RAM) grew without bound. It rotates, keeping
    a few older files; the daemon's stderr, where it is that file (a crash's
    traceback), moves to each new one."""
    log = tmp_path / "daemon.log"
    script = f"""
import logging, os, sys
from ckptfs.tools.cli import DaemonLog
h = DaemonLog({str(log)!r}, max_bytes=2000, backups=2)
logging.basicConfig(level=logging.INFO, handlers=[h], force=True)
for i in range(300):
    logging.getLogger("x").info("line %d of the daemon's log", i)
print("on stderr after the rotations", file=sys.stderr, flush=True)
"""
    with open(log, "ab") as err:
        subprocess.run([sys.executable, "-c", script], stderr=err, check=True)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["daemon.log", "daemon.log.1", "daemon.log.2"], files
    assert all((tmp_path / f).stat().st_size <= 2100 for f in files)
    text = log.read_text()
    assert "line 299 of" in text and "on stderr after the rotations" in text


def test_a_reply_the_kernel_no_longer_waits_for_is_not_an_error(caplog):
    """A file closed just before a lazy unmount: its release reached the
    daemon, the unmount ended the connection, and the reply failed with
    ENOENT. pyfuse3 logged that as an ERROR (a CI run failed on it) though
    nothing was lost; libfuse stays silent. Kept at DEBUG; other failed
    replies stay errors."""
    import errno
    import logging
    import os

    from ckptfs.daemon.mount import quiet_gone_replies

    quiet_gone_replies()
    quiet_gone_replies()  # a second mount in one process adds no second filter
    pyfuse3_log = logging.getLogger("pyfuse3")
    assert len(pyfuse3_log.filters) == 1
    with caplog.at_level(logging.INFO):
        pyfuse3_log.error("fuse_release(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT))
        pyfuse3_log.error("fuse_read(): fuse_reply_* failed with %s", os.strerror(errno.EIO))
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "fuse_read(): fuse_reply_* failed with Input/output error")]
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        pyfuse3_log.error("fuse_release(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT))
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("DEBUG", "fuse_release(): fuse_reply_* failed with No such file or directory")]


def test_a_record_of_many_lines_is_written_a_line_each_with_its_prefix_and_escaped():
    """The files one group commit published are logged as one record (one
    write to the log, not one per file: see the publisher's test). The
    formatter writes each of its lines as a line of its own, with the
    record's time, level and logger, each escaped: a name in it can no more
    forge a log line than in a record of its own."""
    import logging

    from ckptfs.tools.cli import LOG_FORMAT

    from ckptfs.escape import EscapingFormatter

    lines = ["published a (1 bytes)", "published bad\udcff\nERROR forged (2 bytes)", "published c (3 bytes)"]
    record = logging.LogRecord("ckptfs.writeback.engine", logging.INFO, __file__, 1, "%s", ("\n".join(lines),), None)
    record.lines = lines
    out = EscapingFormatter(LOG_FORMAT).format(record).split("\n")
    assert len(out) == 3
    prefix = out[0][: out[0].index("published")]
    assert prefix.endswith(" INFO ckptfs.writeback.engine: ")
    assert out == [prefix + "published a (1 bytes)", prefix + "published bad\\xff\\nERROR forged (2 bytes)", prefix + "published c (3 bytes)"]
    plain = logging.LogRecord("x", logging.INFO, __file__, 1, "one %s", ("line\nforged",), None)
    assert EscapingFormatter(LOG_FORMAT).format(plain).endswith(" INFO x: one line\\nforged")
