"""Run one benchmark against two commits, alternating, on the same machine.

"No figure worse than before" needs the old and the new code measured side by
side: on a shared VM the same 2 GiB write varies ~3x from one minute to the
next, so two runs made an hour apart compare the host, not the code. This
exports each commit with `git archive`, lays its packages out as installed
(`[tool.setuptools.package-dir]` of that commit's pyproject.toml) and runs the
benchmark script of the working tree with PYTHONPATH pointing at each export in
turn (the daemons the benchmark starts inherit it). Example, as root:

    .venv/bin/python bench/ab.py --old 71e47d3 --new HEAD --runs 3 \\
        bench/bench_mount.py -- --rounds 2

It prints every run's target table and then each target's measured values,
old and new, run by run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def export(commit: str, dest: Path) -> Path:
    """`commit`'s packages laid out under dest/ as `pip install` would."""
    src = dest / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    layout = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    site = dest / "site"
    for package, folder in sorted(layout.items()):  # "ckptfs" before "ckptfs.fs"
        shutil.copytree(src / folder, site.joinpath(*package.split(".")), dirs_exist_ok=True)
    return site


def measured(report: str) -> dict[str, str]:
    """target -> measured, from the report's first table (| target | measured | goal | met |)."""
    out: dict[str, str] = {}
    for line in report.splitlines():
        if not line.startswith("|"):
            if out:
                break  # the end of the first table
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] != "target" and not set(cells[0]) <= {"-"}:
            out[cells[0]] = cells[1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the commit to compare against")
    ap.add_argument("--new", default="HEAD")
    ap.add_argument("--runs", type=int, default=3, help="runs of each, alternating old/new")
    ap.add_argument("bench", help="the benchmark script (from the working tree)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="after --: the benchmark's own arguments")
    args = ap.parse_args()
    extra = args.args[1:] if args.args[:1] == ["--"] else args.args

    work = Path(tempfile.mkdtemp(prefix="ckptfs-ab-"))
    try:
        sites = {label: export(commit, work / label) for label, commit in (("old", args.old), ("new", args.new))}
        for site in sites.values():  # the export, not the editable install, must be what gets imported
            probe = subprocess.run([sys.executable, "-c", "import ckptfs.writeback; print(ckptfs.writeback.__file__)"],
                                   env=dict(os.environ, PYTHONPATH=str(site)), cwd=work, capture_output=True, text=True, check=True)
            if not probe.stdout.startswith(str(site)):
                sys.exit(f"ckptfs imports from {probe.stdout.strip()}, not from the export {site}")
        results: dict[str, list[dict[str, str]]] = {"old": [], "new": []}
        for run in range(args.runs):
            for label in ("old", "new") if run % 2 == 0 else ("new", "old"):
                report = work / f"{label}-{run}.md"
                env = dict(os.environ, PYTHONPATH=str(sites[label]))
                print(f"== run {run + 1}/{args.runs}: {label} ({getattr(args, label)})", flush=True)
                # cwd outside the repository: `python -m` puts the cwd first on sys.path
                subprocess.run([sys.executable, str(Path(args.bench).resolve()), *extra, "--write", str(report)],
                               env=env, cwd=work, check=True)
                results[label].append(measured(report.read_text()))
        print(f"\n## {Path(args.bench).name}: {args.old} (old) vs {args.new} (new), {args.runs} alternating runs\n")
        print("| target | old, per run | new, per run |")
        print("|---|---|---|")
        for target in results["new"][0]:
            old = " ".join(r.get(target, "-") for r in results["old"])
            new = " ".join(r.get(target, "-") for r in results["new"])
            print(f"| {target} | {old} | {new} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("run as root (the benchmarks mount and drop caches)")
    main()
