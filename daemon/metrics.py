"""Prometheus metrics for one daemon (`ckptfs mount --metrics-port N`).

FUSE requests are counted and timed as they are served, in plain lists on
the trio thread (`_Requests`: no lock, no label lookup; prometheus-client's
own Histogram cost a small file's create about 8% of the daemon's time), and
turned into metric families at scrape time, as are the FUSE loop's polls
(`fuseloop.Turns`' two counters). Everything else is read at
scrape time from `status.Ledger.totals()` on the trio thread (the scrape
runs in prometheus-client's HTTP thread and asks the loop for a snapshot), so
a scrape agrees with `ckptfs status --json` taken at the same moment.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator

import trio
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .fuseloop import Turns
from .status import STATES, Totals

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (25e-6, 100e-6, 250e-6, 1e-3, 2.5e-3, 10e-3, 25e-3, 100e-3, 250e-3, 1.0, 2.5, 10.0)

# engine counter -> (metric name without _total, help)
COUNTERS = {
    "uploaded_bytes": ("ckptfs_uploaded_bytes", "Bytes published to the store"),
    "published_files": ("ckptfs_published_files", "File generations published to the store"),
    "retries": ("ckptfs_retries", "Failed store operations, each retried"),
    "failures": ("ckptfs_failures", "Files that failed often enough to be shown as FAILED"),
    "evictions": ("ckptfs_evictions", "Published files dropped from RAM"),
    "evicted_bytes": ("ckptfs_evicted_bytes", "Bytes of published files dropped from RAM"),
    "loads": ("ckptfs_read_through_files", "Files loaded back from the store (read-through, prefetch)"),
    "loaded_bytes": ("ckptfs_read_through_bytes", "Bytes loaded back from the store"),
    "staged_while_written": ("ckptfs_staged_while_written_files", "Files staged while still being written (large files growing at their end)"),
}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = _Requests()
        self.registry.register(self.requests)
        self._server = None

    def request(self, op: str, seconds: float, errno: int = 0) -> None:
        self.requests.add(op, seconds, errno)

    def watch_polls(self, turns: Turns) -> None:
        """Report how often the FUSE loop polled the device before sleeping
        (`fuseloop.Turns`: counters of the trio thread, read as they are)."""
        self.registry.register(_Polls(turns))

    def watch(self, snapshot: Callable[[], Totals], token: trio.lowlevel.TrioToken) -> None:
        """Report `snapshot()` (run on the trio loop of `token`) at each scrape."""
        self.registry.register(_TotalsCollector(snapshot, token))

    def serve(self, port: int, host: str) -> None:
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("serving Prometheus metrics on http://%s:%d/metrics", host, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Requests(Collector):
    """FUSE requests by operation: a count per latency bucket, the seconds
    they took, and errors by errno. Added to on the trio thread only; a
    scrape copies each list whole (one C call under the GIL)."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}  # op -> [count per bucket of LATENCY_BUCKETS..., count above them, sum of seconds]
        self.errors: dict[tuple[str, int], int] = {}

    def add(self, op: str, seconds: float, errno: int) -> None:
        counts = self.seconds.get(op)
        if counts is None:
            counts = self.seconds[op] = [0] * (len(LATENCY_BUCKETS) + 1) + [0.0]
        counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1  # the first bound >= seconds ("le")
        counts[-1] += seconds
        if errno:
            self.errors[op, errno] = self.errors.get((op, errno), 0) + 1

    def collect(self) -> Iterator[Metric]:
        seconds = HistogramMetricFamily("ckptfs_fuse_request_seconds", "FUSE requests served, by operation, and how long each took", labels=["op"])
        for op, counts in sorted(self.seconds.copy().items()):
            counts = counts.copy()
            cumulative, buckets = 0, []
            for bound, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), counts[:-1], strict=True):
                cumulative += n
                buckets.append((bound, cumulative))
            seconds.add_metric([op], buckets, counts[-1])
        yield seconds
        errors = CounterMetricFamily("ckptfs_fuse_request_errors", "FUSE requests answered with an error, by operation and errno", labels=["op", "errno"])
        for (op, code), n in sorted(self.errors.copy().items()):
            errors.add_metric([op, str(code)], n)
        yield errors


class _Polls(Collector):
    def __init__(self, turns: Turns) -> None:
        self.turns = turns

    def collect(self) -> Iterator[Metric]:
        polls = CounterMetricFamily("ckptfs_fuse_polls", "Waits for the next FUSE request that polled the device before sleeping, "
                                    "by whether a request came meanwhile", labels=["found"])
        made, found = self.turns.spins, self.turns.spins_found
        polls.add_metric(["request"], found)
        polls.add_metric(["nothing"], made - found)
        yield polls


class _TotalsCollector(Collector):
    def __init__(self, snapshot: Callable[[], Totals], token: trio.lowlevel.TrioToken) -> None:
        self.snapshot = snapshot
        self.token = token

    def collect(self) -> Iterator[Metric]:
        try:
            t = trio.from_thread.run_sync(self.snapshot, trio_token=self.token)
        except trio.RunFinishedError:
            return
        files = GaugeMetricFamily("ckptfs_files", "Files in the mount, by write-back state", labels=["state"])
        nbytes = GaugeMetricFamily("ckptfs_file_bytes", "Bytes of the files in the mount, by write-back state", labels=["state"])
        for state in STATES:
            files.add_metric([state], t.by_state[state].files)
            nbytes.add_metric([state], t.by_state[state].bytes)
        yield files
        yield nbytes
        held_files = GaugeMetricFamily("ckptfs_held_files", "Files by where their bytes are: ram, spill (disk), evicted (store only)", labels=["where"])
        held_bytes = GaugeMetricFamily("ckptfs_held_bytes", "Bytes of files by where they are held", labels=["where"])
        for where, count in (("ram", t.in_ram), ("spill", t.spilled), ("evicted", t.evicted)):
            held_files.add_metric([where], count.files)
            held_bytes.add_metric([where], count.bytes)
        yield held_files
        yield held_bytes
        yield GaugeMetricFamily("ckptfs_ram_budget_bytes", "The RAM budget for file data", value=t.budget_limit)
        yield GaugeMetricFamily("ckptfs_ram_used_bytes", "RAM budget in use", value=t.budget_used)
        yield GaugeMetricFamily("ckptfs_queue_length", "Write-back operations queued (files, renames, removals)", value=t.queue)
        yield GaugeMetricFamily("ckptfs_oldest_unpublished_seconds", "Age of the oldest sealed, unpublished file", value=t.oldest_unpublished_s)
        yield GaugeMetricFamily("ckptfs_upload_bytes_per_second", "Bytes published per second, recent average", value=t.upload_bytes_per_s)
        yield GaugeMetricFamily("ckptfs_lost_files", "Cluster mode: files lost with the node that held them (never published)", value=t.lost)
        yield GaugeMetricFamily("ckptfs_publishing_stalled",
                                "Cluster mode: 1 while publishing is paused (the publishing node is gone, not yet replaced, or its lease ran out)",
                                value=int(bool(t.stalled)))
        yield GaugeMetricFamily("ckptfs_verify_failures", "Files whose bytes in the store failed verification", value=t.counters["verify_failures"])
        for key, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=t.counters[key])
