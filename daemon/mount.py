"""Mount lifecycle: mount, serve until unmounted or signalled, unmount."""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import gc
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pyfuse3
import trio
from ckptfs.fs.memory import MemoryPool
from ckptfs.fs.ops import Operations
from ckptfs.fs.tree import InodeTree
from ckptfs.writeback.backend import StoreError, new_daemon_id, open_store
from ckptfs.writeback.calls import Deadlines
from ckptfs.writeback.engine import Engine
from ckptfs.writeback.journal import FileGen, Op, kind
from ckptfs.writeback.publisher import MARKERS

from ckptfs import runtime
from ckptfs.config import DEFAULT_SPILL_DIR, MountConfig

from . import fuseloop, status, tasks
from .control import ControlServer
from .metrics import Metrics

if TYPE_CHECKING:
    from ckptfs.cluster.node import ClusterNode

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 1e-4  # see `serve`
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # unmount and drain (see `_Signals`)

CLOSED_QUIET_S = 2.0  # a file closed while the open file lives on (InodeTree.closed) is sealed once unwritten this long
# The mount's read-ahead. A file in RAM mapped and touched (torch.load with
# mmap=True, safetensors: a trainer's reload after its crash) came 1.2-1.3x
# as fast at 1 MiB as at 4 MiB, side by side; after a restart, a torch.load
# did not move, and an mmap load of a file read from the store was ~8% slower
# (the reader asks for the next blocks later). See bench/RESULTS.md.
READ_AHEAD_KB = 1024


def fuse_options(name: str) -> set[str]:
    # The option string is comma-separated: a comma in the name (from the store URL) would split it;
    # and pyfuse3 encodes it as ASCII (a store at /data/José failed the mount).
    name = "".join(c if c.isprintable() and c.isascii() and c not in ",\\" else "_" for c in name)
    options = set(pyfuse3.default_options) | {f"fsname={name}", "subtype=ckptfs"}
    if os.getuid() == 0:
        options.add("allow_other")  # with default_permissions: kernel checks modes
    return options


class _GoneReplies(logging.Filter):
    """pyfuse3 logs an ERROR when the kernel refuses a reply with ENOENT; libfuse
    itself stays silent about it. The kernel no longer waits for that reply:
    the request was interrupted, or an unmount ended the connection while the
    reply was on its way (the release of a file closed just before a lazy
    unmount). Nothing is lost: the daemon did the work and seals files still
    open when it stops. Such lines are kept at DEBUG."""

    GONE = os.strerror(errno.ENOENT)

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).endswith("fuse_reply_* failed with %s") and record.args and record.args[-1] == self.GONE:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_gone_replies() -> None:
    logger = logging.getLogger("pyfuse3")
    if not any(isinstance(f, _GoneReplies) for f in logger.filters):
        logger.addFilter(_GoneReplies())


def _logged_refusals(check_path: Callable[[str], None]) -> Callable[[str], None]:
    """`check_path`, logging the first refusal of each kind (errno): the
    writer sees only the errno."""
    logged: set[int | None] = set()

    def check(path: str) -> None:
        try:
            check_path(path)
        except OSError as exc:
            if exc.errno not in logged:
                logged.add(exc.errno)
                log.warning("refused to make %s: %s (later refusals of this kind are not logged)", path, exc.strerror)
            raise

    return check


