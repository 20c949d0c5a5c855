"""`ckptfs`: the command line. mount, umount and verify live here; the
commands that ask a running daemon (status, flush, prefetch, evict) in admin.py."""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, NoReturn

import click

from ckptfs import __version__, runtime
from ckptfs.client import CkptfsError, Client
from ckptfs.config import MountConfig, parse_store_options
from ckptfs.escape import EscapingFormatter, printable

from .admin import COMMANDS, echo_unpublished
from .advise import advise
from .paths import GivenPath, NamePattern, StoreURL
from .preflight import (
    PreflightError,
    check_cluster,
    check_cluster_url,
    check_fuse,
    check_log_file,
    check_mounted_ckptfs,
    check_mountpoint,
    check_no_daemon,
    check_not_in_a_store,
    check_places,
    check_port,
    check_spill_dir,
)
from .units import Number, counted, format_duration, format_size, parse_size

MOUNT_TIMEOUT_S = 60.0
UMOUNT_PROGRESS_S = 5.0  # while `umount` waits for the drain: a line this often
EXIT_STORE_CALLS = 4  # store calls a daemon may make after its drain (`exit_wait`)
EXIT_SLACK_S = 60.0  # and the rest of its exit (`exit_wait`)
EXIT_REPORT_SHOWN = 10  # files a mount's warning names of those its last daemon left unpublished
DEFAULT_REUSE_RAM = "25%"  # of the budget: a checkpoint or two kept warm; bounded so that evict returns RAM to the OS
MIN_MEMORY_LIMIT = 16 << 20  # 4 chunks of 4 MiB: less leaves nothing to work with
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_ROTATE_BYTES = 16 << 20  # the daemon's log moves to <log>.1 at this size,
LOG_BACKUPS = 4  # and this many older ones are kept: at most 80 MiB in all


def _fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"ckptfs: error: {printable(message)}", err=True)
    sys.exit(code)


class _Commands(click.Group):
    """Every mistake on the command line is one line on stderr, `ckptfs:
    error: ...`, and exit status 2 (click's own usage errors take three)."""

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "ckptfs"
            _fail(f"{' '.join(exc.format_message().split())} (see '{where} --help')", 2)
        except click.ClickException as exc:
            _fail(" ".join(exc.format_message().split()), exc.exit_code)
        except click.Abort:
            click.echo("ckptfs: interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptfs")
def main() -> None:
    """ckptfs: a RAM-backed checkpoint file system, persisted in the background."""
    runtime.raise_open_files_limit()  # the daemon's store walks, verify's


CLUSTER_ONLY = ("cluster_password_file", "node", "cluster_patience", "cluster_snapshot_every")  # mount's options that need --cluster


@main.command()
@click.argument("mountpoint", type=GivenPath())
@click.option("--store", "store_url", required=True, type=StoreURL(), metavar="URL", help="Durable store: a local directory or any fsspec URL (file://, s3://, gs://).")
@click.option("--memory-limit", default="50%", show_default=True, metavar="SIZE",
              help="RAM budget for file data: 512M, 8G, or a percentage of the memory this machine has (or its cgroup: a container's limit).")
@click.option("--reuse-ram", default=DEFAULT_REUSE_RAM, show_default=True, metavar="SIZE",
              help="Freed RAM (deleted, truncated or evicted files, blocks held for a reader of a file read in place) "
                   "kept for the next save to write into, which is "
                   "faster than fresh memory; the rest goes back to the OS at once. Within it, 32 MiB of fresh memory are made "
                   "ready ahead of a save's writes or a load's reads. A size or a percentage of the budget; 0 keeps none.")
@click.option("--foreground", "-f", is_flag=True, help="Stay in the foreground (logs go to stderr unless --log-file).")
@click.option("--log-file", type=GivenPath(dir_okay=False), help="Log here (default in background: the mount's runtime directory).")
@click.option("--log-level", default="INFO", show_default=True, type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--fsync", "fsync_mode", default="ram", show_default=True, type=click.Choice(["ram", "durable"]),
              help="ram: fsync returns at once (the data is in RAM). durable: fsync waits until the file is published to the store.")
