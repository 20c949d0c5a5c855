"""`ckptfs advise`: how often to checkpoint (see ckptfs/advise.py)."""

from __future__ import annotations

import json
import os
import sys
import time

import click

from ckptfs.advise import advise as compute

from .paths import GivenPath
from .units import Number, format_duration, format_size, parse_size


@click.command()
@click.option("--save-seconds", type=Number(0, 1e6, low_open=True), metavar="C", help="How long one checkpoint blocks training.")
@click.option("--mtbf-hours", type=Number(0.001, 1e6), required=True, metavar="M",
              help="Mean time between failures of the whole job, in hours.")
@click.option("--restart-seconds", type=Number(0, 1e6), default=0.0, show_default=True, metavar="R",
              help="How long a restart takes (relaunch + load).")
@click.option("--measure", "measure_mp", type=GivenPath(), metavar="MOUNTPOINT", help="Measure C: time a real save of --size into this directory.")
@click.option("--size", default="1G", show_default=True, metavar="SIZE", help="Checkpoint size for --measure.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def advise(save_seconds: float | None, mtbf_hours: float, restart_seconds: float, measure_mp: str | None, size: str, as_json: bool) -> None:
    """The optimal checkpoint interval by Young's and Daly's formulas, and the
    expected fraction of time wasted (saves + lost work + restarts)."""
    if (save_seconds is None) == (measure_mp is None):
        click.echo("ckptfs: error: give one of --save-seconds C or --measure MOUNTPOINT", err=True)
        sys.exit(2)
    if measure_mp is not None:
        try:
            nbytes = parse_size(size)
            save_seconds = measure(measure_mp, nbytes)
        except (ValueError, OSError) as exc:
            click.echo(f"ckptfs: error: --measure: {exc}", err=True)
            sys.exit(2)
        if not as_json:
            click.echo(f"measured: saving {format_size(nbytes)} into {measure_mp} took {save_seconds:.2f} s")
    assert save_seconds is not None
    a = compute(save_seconds, mtbf_hours * 3600, restart_seconds)
    if as_json:
        click.echo(json.dumps({"version": 1, "save_s": a.save_s, "mtbf_s": a.mtbf_s, "restart_s": a.restart_s, "young_s": a.young_s,
                               "daly_s": a.daly_s, "waste_at_daly": a.waste_at_daly,
                               "table": [{"label": lbl, "interval_s": t, "waste": w} for lbl, t, w in a.table]}, indent=2))
        return
    click.echo(f"checkpoint every {format_duration(a.daly_s)} (Daly; Young: {format_duration(a.young_s)}): "
               f"expected {a.waste_at_daly:.2%} of the time wasted")
    click.echo(f"  {'interval':>12}  {'wasted':>8}  {'saves/day':>9}")
    for label, t, w in a.table:
        click.echo(f"  {format_duration(t):>12}  {w:>8.2%}  {86400 / (t + a.save_s):>9.1f}  {label}")


def measure(directory: str, nbytes: int) -> float:
    """Seconds to write and close `nbytes` (a checkpoint's worth) in `directory`."""
    if not os.path.isdir(directory):
        raise OSError(f"{directory} is not a directory")
    path = os.path.join(directory, f".ckptfs-advise-{os.getpid()}")
    block = os.urandom(8 << 20)
    try:
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            left = nbytes
            while left > 0:
                left -= f.write(memoryview(block)[: min(left, len(block))])
        return time.perf_counter() - t0
    finally:
        os.unlink(path)