def serve(config: MountConfig, ready: Callable[[], None] | None = None) -> int:
    """Mount, serve until unmounted or signalled, drain write-back, unmount.
    Returns 0, or 1 if anything was left unpublished."""
    faulthandler.enable()  # a crash in native code (FUSE, mmap) leaves its tracebacks on stderr, not silence
    if config.oom_score_adj is not None:
        _set_oom_score_adj(config.oom_score_adj)
    backend = open_store(config.store_url, config.storage_options)
    spill_dir = config.spill_dir or DEFAULT_SPILL_DIR
    tree = InodeTree(MemoryPool(config.memory_limit, config.reuse_ram), uid=os.getuid(), gid=os.getgid(), spill_dir=spill_dir,
                     check_path=None if backend.any_name else _logged_refusals(backend.check_path))
    engine = Engine(backend, tree, workers=config.upload_workers, deadlines=Deadlines(call_s=config.store_timeout),
                    markers=tuple(dict.fromkeys(MARKERS + config.markers)))  # the built-in ones and the user's, once each
    tree.journal = engine
    node = None
    if config.cluster is not None:
        from ckptfs.cluster.log import Where
        from ckptfs.cluster.node import ClusterNode

        node = ClusterNode(Where(config.cluster, config.cluster_password_file), config.store_url, tree, engine, config.node,
                           patience_s=config.cluster_patience, snapshot_every=config.cluster_snapshot_every)
        node.join()
    metrics = Metrics()
    if config.metrics_port is not None:
        try:
            metrics.serve(config.metrics_port, config.metrics_host)
        except OSError as exc:
            raise RuntimeError(f"cannot serve metrics on {config.metrics_host}:{config.metrics_port}: {exc.strerror or exc}") from None
    ops = Operations(tree, engine, fsync_durable=config.fsync == "durable", metrics=metrics,
                     virtual_xattr=lambda inode, name: status.xattr(tree, engine, inode, name),
                     shared=node.namespace if node is not None else None)
    mountpoint = str(config.mountpoint)
    quiet_gone_replies()
    try:
        pyfuse3.init(ops, mountpoint, fuse_options(f"ckptfs:{config.store_url}"[:200]))
    except BaseException:
        metrics.close()
        if node is not None:
            node.leave()
        raise
    info = runtime.MountInfo.new(mountpoint, config.store_url, str(config.log_file or ""), config.drain_timeout, config.store_timeout)
    ledger = status.Ledger(tree, engine)
    control = ControlServer(runtime.control_socket(mountpoint), tree, engine, ledger,
                            {"mountpoint": info.mountpoint, "store": config.store_url, "pid": info.pid, "started": info.started,
                             "log_file": info.log_file, "fsync": config.fsync, "memory_limit": config.memory_limit,
                             "metrics_port": config.metrics_port, "cluster": config.cluster, "node": node.name if node else None,
                             "draining_until": None},
                            cluster=node)
    closed = False

    def unmount() -> None:
        nonlocal closed
        if not closed:
            closed = True
            pyfuse3.close(unmount=True)

    # The trio thread serving FUSE is busy whenever a job saves; store calls
    # run in threads that release the GIL at every syscall and must win it
    # back. A shorter switch interval (default 5 ms) bounds that wait, or a
    # group publication of many small files crawls while files are created,
    # and a load after a restart crawls while its reader is served (a cold
    # torch.load of 2 GiB: 4.6 s at 5 ms, 3.8 s at 0.5 ms, 2.8-3.0 s at
    # 0.1 ms).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        info.write()
        log.info("mounted %s (store %s, RAM budget %d bytes, fsync=%s%s)", mountpoint, config.store_url, config.memory_limit, config.fsync,
                 f", also completion markers: {' '.join(config.markers)}" if config.markers else "")
        try:
            lines = trio.run(_main, config, tree, engine, control, metrics, unmount, ready, node)
        except BaseExceptionGroup as group:
            refused, rest = group.split(StoreError)  # the store could not be used: no traceback, the reason
            if refused is None or rest is not None:
                raise
            while isinstance(refused, BaseExceptionGroup):
                refused = refused.exceptions[0]
            raise refused from None
    finally:
        unmount()
        metrics.close()
        if node is not None:
            node.leave()
        runtime.remove(mountpoint, pid=info.pid)
    runtime.write_exit_report(mountpoint, lines)
    if lines:
        for line in lines:
            log.error("NOT PUBLISHED: %s", line)
        log.error("unmounted %s with %d changes not published", mountpoint, len(lines))
        return 1
    log.info("unmounted %s; everything published", mountpoint)
    return 0


def _crash_point() -> tuple[int | str, str] | None:
    """CKPTFS_TEST_CRASH_AT=N:before|after kills the daemon (SIGKILL) at its
    N-th store call after claiming the store, CKPTFS_TEST_CRASH_AT=TEXT:before|after
    at the first whose description starts with TEXT: the crash-point tests' hook."""
    raw = os.environ.get("CKPTFS_TEST_CRASH_AT", "")
    at, _, when = raw.rpartition(":")
    if not at or when not in ("before", "after"):
        return None
    return (int(at) if at.isdigit() else at), when