@click.option("--drain-timeout", default=600.0, show_default=True, type=Number(0, 30 * 86400), metavar="S",
              help="On unmount or SIGTERM, wait this long for write-back to publish everything.")
@click.option("--store-timeout", default=60.0, show_default=True, type=Number(1, 86400), metavar="S",
              help="Deadline of one store call, plus 1 s per 4 MiB it moves; a call past it is abandoned and retried.")
@click.option("--store-option", "store_options", multiple=True, metavar="KEY=VALUE",
              help="An fsspec storage option, e.g. client_kwargs.endpoint_url=http://host:9000 (repeatable). "
                   "Secrets are better passed as JSON in $CKPTFS_STORE_OPTIONS, or the store's own variables (AWS_*).")
@click.option("--spill-dir", type=GivenPath(file_okay=False), metavar="DIR",
              help="Where a file too big for the RAM budget continues, on local disk (never the store: a store outage "
                   "must not fail a write) [default: /var/tmp].")
@click.option("--metrics-port", type=click.IntRange(1, 65535), metavar="N", help="Serve Prometheus metrics on this port (/metrics).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, metavar="ADDR",
              help="Address for --metrics-port (0.0.0.0: every interface).")
@click.option("--cluster", metavar="URL",
              help="Cluster mode: share one namespace with every daemon mounted with this Redis URL "
                   "(redis://HOST:PORT/DB, rediss:// for TLS) and the same --store. The password comes from "
                   "$CKPTFS_REDIS_PASSWORD or --cluster-password-file, never the URL on a shared machine.")
@click.option("--cluster-password-file", type=GivenPath(dir_okay=False), metavar="FILE", help="A file holding the Redis password.")
@click.option("--node", metavar="NAME", help="This node's name in the cluster (status and logs) [default: the host name].")
@click.option("--cluster-patience", default=10.0, show_default=True, type=Number(0, 86400), metavar="S",
              help="Cluster mode: how long a namespace change (mkdir, rename, unlink, ...) or a close keeps trying a Redis "
                   "that does not answer before it fails with EIO (a closed file's bytes stay in RAM and are published once "
                   "Redis answers). Give it more than a Redis failover takes.")
@click.option("--cluster-snapshot-every", default=10_000, show_default=True, type=click.IntRange(1), metavar="N",
              help="Cluster mode, on the node that publishes: keep a snapshot of the namespace in Redis every N changes, "
                   "and trim the log of changes before it (nodes that join later load the snapshot).")
@click.option("--marker", "markers", multiple=True, type=NamePattern(), metavar="GLOB",
              help="Also take files whose name matches GLOB (e.g. done, '*.complete') as completion markers, as the "
                   "built-in ones (.metadata, commit_success.txt, latest*, ...) are: such a file is not published while a file "
                   "in its directory tree failed for good, or while one closed before it was deleted or renamed in the mount "
                   "after it and that change has not reached the store yet (a rotation caught halfway); on an object store, "
                   "a directory moved in the mount gets its markers last. Give every node of a cluster the same (repeatable).")
@click.option("--oom-score-adj", default=-500, show_default=True, type=click.IntRange(-1000, 1000), metavar="N",
              help="The daemon's oom_score_adj (-1000 to 1000): when memory runs out, the kernel kills the process with the highest "
                   "score. The daemon holds the only copy of what it has not published, while a trainer killed instead restarts "
                   "from the daemon's RAM; lowering it needs root (or CAP_SYS_RESOURCE), otherwise it is left as it is.")
