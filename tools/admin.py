"""`ckptfs status | flush | prefetch | evict`: ask a running daemon, through
its control socket (ckptfs.client), what is durable yet, and act on it.

Exit status, shared by these commands: 0 done; 1 the request did not fully
succeed (a flush timed out, an evict refused unpublished files); 2 bad input
(not a ckptfs mount, no such path); 3 the daemon is gone or not answering.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import NoReturn

import click

from ckptfs import runtime
from ckptfs.client import IO_TIMEOUT_S, AccessDenied, CkptfsError, Client, DaemonUnavailable, FlushIncomplete, NotMounted, RequestFailed
from ckptfs.escape import printable

from .paths import GivenPath
from .units import Number, counted, format_duration, format_size

EXIT_INCOMPLETE, EXIT_USAGE, EXIT_UNAVAILABLE = 1, 2, 3
DAEMON_EXIT_WAIT_S = 10.0  # a daemon that closed its connection to a flush, given this long to exit
UNSEALED_SHOWN = 5  # files still open for writing that `flush` names


def _fail(message: str, code: int) -> None:
    click.echo(f"ckptfs: error: {printable(message)}", err=True)
    sys.exit(code)


def _exit_code(exc: CkptfsError) -> int:
    if isinstance(exc, DaemonUnavailable):
        return EXIT_UNAVAILABLE
    if isinstance(exc, NotMounted | AccessDenied | RequestFailed):
        return EXIT_USAGE
    return EXIT_INCOMPLETE


def _client(path: str, timeout: float = IO_TIMEOUT_S, draining: bool = False) -> Client:
    """The client of the mount `path` is on; `draining`: or of the daemon of
    mount point `path` after its unmount, while it still publishes (an
    interrupted or running `umount`): it answers for the whole mount."""
    try:
        return Client(path, timeout=timeout)
    except NotMounted as exc:
        found = Client.draining(path) if draining else None
        if found is None:
            _fail(str(exc), _exit_code(exc))
            raise AssertionError from None
        info, client = found
        click.echo(printable(f"ckptfs: {info.mountpoint} is unmounted; its daemon (pid {info.pid}) is still publishing what it holds"),
                   err=True)
        return client
    except CkptfsError as exc:
        _fail(str(exc), _exit_code(exc))
        raise AssertionError from None


def _console():
    from rich.console import Console

    # Not a terminal: wide enough that tables are not cut for scripts and logs.
    return Console() if sys.stdout.isatty() else Console(width=200, no_color=True)


# -- status --------------------------------------------------------------------
@click.command()
@click.argument("mountpoint", required=False, type=GivenPath())
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (stable, versioned).")
@click.option("--files", "files", is_flag=False, flag_value="", default=None, metavar="[PATH]",
              help="Also list every file (under PATH: absolute, or relative to the mountpoint) with its state.")
@click.option("--watch", is_flag=True, help="Refresh until interrupted (Ctrl-C).")
@click.option("--interval", default=1.0, show_default=True, type=Number(0.1, 86400), metavar="S",
              help="Seconds between refreshes with --watch.")
@click.option("--cluster", is_flag=True, help="Also every node of the mount's cluster: what each has not published yet, and what was lost.")
@click.option("--timeout", default=IO_TIMEOUT_S, show_default=True, type=Number(0.1, 86400), metavar="S",
              help="Seconds to wait for a daemon's answer before reporting it as not answering (hung).")
def status(mountpoint: str | None, as_json: bool, files: str | None, watch: bool, interval: float, cluster: bool,
           timeout: float) -> None:
    """What is durable yet: totals, and per file with --files.

    With no MOUNTPOINT: every ckptfs mount on this machine, and this user's
    daemons still publishing after their unmount.
    """
    if cluster and mountpoint is None:
        _fail("--cluster needs a MOUNTPOINT", EXIT_USAGE)
    client = None
    if mountpoint is None and files and os.path.isabs(files):  # `status --files /mnt/ckpt`: the mount that path is on
        mountpoint = files
    if mountpoint is not None:
        client = _client(mountpoint, timeout, draining=True)
        if client.relpath:  # a path on the mount: the status is the whole mount's
            client = _client(client.mountpoint, timeout)
        mps = [client.mountpoint]
        if files:
            files = os.path.join(client.mountpoint, files) if not os.path.isabs(files) else files
    else:
        if files:
            _fail("--files with a relative PATH needs a MOUNTPOINT", EXIT_USAGE)
        mps = _every_mount()
    if not watch:
        code = _show_status(mps, as_json, files, timeout, single=client, cluster=cluster)
        sys.exit(code)
    try:
        while True:
            if sys.stdout.isatty():
                click.clear()
            _show_status(mps if mountpoint is not None else _every_mount(), as_json, files, timeout, single=client, cluster=cluster)
            sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        sys.exit(0)


def _every_mount() -> list[str]:
    """Every ckptfs mount point, and those whose daemon (this user's) still
    publishes after their unmount: what it holds is not durable yet either."""
    return runtime.ckptfs_mounts() + [info.mountpoint for info in runtime.unmounted_daemons()]


def _client_of(mp: str, timeout: float) -> Client:
    try:
        return Client(mp, timeout=timeout)
    except NotMounted:
        found = Client.draining(mp)  # unmounted since it was listed: still publishing, or gone
        if found is None:
            raise
        return found[1]


def _show_status(mps: list[str], as_json: bool, files: str | None, timeout: float, single: Client | None,
                 cluster: bool = False) -> int:
    """Status of every mount in `mps`, or of the one `single` is the client of."""
    reports, code = [], 0
    for mp in mps:
        try:
            client = single if single is not None else _client_of(mp, timeout)
            reports.append(client.status(files=files is not None, path=files or None, cluster=cluster))
        except NotMounted as exc:
            if single is not None:
                _fail(str(exc), _exit_code(exc))
            continue  # unmounted since it was listed, and its daemon gone: nothing of it left to show
        except AccessDenied as exc:
            if single is not None:
                _fail(str(exc), _exit_code(exc))
            reports.append({"mount": {"mountpoint": mp}, "error": str(exc), "denied": True})  # another user's: not a failure of this one's
        except CkptfsError as exc:
            if single is not None:
                _fail(str(exc), _exit_code(exc))
            reports.append({"mount": {"mountpoint": mp}, "error": str(exc)})
            code = EXIT_UNAVAILABLE
    if as_json:
        out = {"version": 1, **reports[0]} if single is not None else {"version": 1, "mounts": reports}
        click.echo(json.dumps(out, indent=2, sort_keys=True))
    elif not reports:
        click.echo("no ckptfs mounts on this machine")
    else:
        console = _console()
        for r in reports:
            _print_status(console, r)
    return code


def _print_status(console, r: dict) -> None:
    from rich.table import Table
    from rich.text import Text

    m = r["mount"]
    if r.get("denied"):
        console.print(Text.assemble((printable(m["mountpoint"]), "bold"), ": ", ("another user's", "dim"), f": {printable(r['error'])}"))
        return
    if "error" in r:
        console.print(Text.assemble((printable(m["mountpoint"]), "bold"), ": ", ("unavailable", "red"), f": {printable(r['error'])}"))
        return
    t = r["totals"]
    up = format_duration(m["uptime_s"])
    console.print(Text.assemble((printable(m["mountpoint"]), "bold"), f"  store {printable(m['store'])}  pid {m['pid']}  up {up}  fsync={m['fsync']}"))
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column(justify="right")
    grid.add_column(justify="right")

    def count(c: dict) -> tuple[str, str]:
        return str(c["files"]), format_size(c["bytes"])

    grid.add_row("files", *count(t["files"]))
    for state in ("published", "dirty", "uploading", "staged", "failed"):
        style = "red" if state == "failed" and t["by_state"][state]["files"] else ""
        files_n, size = count(t["by_state"][state])
        grid.add_row(f"  {state}", f"[{style}]{files_n}[/]" if style else files_n, size)
    grid.add_row("in RAM", *count(t["in_ram"]))
    grid.add_row("spilled to disk", *count(t["spilled"]))
    grid.add_row("evicted (store only)", *count(t["evicted"]))
    grid.add_row("RAM budget", f"{format_size(t['budget_used'])} used", f"of {format_size(t['budget_limit'])}")
    grid.add_row("write-back queue", str(t["queue"]), f"oldest {format_duration(t['oldest_unpublished_s'])}" if t["queue"] else "")
    grid.add_row("upload rate", f"{format_size(t['upload_bytes_per_s'])}/s", "")
    c = t["counters"]
    grid.add_row("since start", f"{c['published_files']} published", f"{c['retries']} retries, {c['failures']} failures")
    if t.get("lost"):
        grid.add_row("lost with their node", f"[red]{t['lost']}[/]", "never published (cluster mode)")
    if m.get("draining_until") is not None:  # unmounted: what is not published by then is given up (--drain-timeout)
        left = t["queue"] > 0
        grid.add_row("unmounted", "[red]draining[/]" if left else "draining",
                     f"gives up in {format_duration(max(0.0, m['draining_until'] - time.time()))}" if left else "")
    # Why, below the grid: a long reason in a cell would stretch its columns.
    why = []
    if t.get("stalled"):
        grid.add_row("publishing", "[red]paused[/]", "")
        why.append(t["stalled"])
    if t["last_error"]:  # only while something is failing; the history is in the log
        grid.add_row("failing", f"[red]{t['failing']}[/]", f"last error {format_duration(t['last_error_age_s'])} ago")
        why.append(t["last_error"])
    console.print(grid)
    for text in why:
        console.print(Text(f"  {printable(text)}", style="red"))
    if "cluster" in r:
        _print_cluster(console, r["cluster"])
    if "files" in r:
        table = Table(show_edge=False, pad_edge=False)
        for col, justify in (("path", "left"), ("size", "right"), ("state", "left"), ("gen", "right"), ("xxh3", "left"),
                             ("where", "left"), ("tries", "right"), ("error", "left")):
            table.add_column(col, justify=justify, overflow="fold")
        for f in r["files"]:
            where = "ram" if f["resident"] and not f["spilled"] else "spill" if f["resident"] else "store"
            state = f["state"] + (" (open)" if f["open_for_write"] else "")
            table.add_row(Text(printable(f["path"])), format_size(f["size"]), state, str(f["generation"]), f["xxh3"] or "-", where,
                          str(f["tries"] or ""), Text(printable(f["error"])))
        console.print(table)


def _print_cluster(console, c: dict) -> None:
    from rich.table import Table
    from rich.text import Text

    if c["publishing_node_gone"]:
        console.print(Text("the cluster's publishing node is gone: nothing more is published", style="red"))
    if c.get("behind"):
        console.print(Text(printable(c["behind"]), style="red"))
    kept = f", snapshot at {c['snapshot_position']}" if c.get("snapshot_position") else ""
    table = Table(title=f"cluster (log position {c['log_position']}{kept})", show_edge=False, pad_edge=False, title_justify="left")
    for col, justify in (("node", "left"), ("host", "left"), ("pid", "right"), ("heartbeat", "right"), ("role", "left"),
                         ("unpublished", "right"), ("size", "right"), ("lost", "right")):
        table.add_column(col, justify=justify)
    for n in c["nodes"]:
        age = "gone" if n["gone"] else f"{n['heartbeat_age_s']:.1f}s ago"
        role = ("publishes" if n["publishes"] else "stages") + (" (this node)" if n["this"] else "")
        lost = f"[red]{n['lost_files']}[/]" if n["lost_files"] else "0"
        table.add_row(Text(printable(n["node"])), Text(printable(n["host"])), str(n["pid"] or ""), f"[red]{age}[/]" if n["gone"] else age,
                      role, str(n["unpublished_files"]), format_size(n["unpublished_bytes"]), lost)
    console.print(table)


# -- flush ---------------------------------------------------------------------
@click.command()
@click.argument("path", required=False, default=".", metavar="[MOUNTPOINT|PATH]", type=GivenPath())
@click.option("--timeout", type=Number(0), default=None, metavar="S", help="Give up after S seconds (exit 1) [default: wait until published].")
@click.option("--cluster", is_flag=True, help="Wait for what every node of the mount's cluster sealed before now, not only what this node has seen.")
def flush(path: str, timeout: float | None, cluster: bool) -> None:
    """Wait until everything sealed (closed) before now, on the mount or under
    PATH, is published to the store. A barrier: what is written later is not
    waited for. Exit 0 once published; 1 on timeout, naming what is left."""
    client = _client(path, draining=True)
    where = os.path.join(client.mountpoint, client.relpath).rstrip("/")
    daemon = runtime.MountInfo.read(client.mountpoint)  # the daemon waited for: if it exits meanwhile, how that went
    try:
        result = _flush_with_progress(client, timeout, cluster)
    except FlushIncomplete as exc:
        why = (f"not published after {timeout:g}s" if exc.timed_out
               else "never published as they are (parked, or a change the store could not take: change or delete them)")
        click.echo(f"ckptfs: error: {why}: {len(exc.left)} left under {printable(where)}", err=True)
        for f in exc.left:
            if not f["error"]:
                tail = ""
            elif f["tries"]:
                tail = f" ({f['tries']} tries, last error: {printable(f['error'])})"
            else:  # a completion marker held back: why
                tail = f" ({printable(f['error'])})"
            click.echo(f"  {printable(f['path'])}: {f['state']}, {format_size(f['size'])}{tail}", err=True)
        sys.exit(EXIT_INCOMPLETE)
    except CkptfsError as exc:
        if isinstance(exc, DaemonUnavailable) and not exc.hung and daemon is not None and _exited(daemon.pid):
            _flush_ended_by_exit(daemon, where, cluster)
        _fail(str(exc), _exit_code(exc))
    click.echo(f"ckptfs: flushed {printable(where)}: everything sealed before the flush is published "
               f"({counted(result['files'], 'file')}, {format_size(result['bytes'])} waited for)")
    unsealed = result.get("unsealed", [])
    if unsealed:
        more = len(unsealed) - UNSEALED_SHOWN
        shown = ", ".join(printable(p) for p in unsealed[:UNSEALED_SHOWN]) + (f" and {more} more" if more > 0 else "")
        click.echo(f"ckptfs: not included: {counted(len(unsealed), 'file')} still open for writing, their changes sealed (and then published) "
                   f"when they are closed: {shown}", err=True)


def echo_unpublished(header: str, lines: list[str], most: int | None = None) -> None:
    """On stderr: `header`, then the lines of an exit report (the files a
    daemon left unpublished), at most `most` of them."""
    click.echo(printable(header), err=True)
    for line in lines[:most]:
        click.echo(f"  {printable(line)}", err=True)
    if most is not None and len(lines) > most:
        click.echo(f"  and {len(lines) - most} more", err=True)


def _exited(pid: int) -> bool:
    """Whether the daemon `pid`, whose connection just closed, exits: it
    closes its control socket a moment before its exit report is written."""
    deadline = time.monotonic() + DAEMON_EXIT_WAIT_S
    while runtime.pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _flush_ended_by_exit(daemon: runtime.MountInfo, where: str, cluster: bool) -> NoReturn:
    """The daemon a flush waited for exited meanwhile (an `umount`, a
    signal, a kill): its exit report says whether everything it held was
    published, which holds the flush's barrier too (not for `--cluster`:
    other nodes' files are theirs)."""
    report = runtime.exit_report_of(daemon)
    if report is None:
        _fail(f"the daemon of {daemon.mountpoint} (pid {daemon.pid}) exited while the flush waited, without saying what it published "
              f"(killed?): what it had not published is lost; see {daemon.log_file}", EXIT_INCOMPLETE)
    if report.unpublished:
        echo_unpublished(f"ckptfs: error: the daemon of {daemon.mountpoint} exited while the flush waited, with "
                         f"{counted(len(report.unpublished), 'file')} NOT published to the store:", report.unpublished)
        runtime.mark_shown(daemon.mountpoint, report)
        sys.exit(EXIT_INCOMPLETE)
    if cluster:
        _fail(f"the daemon of {daemon.mountpoint} exited while the flush waited, having published everything it held; "
              "what other nodes sealed was not waited for", EXIT_INCOMPLETE)
    click.echo(printable(f"ckptfs: flushed {where}: its daemon published everything and exited (unmounted) while the flush waited"))
    sys.exit(0)


def _flush_with_progress(client: Client, timeout: float | None, cluster: bool = False) -> dict:
    if not sys.stderr.isatty():
        last = [0.0, None]

        def line(p: dict) -> None:  # plain lines, at most every 2 s, when something changed
            key = (p["files_left"], p["bytes_left"], len(p["failed"]))
            if key != last[1] and time.monotonic() - last[0] >= 2.0:
                last[:] = [time.monotonic(), key]
                failing = f"; failing: {printable(p['failed'][0]['path'])}: {printable(p['failed'][0]['error'])}" if p["failed"] else ""
                click.echo(f"ckptfs: flush: {p['files_left']} of {counted(p['files'], 'file')} left, "
                           f"{format_size(p['bytes_left'])} of {format_size(p['bytes'])}{failing}", err=True)

        return client.flush(timeout=timeout, progress=line, cluster=cluster)

    from rich.markup import escape
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("publishing", total=None)

        def update(p: dict) -> None:
            desc = f"publishing: {counted(p['files_left'], 'file')} left"
            if p["failed"]:
                desc += f" [red](retrying {escape(printable(p['failed'][0]['path']))}: {escape(printable(p['failed'][0]['error']))})[/]"
            bar.update(task, total=p["bytes"], completed=p["bytes"] - p["bytes_left"], description=desc)

        return client.flush(timeout=timeout, progress=update, cluster=cluster)


# -- prefetch / evict ----------------------------------------------------------
def _request_each(paths: tuple[str, ...], method) -> list[dict]:
    """`method`'s answer for each of `paths` (on one mount or several),
    every path's mount found before any is asked."""
    clients = [_client(p) for p in paths]
    try:
        return [method(c) for c in clients]
    except CkptfsError as exc:
        _fail(str(exc), _exit_code(exc))
        raise AssertionError from None


def _total(answers: list[dict], key: str) -> int:
    return sum(a[key] for a in answers)


def _fail_with(answers: list[dict], key: str, header: str, why: str) -> None:
    """The files every answer lists under `key` (each with its path and
    `why`), under `header`, then exit 1; nothing if there are none."""
    rows = [f for a in answers for f in a[key]]
    if rows:
        click.echo(f"ckptfs: error: {counted(len(rows), 'file')} {header}:", err=True)
        for f in rows:
            click.echo(f"  {printable(f['path'])}: {printable(str(f[why]))}", err=True)
        sys.exit(EXIT_INCOMPLETE)


@click.command()
@click.argument("paths", nargs=-1, required=True, metavar="PATH...", type=GivenPath())
def prefetch(paths: tuple[str, ...]) -> None:
    """Load each PATH (a file or a directory, recursively) from the store
    into RAM, verified, ahead of a restart's reads. Files that cannot be
    loaded (corrupt in the store, the store unreachable) are named, and the
    rest loaded (exit 1)."""
    answers = _request_each(paths, Client.prefetch)
    click.echo(f"ckptfs: loaded {counted(_total(answers, 'loaded'), 'file')} ({format_size(_total(answers, 'bytes'))}) into RAM")
    _fail_with(answers, "failed", "not loaded", "error")


@click.command()
@click.argument("paths", nargs=-1, required=True, metavar="PATH...", type=GivenPath())
def evict(paths: tuple[str, ...]) -> None:
    """Drop the published files of each PATH (a file or a directory,
    recursively) from RAM; they load again from the store on next use.
    Unpublished files are refused (exit 1): their only copy is in RAM."""
    answers = _request_each(paths, Client.evict)
    click.echo(f"ckptfs: evicted {counted(_total(answers, 'evicted'), 'file')} ({format_size(_total(answers, 'bytes'))}) from RAM")
    _fail_with(answers, "refused", "not evicted, not published yet", "state")


COMMANDS = (status, flush, prefetch, evict)