def _describe(op: Op, tree: InodeTree) -> str:
    if isinstance(op, FileGen):
        # By the name the mount shows (renamed since its seal: the name a user looks for), else the sealed one.
        path = next(iter(tree.paths_of(op.ino)), op.path)
        return f"{path} ({op.size} bytes, generation {op.generation}, {op.state.value}{': ' + op.error if op.error else ''})"
    return f"{op.path} ({kind(op)} not applied{': ' + op.error if op.error else ''})"


async def _main(config: MountConfig, tree: InodeTree, engine: Engine, control: ControlServer, metrics: Metrics,
                unmount: Callable[[], None], ready: Callable[[], None] | None, node: ClusterNode | None) -> list[str]:
    async with trio.open_nursery() as nursery:
        await nursery.start(tasks.dump_on_signal)  # first: a start that hangs can be asked what it waits for
        await nursery.start(engine.run)
        await nursery.start(control.serve)  # answers during the drain too: `ckptfs status` shows it
        metrics.watch(control.ledger.totals, trio.lowlevel.current_trio_token())
        started = time.time()
        # Restoring makes a few objects per file in the store; the cyclic
        # collector would walk all of them again and again (half the restart
        # time at 100,000 files). They live as long as the mount: frozen out
        # of its reach once made.
        gc.disable()
        try:
            if node is None:
                n = await engine.scan()  # first: it tells crash leftovers by dead daemons' staging
            else:
                n = await node.start(nursery)  # the publishing node scans; the others replay the cluster's log
        finally:
            gc.enable()
            gc.freeze()
        await engine.claim(new_daemon_id(), started)
        nursery.start_soon(control.ledger.keep_up)  # first: the files just restored, counted in batches
        if node is None:
            nursery.start_soon(engine.outside.run)  # files the torch helpers write straight to the store from now on
        engine.calls.crash_at = _crash_point()
        if n:
            log.info("the store holds %d files: shown now, loaded on first use", n)
        # a cheaper wait for each request, where this pyfuse3 allows it
        turns = fuseloop.install(busy=lambda: engine.calls.running > 0)
        if turns is not None:
            metrics.watch_polls(turns)
        signals = _Signals(turns.stop if turns is not None else pyfuse3.terminate)
        # The receiver puts back what was there before it when the run ends,
        # while this daemon still unmounts, leaves its cluster and writes its
        # report: ignored then, not a silent death halfway (a SIGTERM sent
        # just after a lazy unmount, as `fusermount -u -z; kill` does).
        for signum in EXIT_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        await nursery.start(signals.watch)
        nursery.start_soon(_seal_closed, tree)
        nursery.start_soon(_when_live, str(config.mountpoint), ready)
        # Idle workers are kept: each new one would malloc a fresh 1 MiB buffer.
        await pyfuse3.main(min_tasks=8, max_tasks=64)
        signals.serving = False  # the session is closed next: pyfuse3.terminate() on it would crash
        engine.outside.stop()  # the mount is gone: the store's files are the next mount's to show
        unmount()  # no new work from here on
        for inode in tree.open_for_write():  # still open: their bytes now are what we have
            tree.seal(inode)
        deadline = trio.current_time() + config.drain_timeout
        control.mount["draining_until"] = time.time() + config.drain_timeout  # status, umount: when what is left is given up
        pending = engine.unpublished()  # (again once settled: a second signal may stop the wait before)
        with signals.abort_scope:  # a second signal stops waiting
            if node is not None:  # these seals placed, and what every node sealed before now in the queue
                await node.settle(deadline)
            pending = engine.unpublished()
            if pending:
                gens = [g for g in pending if isinstance(g, FileGen)]
                log.info("draining write-back: %d files, %d bytes, %d namespace changes (timeout %.0fs)", len(gens),
                         sum(g.size for g in gens), len(pending) - len(gens), deadline - trio.current_time())
            await engine.drain(max(0.0, deadline - trio.current_time()))
        left = engine.unpublished()
        if node is None:  # in a cluster, the node publishing next tries parked files again
            await engine.publisher.forget_parked()
        else:
            node.namespace.stop_following()  # before the index, which nothing applied after may change
            # What other nodes did during the drain is the next publishing node's to apply, not this unmount's.
            before = {id(op) for op in pending}
            left = [op for op in left if id(op) in before]
        await engine.leave_index()
        with contextlib.suppress(Exception):  # this daemon's staging and heartbeat go; a dead store must not hold the exit
            await engine.calls.run("retire", engine.backend.retire)
        nursery.cancel_scope.cancel()
    return [_describe(op, tree) for op in left] + (node.unplaced() if node is not None else [])