def mount(mountpoint: str, store_url: str, memory_limit: str, reuse_ram: str, foreground: bool, log_file: str | None, log_level: str,
          fsync_mode: str, drain_timeout: float, store_timeout: float, store_options: tuple[str, ...], spill_dir: str | None,
          metrics_port: int | None, metrics_host: str, cluster: str | None, cluster_password_file: str | None, node: str | None,
          cluster_patience: float, cluster_snapshot_every: int, markers: tuple[str, ...], oom_score_adj: int) -> None:
    """Mount a ckptfs file system at MOUNTPOINT, backed by the store at URL.

    Returns once the mount is live; the daemon keeps running in the background
    until `ckptfs umount MOUNTPOINT`.
    """
    from ckptfs.fs.memory import total_ram
    from ckptfs.writeback.backend import StoreError, absolute_url, open_store

    ready_fd: int | None = None  # in a daemon that `ckptfs mount` started: the pipe that command waits on

    def refuse(message: str, code: int) -> NoReturn:
        """Say why there is no mount: on stderr and, in a daemon that `ckptfs
        mount` started, on the pipe that command waits on."""
        if ready_fd is not None:
            os.write(ready_fd, f"{code} {printable(message)}\n".encode(errors="backslashreplace"))
        _fail(message, code)

    if cluster is None:  # a cluster option without --cluster: a mistake (a node of a cluster mounted alone?), not ignored
        ctx = click.get_current_context()
        given = [f"--{name.replace('_', '-')}" for name in CLUSTER_ONLY
                 if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
        if given:
            refuse(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for cluster mode: give --cluster URL too, "
                   f"or leave {'it' if len(given) == 1 else 'them'} out", 2)
    ram = total_ram()
    try:
        limit = parse_size(memory_limit, total=ram)
    except ValueError as exc:
        refuse(f"--memory-limit: {exc}", 2)
    if limit < MIN_MEMORY_LIMIT:
        refuse(f"--memory-limit {memory_limit} is {limit} bytes: the least is {MIN_MEMORY_LIMIT >> 20}M", 2)
    if limit > ram:
        refuse(f"--memory-limit {memory_limit} is more than the {format_size(ram)} of memory this machine (or its cgroup) has: "
               "the daemon would be killed for memory, with every file not yet published, before the budget sends saves "
               "to the store; give less (50% is the default)", 2)
    try:
        reuse = 0 if reuse_ram.strip() in ("0", "0%") else parse_size(reuse_ram, total=limit)
    except ValueError as exc:
        refuse(f"--reuse-ram: {exc}", 2)
    try:
        options = parse_store_options(store_options, os.environ.get("CKPTFS_STORE_OPTIONS"))
    except ValueError as exc:
        refuse(str(exc), 2)
    store_url = absolute_url(store_url)  # recorded for tools run from anywhere

    def preflight(daemon: bool) -> Path:
        """The checks a mount must pass; `daemon`: in the process that will
        serve it, which also holds the mount point for its life and checks
        the store and the cluster (`ckptfs mount` leaves those to the
        daemon it starts, which says why not on the pipe)."""
        try:
            if cluster is not None:
                check_cluster_url(cluster)
            check_fuse(load=daemon)
            if daemon:
                runtime.hold_mountpoint(runtime.resolved_to_mount(mountpoint))  # before the checks below, for the daemon's life
            _remove_stale(mountpoint)
            mp = check_mountpoint(mountpoint)
            check_places(mp, store_url, spill_dir, log_file)
            check_not_in_a_store(store_url)
            runtime.private_dir(mp)  # the daemon's details and default log go there: the user's own, or refused
            check_no_daemon(mp)
            _warn_of_last_exit(mp)
            if log_file is not None:
                check_log_file(log_file)
            if daemon:
                backend = open_store(store_url, options)
                if cluster is None:
                    check_no_daemon(mp, backend)
                else:
                    check_cluster(cluster, cluster_password_file, store_url)
            spill_warning = check_spill_dir(spill_dir)
            if spill_warning is not None:  # a daemon in the background has its log as stderr: there too
                click.echo(f"ckptfs: warning: {printable(spill_warning)}", err=True)
            if metrics_port is not None:
                check_port(metrics_host, metrics_port)
        except (PreflightError, StoreError, runtime.RuntimeDirError, runtime.MountpointBusy) as exc:
            refuse(str(exc), 2)
        return mp

    def serve_here(ready_on: int | None) -> NoReturn:
        """Be the daemon: check, mount, serve until unmounted; `ready_on`:
        the pipe to say "ok" on once the mount is live, or why not."""
        nonlocal ready_fd
        ready_fd = ready_on
        mp = preflight(daemon=True)
        config = MountConfig(mp, store_url, limit, min(reuse, limit), Path(log_file) if log_file else None,
                             log_level.upper(), fsync=fsync_mode, drain_timeout=drain_timeout, store_timeout=store_timeout,
                             storage_options=options, spill_dir=os.path.abspath(spill_dir) if spill_dir else None,
                             metrics_port=metrics_port, metrics_host=metrics_host, cluster=cluster,
                             cluster_password_file=os.path.abspath(cluster_password_file) if cluster_password_file else None,
                             node=node, cluster_patience=cluster_patience, cluster_snapshot_every=cluster_snapshot_every,
                             oom_score_adj=oom_score_adj, markers=markers)
        _setup_logging(config)
        from ckptfs.daemon.mount import serve

        def ready() -> None:
            nonlocal ready_fd
            if ready_fd is not None:
                os.write(ready_fd, b"ok\n")
                os.close(ready_fd)
                ready_fd = None

        try:
            code = serve(config, ready)
        except (RuntimeError, StoreError) as exc:  # the kernel refused the mount (pyfuse3.init), or the store could not be used
            logging.getLogger("ckptfs").error("cannot mount %s: %s", config.mountpoint, exc)
            refuse(f"cannot mount {config.mountpoint}: {exc}", 1)
        sys.exit(code)

    if foreground:
        serve_here(None)
    mp = preflight(daemon=False)
    follow = log_file is not None  # a log file the user named may be a symlink; the default one never is
    # The daemon (`serve_here`, forked below) checks and logs to this very file: the closures read it from here.
    log_file = os.path.abspath(log_file if log_file is not None else runtime.private_dir(mp) / "daemon.log")
    _start_daemon(mp, store_url, log_file, follow, serve_here)


def _remove_stale(mountpoint: str) -> None:
    """A mount whose daemon was killed or crashed is in the way of a new
    one, and of nothing else: this user's is removed, with a word. Only on
    proof: its daemon's details name a process that is gone (details lost,
    say to a cleaner of /tmp, prove nothing: the mount may be live)."""
    mp = os.path.realpath(mountpoint)  # lstat only: a dead mount answers ENOTCONN, never hangs
    if mp not in runtime.ckptfs_mounts() or runtime.mount_owner(mp) != os.getuid():
        return
    info = runtime.MountInfo.read(mp)
    if info is None or runtime.pid_alive(info.pid):
        return
    why = runtime.remove_stale(mp)
    if why is not None:
        raise PreflightError(f"{mp} is a ckptfs mount whose daemon is gone, and it could not be removed: {why}")
    click.echo(printable(f"ckptfs: {mp}: removed the stale mount its dead daemon left (killed or crashed: what it had not published went with it)"), err=True)


class DaemonLog(logging.handlers.RotatingFileHandler):
    """The daemon's log file, bounded: a job publishing millions of files
    logs a line for each, and the default place (/run) is often RAM. Where
    the daemon's stderr is that file (a mount in the background: a crash's
    traceback, faulthandler's), stderr follows it to each new file."""

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = LOG_ROTATE_BYTES, backups: int = LOG_BACKUPS) -> None:
        super().__init__(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", errors="backslashreplace")
        self._stderr_too = self.stream is not None and _same_file(2, self.stream.fileno())

    def doRollover(self) -> None:
        super().doRollover()
        if self._stderr_too and self.stream is not None:
            sys.stderr.flush()
            os.dup2(self.stream.fileno(), 2)


def _same_file(fd_a: int, fd_b: int) -> bool:
    try:
        return os.path.sameopenfile(fd_a, fd_b)
    except OSError:
        return False


def _setup_logging(config: MountConfig) -> None:
    handler: logging.Handler = DaemonLog(config.log_file) if config.log_file else logging.StreamHandler()
    handler.setFormatter(EscapingFormatter(LOG_FORMAT))
    logging.basicConfig(level=config.log_level, handlers=[handler], force=True)


def _start_daemon(mp: Path, store_url: str, log_file: str, follow: bool, serve_here: Callable[[int], NoReturn]) -> None:
    """Fork the daemon, which runs `serve_here` with its end of a pipe, and
    wait until it says the mount is live, or why not. A fork, not a new
    interpreter: the daemon starts with this command's imports and
    arguments (a restart over 100,000 files spent 0.2-0.3 s of its time
    starting a second interpreter and importing again)."""
    for fd in (0, 1, 2):  # one closed (`ckptfs mount ... >&-`): the pipe or the log must not take its number, the daemon's own
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # takes the lowest number free: that one
    r, w = os.pipe()
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    err = os.open(log_file, flags, 0o600)
    for stream in (sys.stdout, sys.stderr):  # None where it was closed at the start
        if stream is not None:
            stream.flush()
    pid = os.fork()
    if pid == 0:
        _be_the_daemon(r, w, err, serve_here)
    os.close(err)
    os.close(w)
    said = wait_ready(pid, r, MOUNT_TIMEOUT_S)
    os.close(r)
    if said == b"ok":
        click.echo(printable(f"ckptfs: mounted {mp} (store {store_url}, pid {pid}, log {log_file})"))
        return
    if said is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if str(mp) in runtime.all_mountpoints():
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False)
        _fail(f"the daemon did not mount {mp} within {MOUNT_TIMEOUT_S:.0f}s; see {log_file}")
    code, _, why = said.decode(errors="replace").partition(" ")
    if code.isdigit() and why.strip():  # the daemon refused, and said why (it checks the store and the cluster)
        click.echo(f"ckptfs: error: {why.strip()}", err=True)
        sys.exit(int(code))
    _fail(f"the daemon could not mount {mp}: {_last_error(log_file).removeprefix(f'cannot mount {mp}: ')}")


def _be_the_daemon(r: int, w: int, err: int, serve_here: Callable[[int], NoReturn]) -> NoReturn:
    """The forked daemon: its own session, no terminal, `err` (its log) as
    stderr; `serve_here` says on `w` when the mount is live, or why not."""
    code = 1
    try:
        os.close(r)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1):
            os.dup2(devnull, fd)
        os.dup2(err, 2)
        os.close(devnull)
        os.close(err)
        # Closed when the command started (`2>&-`): the daemon's are there
        # now, as a fresh interpreter's would be (faulthandler, tracebacks
        # and click write to sys.stderr).
        if sys.stdout is None:
            sys.stdout = open(1, "w", closefd=False)
        if sys.stderr is None:
            sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
        _close_inherited()
        serve_here(w)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:  # no unwinding into the command's frames: what an interpreter's exit would do, then out
        with contextlib.suppress(Exception):
            logging.shutdown()
            if sys.stderr is not None:
                sys.stderr.flush()
        os._exit(code)


def _close_inherited() -> None:
    """Close what this process inherited from its caller besides stdin,
    stdout and stderr: a daemon keeping it would keep, say, the caller's
    pipe open long after `ckptfs mount` returned, and a caller reading it to
    its end would hang. Python opens its own descriptors not inheritable:
    those stay."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            if fd > 2 and os.get_inheritable(fd):
                os.close(fd)


def wait_ready(pid: int, fd: int, timeout: float) -> bytes | None:
    """What the daemon, child process `pid`, said on pipe `fd`: b"ok" once
    its mount is live; `CODE WHY` when it would not mount; b"" when it
    exited without a word; None if it did none of these within `timeout`."""
    deadline = time.monotonic() + timeout
    said = b""
    while time.monotonic() < deadline:
        readable, _, _ = select.select([fd], [], [], 0.2)
        if readable:
            got = os.read(fd, 4096)
            said += got
            if said.startswith(b"ok"):
                return b"ok"
            if got:
                continue
            break  # end of file: the daemon is exiting; wait for it below
        if _exited(pid) and not select.select([fd], [], [], 0)[0]:
            return said
    while not _exited(pid):
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)
    return said


def _exited(pid: int) -> bool:
    """Child process `pid` has exited (and is reaped)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:  # reaped already
        return True