def _set_oom_score_adj(value: int) -> None:
    """How readily the kernel's OOM killer picks this daemon (its RSS is
    the RAM budget in use: the biggest process, the first picked, with every
    file it has not published). Lowering it needs root or CAP_SYS_RESOURCE;
    without, it stays as inherited, said in the log."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
    except OSError as exc:
        log.info("oom_score_adj stays as inherited, not %d (%s): when memory runs out, the kernel may kill this daemon first",
                 value, exc.strerror or exc)


class _Signals:
    """First SIGTERM/SIGINT/SIGHUP: unmount and drain. Second: stop
    draining, unless it came within SAME_REQUEST_S of the first: `ckptfs
    umount` run by every rank of a node at once sends one each, and the
    second stopped the drain (what was not yet published was lost)."""

    SAME_REQUEST_S = 2.0

    def __init__(self, terminate: Callable[[], None]) -> None:
        self.terminate = terminate  # ends the FUSE loop
        self.abort_scope = trio.CancelScope()
        self.count = 0
        self.first_at = 0.0
        self.serving = True  # the FUSE session is open (not yet unmounted, by us or by `fusermount3 -u`)

    async def watch(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(*EXIT_SIGNALS) as signals:
            task_status.started()
            async for signum in signals:
                if self.count and trio.current_time() - self.first_at < self.SAME_REQUEST_S:
                    log.info("received %s again within %.0fs of the first: the same request (another one later stops waiting "
                             "for write-back)", signal.Signals(signum).name, self.SAME_REQUEST_S)
                    continue
                self.count += 1
                if self.count == 1:
                    self.first_at = trio.current_time()
                    log.info("received %s: unmounting, then draining write-back", signal.Signals(signum).name)
                    if self.serving:
                        self.terminate()
                else:
                    log.warning("received %s again: not waiting for write-back any longer", signal.Signals(signum).name)
                    self.abort_scope.cancel()


async def _when_live(mountpoint: str, ready: Callable[[], None] | None) -> None:
    """Once the kernel has finished INIT, tune the mount and report it live."""
    # Any request through the mount is answered only after INIT; INIT also
    # clamps read-ahead, so it can only be raised afterwards. The stat runs in
    # a child process, never a thread of ours: a thread waiting on our own
    # mount when the daemon is killed would keep it from ever exiting (the
    # kernel waits for the answer uninterruptibly, and only our exit could
    # abort the connection); a child's request is aborted when we die.
    done = await trio.run_process(["stat", "--", mountpoint], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    if done.returncode != 0:  # unmounted already (`fusermount3 -u` at once): nothing to tune, and not live
        log.info("%s was unmounted before it was live", mountpoint)
        return
    _set_read_ahead(mountpoint)
    if ready is not None:
        ready()


async def _seal_closed(tree: InodeTree) -> None:
    """Files closed while a process forked meanwhile still holds them (no
    RELEASE until it lets go) are sealed once left alone for CLOSED_QUIET_S."""
    while True:
        await trio.sleep(CLOSED_QUIET_S / 4)
        tree.seal_closed(quiet_s=CLOSED_QUIET_S)


def _set_read_ahead(mountpoint: str) -> None:
    # Not os.stat(): the mount cannot answer before the main loop runs.
    dev = _mount_device(mountpoint)
    if dev is None:
        return
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(READ_AHEAD_KB))
    except OSError as exc:
        log.debug("cannot set read-ahead via %s: %s", path, exc)


def _mount_device(mountpoint: str) -> str | None:
    """The "major:minor" of the mount at `mountpoint` (the newest one there)."""
    found = None
    for fields in runtime.mount_table("/proc/self/mountinfo"):
        if fields[4] == mountpoint:
            found = fields[2]
    return found