def _last_error(log_file: str) -> str:
    try:
        lines = [ln for ln in Path(log_file).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["no log"])[-1].removeprefix("ckptfs: error: ")  # the daemon's own stderr line


@main.command()
@click.argument("mountpoint", type=GivenPath())
@click.option("--timeout", type=click.FloatRange(min=0), metavar="S",
              help="Seconds to wait for the daemon to publish everything and exit [default: as long as it may take: "
                   "the daemon's --drain-timeout, then its last store calls]. It goes on publishing after; "
                   "umount again waits again, or says how it ended.")
def umount(mountpoint: str, timeout: float | None) -> None:
    """Unmount MOUNTPOINT and stop its daemon."""
    try:
        mp = check_mounted_ckptfs(mountpoint)
    except PreflightError as exc:
        draining = Client.draining(mountpoint)
        if draining is None:
            _say_how_it_ended(mountpoint)  # an umount before gave up waiting: how the daemon's drain ended
            _fail(str(exc), 2)
        # An earlier umount was interrupted (^C, a lost session, a timeout):
        # the daemon, unmounted, still publishes what it holds. Wait with it;
        # a second SIGTERM would make it stop waiting for the store.
        info, client = draining
        click.echo(printable(f"ckptfs: {info.mountpoint} is unmounted; its daemon (pid {info.pid}) is still publishing what it holds: "
                             f"waiting for it (see {info.log_file})"))
        _wait_until_exited(info, client, timeout)
        return
    owner = runtime.mount_owner(mp)
    if owner is not None and owner != os.getuid():
        _fail(f"{mp} was mounted by uid {owner}: only that user can unmount it with ckptfs "
              "(its daemon's details are in that user's runtime directory)", 2)
    info = runtime.MountInfo.read(mp)  # read once: a daemon exiting now removes it
    if info is None or not runtime.pid_alive(info.pid):  # what is left is a dead mount entry
        why = runtime.remove_stale(mp)
        if why is not None:
            _fail(f"{mp}: its daemon is not running, and the stale mount could not be removed: {why}", 1)
        click.echo(f"ckptfs: {printable(mp)}: daemon was not running (killed or crashed: what it had not published went with it); removed the stale mount")
        return
    os.kill(info.pid, signal.SIGTERM)
    click.echo(printable(f"ckptfs: unmounting {mp}; waiting for write-back to publish everything (see {info.log_file})"))
    _wait_until_exited(info, Client.unmounting(mp, timeout=2.0), timeout)


def _wait_until_exited(info: runtime.MountInfo, draining: Client, timeout: float | None) -> None:
    """Until the daemon, told to unmount, has published everything and
    exited (`timeout` None: as long as that may take, `exit_wait`); what it
    could not publish is an error."""
    wait = exit_wait(info) if timeout is None else timeout
    deadline = time.monotonic() + wait
    report_at = time.monotonic() + UMOUNT_PROGRESS_S
    while runtime.pid_alive(info.pid):
        if time.monotonic() > deadline:
            left = _left(draining)
            again = f"`ckptfs umount {info.mountpoint}` again waits for it, or says how it ended; see {info.log_file}"
            if left and left.nothing:
                _fail(f"gave up waiting after {wait:g}s: everything is published; the daemon (pid {info.pid}) is at its last store "
                      f"calls (the manifest index, its retirement), each given at most {info.store_timeout:g}s{left.failing}; {again}")
            until = (f"until it gives up on what is left in {format_duration(left.gives_up_in)}" if left and left.gives_up_in is not None
                     else f"for at most {info.drain_timeout:g}s after the unmount")
            _fail(f"gave up waiting after {wait:g}s{f': {left.what} left to publish{left.failing}' if left else ''}; the daemon "
                  f"(pid {info.pid}) goes on publishing, {until} (its --drain-timeout); {again}")
        if time.monotonic() >= report_at:  # a long drain (a slow or failing store) must not look hung
            if (left := _left(draining)) and left.nothing:  # (it said "still publishing: 0 namespace changes left", for a minute)
                click.echo(f"ckptfs: umount: everything is published; the daemon's last store calls (the manifest index, its "
                           f"retirement) are under way, each given at most {info.store_timeout:g}s{left.failing}", err=True)
            elif left:
                until = f"; the daemon gives up on it in {format_duration(left.gives_up_in)}" if left.gives_up_in is not None else ""
                click.echo(f"ckptfs: umount: still publishing: {left.what} left{left.failing}{until}", err=True)
            report_at = time.monotonic() + UMOUNT_PROGRESS_S
        time.sleep(0.05)
    report = runtime.exit_report_of(info)
    if report is None:
        _fail(f"the daemon (pid {info.pid}) exited without saying what it published (killed?): what it had not published "
              f"is lost; see {info.log_file}")
    runtime.mark_shown(info.mountpoint, report)
    _report(report, info.mountpoint)


def exit_wait(info: runtime.MountInfo) -> float:
    """How long a daemon told to unmount may take to exit: its drain, then
    its last store calls (the manifest index, its retirement), each within
    its deadline. Waiting less, `umount` gave up just before the daemon's
    drain did, and never said what it left unpublished."""
    return info.drain_timeout + EXIT_STORE_CALLS * info.store_timeout + EXIT_SLACK_S


def _report(report: runtime.ExitReport, mountpoint: str, when: str = "") -> None:
    """How the daemon's exit went (`when`: said of a report an umount
    before this one did not wait for)."""
    if report.unpublished:
        n = len(report.unpublished)
        echo_unpublished(f"ckptfs: error: {counted(n, 'file')} {'was' if n == 1 else 'were'} NOT published to the store{when}:", report.unpublished)
        sys.exit(1)
    click.echo(printable(f"ckptfs: unmounted {mountpoint}; everything is published{when}"))


def _warn_of_last_exit(mountpoint: str) -> None:
    """At a mount: if the mount point's last daemon left files unpublished
    and no umount said so (a SIGTERM from a job's end, `fusermount3 -u`,
    an umount that gave up waiting), a warning: they are lost with it."""
    report = runtime.read_exit_report(mountpoint)
    runtime.discard_exit_report(mountpoint)  # the new daemon's will take its place
    if report is None or report.shown or not report.unpublished:
        return
    echo_unpublished(f"ckptfs: warning: the last daemon of {mountpoint} exited{_at(report)} with {counted(len(report.unpublished), 'file')} NOT "
                     "published to the store (they went with it; its log says why):", report.unpublished, EXIT_REPORT_SHOWN)


def _say_how_it_ended(mountpoint: str) -> None:
    """At an `umount` of a mount point neither mounted nor draining: if its
    last daemon's exit report is still there (the umount that sent it off
    gave up waiting, or none was run: a SIGTERM, `fusermount3 -u`), say how
    that daemon's drain ended, and exit: 1 if it left files unpublished."""
    for path in dict.fromkeys((os.path.abspath(mountpoint), runtime.resolved_to_mount(mountpoint))):
        report = runtime.read_exit_report(path)
        if report is not None and not report.shown:
            runtime.mark_shown(path, report)
            _report(report, path, f" (its daemon exited{_at(report)}, not waited for by an umount)")
            sys.exit(0)


def _at(report: runtime.ExitReport) -> str:
    return "" if report.exited is None else f" at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(report.exited))}"


class _Left(NamedTuple):
    """What a draining daemon has left to publish."""

    what: str  # "3 files (1.2 GiB)", or namespace changes
    nothing: bool  # nothing is left: the daemon is at its last store calls (the manifest index, its retirement)
    failing: str  # "; failing: <the last error>", or ""
    gives_up_in: float | None  # seconds until its --drain-timeout gives up on it (None: not told)


def _left(draining: Client) -> _Left | None:
    """What the draining daemon has left to publish (None when it does not
    answer: it may be exiting)."""
    try:
        r = draining.status()
    except CkptfsError:
        return None
    t, until = r["totals"], r["mount"].get("draining_until")
    left = [c for state, c in t["by_state"].items() if state != "published"]
    n = sum(c["files"] for c in left)
    what = f"{counted(n, 'file')} ({format_size(sum(c['bytes'] for c in left))})" if n else counted(t["queue"], "namespace change")
    failing = f"; failing: {printable(t['last_error'])}" if t["failing"] and t["last_error"] else ""
    return _Left(what, not n and not t["queue"], failing, None if until is None else max(0.0, until - time.time()))


EXIT_CORRUPT, EXIT_MISSING, EXIT_EXTRA = 8, 16, 32


@main.command()
@click.argument("target", type=StoreURL(), metavar="STORE_URL|MOUNTPOINT")
@click.argument("path", required=False, default="")
@click.option("--store-option", "store_options", multiple=True, metavar="KEY=VALUE", help="An fsspec storage option (as for mount).")
def verify(target: str, path: str, store_options: tuple[str, ...]) -> None:
    """Re-read published files from the store and check size and xxh3-128
    against the manifest. Works with no daemon running.

    Exit status: 0 all good; otherwise the sum of 8 (corrupt files, or
    files the store fails to read), 16 (recorded but missing) and 32 (in
    the store but not in the manifest); 2 for bad input; 1 if the store
    fails (unreachable, or not readable by this user).
    """
    from ckptfs.writeback.backend import META, StoreError, local_root, open_store
    from ckptfs.writeback.verify import verify as run_verify

    url = target
    if (mp := runtime.resolved_to_mount(target)) in runtime.ckptfs_mounts():
        info = runtime.MountInfo.read(mp)
        if info is None:
            _fail(f"{target} is a ckptfs mount but its daemon's details are gone; pass the store URL instead", 2)
        url = info.store_url
    try:
        options = parse_store_options(store_options, os.environ.get("CKPTFS_STORE_OPTIONS"))
        backend = open_store(url, options, create=False)
    except (ValueError, StoreError) as exc:
        if url != target and not options and local_root(url) is None:
            _fail(f"{exc} (a mount keeps no store credentials: give its --store-option values again, or set $CKPTFS_STORE_OPTIONS)", 2)
        _fail(str(exc), 2)
    if not backend.exists(META):
        _fail(f"{url} is not a ckptfs store (it has no {META}/): neither a store a ckptfs mount ever used nor a ckptfs mount", 2)
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        _fail(f"{path}: a PATH in the store cannot go up ('..'): it names a place in the store, from its top", 2)
    prefix = "/".join(parts)
    try:
        report = _verify_with_progress(run_verify, backend, prefix)
    except PermissionError as exc:
        _fail(f"the store {url} could not be verified: {exc} (verify as the user the daemon runs as, or as root)")
    except OSError as exc:
        _fail(f"the store {url} failed while it was verified: {exc}")
    if prefix and not (report.ok or report.corrupt or report.missing or report.extra):
        _fail(f"{path}: no such file or directory in the store {url} or its manifest", 2)
    for p, why in report.corrupt:
        click.echo(f"CORRUPT  {printable(p)}: {why}")
    for p in report.missing:
        click.echo(f"MISSING  {printable(p)}: recorded in the manifest, not in the store")
    for p in report.extra:
        click.echo(f"EXTRA    {printable(p)}: in the store, not in the manifest (not written by ckptfs, or a crash between steps)")
    click.echo(f"{len(report.ok)} ok, {len(report.corrupt)} corrupt, {len(report.missing)} missing, {len(report.extra)} extra ({printable(url)})")
    code = (EXIT_CORRUPT if report.corrupt else 0) | (EXIT_MISSING if report.missing else 0) | (EXIT_EXTRA if report.extra else 0)
    sys.exit(code)


def _verify_with_progress(run_verify, backend, prefix: str):
    if not sys.stderr.isatty():
        return run_verify(backend, prefix)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("verifying", total=None)
        return run_verify(backend, prefix, lambda p, size: bar.update(task, advance=1, description=f"verifying {p}"))


for _command in (*COMMANDS, advise):
    main.add_command(_command)

if __name__ == "__main__":
    main()
