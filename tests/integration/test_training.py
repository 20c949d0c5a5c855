"""ckptfs.torch on real mounts: fallback save/load, CheckpointManager with
its policies, the dying gasp, and `ckptfs advise --measure`."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from ckptfs.writeback.backend import open_store
from ckptfs.writeback.storeio import IntegrityError

import ckptfs.torch as ct
from ckptfs import fallback
from tests.mountutil import run_cli, signal_and_wait, start_mount, stop_mount
from tests.storeutil import store_files, store_outage, verify_store, wait_until

OUTAGE_LOG = ["failed (try", "Errno 20", "Not a directory", "FileExistsError", "NotADirectoryError"]
SCRIPTS = Path(__file__).parent / "scripts"


def state(step: int) -> dict:
    return {"step": step, "w": torch.full((64, 64), float(step))}


def same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"])


# -- save / load with fallback ------------------------------------------------------
def test_save_and_load_through_the_mount(fresh_mount):
    m = fresh_mount
    p = m.path("run", "model.pt")
    assert ct.save(state(1), p) == "mount"
    assert same(ct.load(p), state(1))
    assert os.listdir(m.path("run")) == ["model.pt"]  # the temporary name is gone
    ct.CheckpointManager(m.path("run")).wait_until_published(timeout=60)
    assert "run/model.pt" in store_files(m.store) and verify_store(m.store).clean
    assert ct.save(state(2), m.store.parent / "plain.pt") == "plain"  # not ckptfs: a plain torch.save


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_save_falls_back_to_the_store(fresh_mount, fault, caplog):
    m = fresh_mount
    m.allowed_log_errors += ["the mount shows it now", "cannot be taken in: run/after.pt: checksum mismatch"]  # once back
    p = m.path("run", "model.pt")
    assert ct.save(state(1), p) == "mount"
    # Published before the fault: a daemon frozen or killed while it moves the
    # save from its temporary name leaves that name's record before its data,
    # which `verify` of the whole store below would read as MISSING.
    assert run_cli("flush", str(m.mountpoint)).returncode == 0
    if fault == "killed":
        os.kill(m.pid, signal.SIGKILL)
        m.proc.wait()
    else:
        os.kill(m.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert ct.save(state(2), m.path("run", "after.pt"), deadline_s=1.0) == "store"
        assert time.monotonic() - t0 < 20
        files = store_files(m.store)
        assert "run/after.pt" in files and verify_store(m.store).clean
        assert same(torch.load(m.store / "run" / "after.pt", weights_only=False), state(2))  # a plain file (C8)
        assert same(ct.load(m.path("run", "after.pt"), deadline_s=1.0), state(2))  # from the store, verified
        mgr = ct.CheckpointManager(m.path("run"), ct.save_policy.EveryNSteps(1), client_timeout=1.0)
        began = time.monotonic()
        assert mgr.save(7, state(7))  # the manager takes the same route, commit marker included
        assert time.monotonic() - began < ct.DEADLINE_S  # the daemon asked once, within 1 s (its save asked again, 5 s more)
        assert {"run/step-7/state.pt", "run/step-7/ckptfs-commit.json"} <= set(store_files(m.store))
        assert verify_store(m.store).clean
        # corrupt it in the store: the fallback load must say so, not load garbage
        data = bytearray((m.store / "run" / "after.pt").read_bytes())
        data[-100] ^= 0xFF
        (m.store / "run" / "after.pt").write_bytes(bytes(data))
        with pytest.raises(IntegrityError, match="checksum mismatch"):
            ct.load(m.path("run", "after.pt"), deadline_s=1.0)
        # a marker corrupted in the store: its checkpoint is left out of the listing, which goes on
        assert mgr.save(8, state(8)) and mgr.all_steps() == [7, 8]
        marker = m.store / "run" / "step-7" / "ckptfs-commit.json"
        marker.write_bytes(marker.read_bytes().replace(b"{", b"[", 1))
        with caplog.at_level(logging.WARNING, logger="ckptfs"):
            assert mgr.all_steps() == [8] and mgr.latest_step() == 8
        assert "leaving checkpoint 7 out" in caplog.text and "checksum mismatch" in caplog.text
    finally:
        if fault == "hung":
            os.kill(m.pid, signal.SIGCONT)


def test_a_daemon_that_did_not_answer_is_not_waited_for_again_until_it_answers(fresh_mount):
    """A frozen daemon costs a caller of this process one wait: later
    routes go straight to the store (they waited the deadline each, so a
    training loop saving every step lost it at every step) while a thread
    asks the daemon again; once it answers, the mount is its again, and
    the thread ends. A process forked meanwhile asks for itself."""
    m = fresh_mount
    p = m.path("run", "x.pt")
    assert fallback.route(p, 2.0).kind == "mount"
    os.kill(m.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        first = fallback.route(p, 2.0)
        assert first.kind == "store" and time.monotonic() - t0 >= 1.9 and "did not answer within 2s" in first.reason
        t0 = time.monotonic()
        again = [fallback.route(p, 2.0) for _ in range(5)]
        assert time.monotonic() - t0 < 2.0  # five routes, where each waited 2 s
        assert all(r.kind == "store" and r.store_url == first.store_url and "asked again every 1s" in r.reason for r in again)
        assert ct.save(state(3), p, deadline_s=2.0) == "store"
        assert fallback.unanswered.why(str(m.mountpoint)) is not None
        child = os.fork()
        if child == 0:
            os._exit(0 if fallback.unanswered.why(str(m.mountpoint)) is None else 1)
        assert os.waitpid(child, 0)[1] == 0
    finally:
        os.kill(m.pid, signal.SIGCONT)
    m.allowed_log_errors.append("the mount shows it now")
    wait_until(lambda: fallback.route(p, 2.0).kind == "mount", 30, "the mount routed to its daemon again")
    wait_until(lambda: not any(t.name.startswith("ckptfs-ask-again") for t in threading.enumerate()), 30, "the asking thread ended")
    assert run_cli("flush", str(m.mountpoint), "--timeout", "60").returncode == 0  # (which takes in what went to the store)
    assert same(ct.load(p), state(3))


def test_a_daemon_that_never_answers_delays_no_other_daemons_return(fresh_mount, tmp_path):
    """Each frozen daemon is asked again on its own: one that never answers
    (each ask waiting its 8 s deadline) does not hold back the return of
    another to its mount (they were asked one after the other: up to 9 s)."""
    m = fresh_mount
    other = start_mount(tmp_path / "other")
    p, q = m.path("x.pt"), other.path("x.pt")
    try:
        os.kill(m.pid, signal.SIGSTOP)
        os.kill(other.pid, signal.SIGSTOP)
        assert fallback.route(q, 8.0).kind == "store"  # (the other first: asked one after the other, it went first)
        assert fallback.route(p, 2.0).kind == "store"
        time.sleep(1.5)  # (an ask of the other is under way)
        os.kill(m.pid, signal.SIGCONT)
        t0 = time.monotonic()
        wait_until(lambda: fallback.unanswered.why(str(m.mountpoint)) is None, 30, "the first daemon asked again")
        assert time.monotonic() - t0 < 4.0
        back = fallback.route(p, 2.0)
        assert back.kind == "mount", back.reason
        assert fallback.unanswered.why(str(other.mountpoint)) is not None
    finally:
        os.kill(m.pid, signal.SIGCONT)
        os.kill(other.pid, signal.SIGCONT)
        stop_mount(other)
    wait_until(lambda: not any(t.name.startswith("ckptfs-ask-again") for t in threading.enumerate()), 30, "the asking threads ended")


_OWN_SAVE = """
import os, sys
from ckptfs.checkpoint import CheckpointManager
from ckptfs.client import Client
from ckptfs.policies import ContinuousCheckpointing
def save_fn(state, d):  # any layout: a file, and one in a directory of its own
    os.makedirs(os.path.join(d, "shards"))
    for name, data in state.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
def load_fn(d):
    return {os.path.relpath(os.path.join(top, n), d): open(os.path.join(top, n), "rb").read() for top, _, ns in os.walk(d) for n in ns}
mgr = CheckpointManager(sys.argv[1], ContinuousCheckpointing(), save_fn=save_fn, load_fn=load_fn, client_timeout=0.5)
saved = {step: {"meta.json": str(step).encode(), "shards/0.bin": os.urandom(100_000)} for step in (1, 2, 3)}
assert mgr.save(1, saved[1])
mgr.wait_until_published(timeout=60)
print("published", flush=True)
sys.stdin.readline()  # the daemon is frozen now
asked, pinged = [], []
status, ping = Client.status, Client.ping
Client.status = lambda self, *a, **kw: (asked.append(kw), status(self, *a, **kw))[1]
Client.ping = lambda self: (pinged.append(1), ping(self))[1]
for step in (2, 3):
    assert mgr.save(step, saved[step])  # continuously
assert len(asked) == 1, asked  # 2: is 1 published? No answer: 2 goes to the store. 3: 2 is in the store, published
assert not pinged  # (the daemon did not answer: not waited for again, by the saves nor the calls below)
assert mgr.all_steps() == [1, 2, 3] and mgr.latest_step() == 3 and all(c.published for c in mgr.checkpoints())
for step in (None, 1):
    got = mgr.restore(step)
    assert got.pop("ckptfs-commit.json") and got == saved[step or 3], got.keys()
assert mgr.prune() == []
assert not pinged
"""


def test_a_manager_whose_daemon_hangs_saves_lists_and_restores_through_the_store(fresh_mount):
    """A manager saves checkpoint 1 into the mount, and its daemon freezes:
    the continuous policy saves on (its question whether 1 is published,
    unanswered, raised DaemonUnavailable into the training loop; the
    daemon is not asked again meanwhile, so no call waits again); the
    save_fn (say, DCP's) writes into a local directory whose files go to
    the store, checksummed, the commit marker last (given the mount's path,
    it blocked for good on the frozen daemon); checkpoints are listed and
    restored from the store (a read of the mount blocked too). (In a
    process of its own: it could not be stopped otherwise.)"""
    m = fresh_mount
    p = subprocess.Popen([sys.executable, "-c", _OWN_SAVE, str(m.path("run"))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "published", p.communicate(timeout=60)[1][-3000:]
        os.kill(m.pid, signal.SIGSTOP)
        try:
            p.stdin.write("frozen\n")
            p.stdin.flush()
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(m.pid, signal.SIGCONT)  # first: what the child waits for in the mount ends, and it can exit
            _, err = signal_and_wait(p, signal.SIGKILL)
            raise AssertionError(f"the manager blocked on the frozen daemon: {err[-2000:]}") from None
        finally:
            os.kill(m.pid, signal.SIGCONT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err[-3000:]
    assert "goes straight to the store" in err
    files = store_files(m.store)
    assert set(files) == {f"run/step-{n}/{name}" for n in (1, 2, 3) for name in ("meta.json", "shards/0.bin", "ckptfs-commit.json")}
    assert files["run/step-2/meta.json"] == b"2" and len(files["run/step-2/shards/0.bin"]) == 100_000
    assert verify_store(m.store).clean
    # The daemon, back, takes what was saved meanwhile into the mount by itself (no flush): a
    # trainer restarted from the mount resumes from checkpoint 3, not 1.
    m.allowed_log_errors.append("the mount shows it now")
    mgr = ct.CheckpointManager(m.path("run"), load_fn=lambda d: {n: (Path(d) / n).read_bytes() for n in ("meta.json", "shards/0.bin")})
    wait_until(lambda: mgr.all_steps() == [1, 2, 3], 30, "checkpoints 2 and 3 in the mount")
    mgr.wait_until_published(timeout=60)  # (taken in, each file is published again: the same bytes)
    assert mgr.latest_step() == 3 and mgr.restore() == {"meta.json": b"3", "shards/0.bin": files["run/step-3/shards/0.bin"]}
    assert run_cli("flush", str(m.mountpoint), "--timeout", "60").returncode == 0
    assert store_files(m.store) == files and verify_store(m.store).clean


_LARGE_SAVE = """
import os, sys
from ckptfs import checkpoint
from ckptfs.checkpoint import CheckpointManager
from ckptfs.policies import EveryNSteps
def anon():
    return next(int(ln.split()[1]) << 10 for ln in open("/proc/self/status") if ln.startswith("RssAnon:"))
def save_fn(state, d):
    piece = os.urandom(16 << 20)
    with open(os.path.join(d, "shard.bin"), "wb") as f:
        for _ in range(16):
            f.write(piece)
seen = {}
write_file = checkpoint.storeio.write_file
def watched(store, path, data):
    seen[path] = anon() - before
    return write_file(store, path, data)
checkpoint.storeio.write_file = watched
mgr = CheckpointManager(sys.argv[1], EveryNSteps(1), save_fn=save_fn, load_fn=lambda d: None, client_timeout=1.0)
before = anon()
assert mgr.save(1, None)
print(seen["run/step-1/shard.bin"] >> 20)
import torch
import ckptfs.torch as ct
t = torch.ones(64 << 20)  # 256 MiB
before = anon()
assert ct.save({"t": t}, os.path.join(sys.argv[1], "t.pt"), deadline_s=1.0) == "store"
print(seen["run/t.pt"] >> 20)
"""

_LARGE_LOAD = """
import os, sys
import torch
import ckptfs.torch as ct
from ckptfs.checkpoint import CheckpointManager
from ckptfs.policies import EveryNSteps
def status(key):
    return next(int(ln.split()[1]) << 10 for ln in open("/proc/self/status") if ln.startswith(key + ":"))
def anon():
    return status("RssAnon")
mgr = CheckpointManager(sys.argv[1], EveryNSteps(1), save_fn=None, load_fn=lambda d: os.path.getsize(os.path.join(d, "shard.bin")),
                        client_timeout=1.0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) is the size now
peak = status("VmHWM")
assert mgr.restore(1) == 256 << 20
print((status("VmHWM") - peak) >> 20)  # the most the restore added
seen = []
load = torch.load
torch.load = lambda f, **kw: (seen.append(anon() - before), load(f, **kw))[1]
before = anon()
assert torch.equal(ct.load(os.path.join(sys.argv[1], "t.pt"), deadline_s=1.0)["t"], torch.ones(64 << 20))
print(seen[0] >> 20)
"""


def test_a_save_or_load_past_a_dead_daemon_never_holds_a_file_whole_in_memory(fresh_mount):
    """A save that goes to the store (the daemon is dead or hung) is
    written to local files first (a manager's `save_fn` into a local
    directory, `ct.save` into a file), which go to the store from there:
    mapped, read from the page cache, never copied into the trainer's
    memory whole (each added 256 MiB to it for a file of 256 MiB, with
    RAM already short: a hung daemon still holds its budget). So are loads
    of them from the store: a restore's and `ct.load`'s."""
    m = fresh_mount
    os.kill(m.pid, signal.SIGKILL)
    m.proc.wait()
    r = subprocess.run([sys.executable, "-c", _LARGE_SAVE, str(m.path("run"))], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [int(mib) < 64 for mib in r.stdout.split()] == [True, True], r.stdout  # MiB of the process's own memory more than before
    files = store_files(m.store)
    assert len(files["run/step-1/shard.bin"]) == 256 << 20 and "run/step-1/ckptfs-commit.json" in files
    assert verify_store(m.store).clean
    # and back: restored and loaded through local files, each verified there
    r = subprocess.run([sys.executable, "-c", _LARGE_LOAD, str(m.path("run"))], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [int(mib) < 64 for mib in r.stdout.split()] == [True, True], r.stdout


def test_a_save_or_load_past_a_dead_daemon_with_no_room_in_tmpdir_is_held_in_memory(fresh_mount, tmp_path):
    """`ct.save`'s and `ct.load`'s fallbacks go through $TMPDIR; where that
    cannot take the file (a full file system here), they hold it in memory,
    as they did before they went through $TMPDIR; a manager's `save_fn`
    saves into /dev/shm then, and its restore copies the checkpoint there."""
    m = fresh_mount
    os.kill(m.pid, signal.SIGKILL)
    m.proc.wait()
    small = tmp_path / "small-tmp"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        three = ("import sys, torch, ckptfs.torch as ct; assert ct.save({'t': torch.ones(1 << 20)}, sys.argv[1] + '/t.pt', deadline_s=1.0) "
                 "== 'store'; assert torch.equal(ct.load(sys.argv[1] + '/t.pt', deadline_s=1.0)['t'], torch.ones(1 << 20));"
                 "mgr = ct.CheckpointManager(sys.argv[1], ct.save_policy.EveryNSteps(1), client_timeout=1.0);"
                 "assert mgr.save(1, {'t': torch.ones(1 << 20)}); assert torch.equal(mgr.restore()['t'], torch.ones(1 << 20))")
        r = subprocess.run([sys.executable, "-c", three, str(m.path("run"))], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "TMPDIR": str(small)})
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    for what in ("save", "load"):
        assert f"cannot {what} into a temporary file in {small}" in r.stderr and f"holding the {what} in memory instead" in r.stderr
    assert f"cannot save into a temporary directory in {small}" in r.stderr and "saving into /dev/shm instead" in r.stderr  # the manager's
    assert f"cannot copy checkpoint 1 into a temporary directory in {small}" in r.stderr and "copying it into /dev/shm instead" in r.stderr
    assert torch.equal(ct.load(m.path("run", "t.pt"))["t"], torch.ones(1 << 20)) and verify_store(m.store).clean
    assert {"run/step-1/state.pt", "run/step-1/ckptfs-commit.json"} <= set(store_files(m.store))


# -- CheckpointManager ----------------------------------------------------------------
def test_manager_every_n_steps_latest_n(mnt):
    mgr = ct.CheckpointManager(mnt / "run", ct.save_policy.EveryNSteps(5), ct.preservation.LatestN(2))
    saved = [step for step in range(1, 21) if mgr.save(step, state(step))]
    assert saved == [5, 10, 15, 20]
    mgr.wait_until_published(timeout=60)
    mgr.prune()
    assert mgr.all_steps() == [15, 20] and mgr.latest_step() == 20
    assert same(mgr.restore(), state(20)) and same(mgr.restore(15), state(15))
    # a new manager over the same directory picks up where it was
    again = ct.CheckpointManager(mnt / "run", ct.save_policy.EveryNSteps(5), ct.preservation.LatestN(2))
    assert again.latest_step() == 20 and not again.should_save(20) and again.should_save(25)


def test_manager_latest_step_ignores_an_incomplete_checkpoint(mnt):
    mgr = ct.CheckpointManager(mnt / "run", ct.save_policy.EveryNSteps(1))
    mgr.save(1, state(1))
    (mnt / "run" / "step-2").mkdir()
    torch.save(state(2), mnt / "run" / "step-2" / "state.pt")  # crashed before its commit marker
    mgr.wait_until_published(timeout=60)
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    assert same(mgr.restore(), state(1))
    with pytest.raises(FileNotFoundError, match="incomplete"):
        mgr.restore(2)


def test_a_resave_of_a_step_that_fails_keeps_the_old_one(fresh_mount):
    """Saving a step that is saved already (`force`, or a time policy after
    a resume that repeats the restored step) deleted the old one first: a
    save that failed, or a trainer killed during it, left no complete
    checkpoint at all, in the mount or (with the deletion published) in the
    store. The new one is made beside it and takes its place once whole."""
    m = fresh_mount
    run = m.path("run")

    def torn(state, directory):
        (Path(directory) / "state.pt").write_bytes(b"half a checkpoint")
        raise RuntimeError("the trainer died here")

    mgr = ct.CheckpointManager(run, ct.save_policy.EveryNSteps(1), ct.preservation.LatestN(1))
    mgr.save(1, state(1))
    mgr.save_fn = torn
    with pytest.raises(RuntimeError, match="died"):
        mgr.save(1, state(99), force=True)
    mgr.wait_until_published(timeout=60)
    again = ct.CheckpointManager(run, ct.save_policy.EveryNSteps(1), ct.preservation.LatestN(1))  # the trainer restarted
    assert again.latest_step() == 1 and same(again.restore(), state(1))
    assert sorted(os.listdir(run)) == ["step-1"]  # what the failed save left beside it is gone
    assert again.save(1, state(2), force=True)  # a re-save that works takes the old one's place
    assert same(again.restore(1), state(2)) and sorted(os.listdir(run)) == ["step-1"]
    again.wait_until_published(timeout=60)
    assert same(torch.load(m.store / "run" / "step-1" / "state.pt", weights_only=False), state(2))
    assert sorted(p for p in store_files(m.store) if p.startswith("run/")) == ["run/step-1/ckptfs-commit.json", "run/step-1/state.pt"]


def test_a_crash_between_the_renames_of_a_resave_is_finished_at_the_next_start(mnt):
    """Killed between moving the old checkpoint aside and moving the new one
    in: the step has no checkpoint in its place. The next manager puts the
    complete one beside it there (the new one first) and removes the rest."""
    run = mnt / "run"
    mgr = ct.CheckpointManager(run, ct.save_policy.EveryNSteps(1))
    mgr.save(3, state(3))
    mgr.save(4, state(4))
    os.rename(run / "step-3", run / "step-3.prev")  # the old 3, moved aside; the new one is complete beside it
    mgr.save(5, state(30))
    os.rename(run / "step-5", run / "step-3.next")
    os.rename(run / "step-4", run / "step-4.prev")  # only the old 4 is left, and a torn new one
    (run / "step-4.next").mkdir()
    again = ct.CheckpointManager(run, ct.save_policy.EveryNSteps(1))
    assert again.all_steps() == [3, 4] and sorted(os.listdir(run)) == ["step-3", "step-4"]
    assert same(again.restore(3), state(30)) and same(again.restore(4), state(4))


def test_manager_pruning_keeps_the_last_published_until_its_successor_is(fresh_mount):
    m = fresh_mount
    m.allowed_log_errors += OUTAGE_LOG
    mgr = ct.CheckpointManager(m.path("run"), ct.save_policy.EveryNSteps(1), ct.preservation.LatestN(1))
    mgr.save(1, state(1))
    mgr.wait_until_published(timeout=60)
    with store_outage(m.store):
        mgr.save(2, state(2))
        mgr.save(3, state(3))
        # 1 is the only published checkpoint: it stays, and restores, while 2 and 3 cannot be published
        assert mgr.latest_step() == 1 and 1 in mgr.all_steps() and 3 in mgr.all_steps()
        assert same(mgr.restore(), state(1))
        assert 2 not in mgr.all_steps()  # unpublished and dropped by the policy: never reaches the store (C4)
    mgr.wait_until_published(timeout=60)
    mgr.prune()
    assert mgr.all_steps() == [3] and mgr.latest_step() == 3
    ct.CheckpointManager(m.path("run")).wait_until_published(timeout=60)
    assert sorted(p for p in store_files(m.store) if p.startswith("run/")) == ["run/step-3/ckptfs-commit.json", "run/step-3/state.pt"]


def test_continuous_checkpointing_never_has_two_in_flight(fresh_mount):
    m = fresh_mount
    m.allowed_log_errors += OUTAGE_LOG
    mgr = ct.CheckpointManager(m.path("run"), ct.save_policy.ContinuousCheckpointing(minimum_interval_secs=0))
    assert mgr.save(1, state(1))
    mgr.wait_until_published(timeout=60)
    with store_outage(m.store):
        assert mgr.save(2, state(2))  # the previous one is published
        time.sleep(0.5)
        assert not any(mgr.should_save(s) for s in range(3, 10))  # 2 is still in flight
    mgr.wait_until_published(timeout=60)
    assert mgr.should_save(3) and mgr.save(3, state(3))
    throttled = ct.CheckpointManager(m.path("slow"), ct.save_policy.ContinuousCheckpointing(minimum_interval_secs=3600))
    assert throttled.save(1, state(1)) and not throttled.save(2, state(2))


def test_manager_every_n_seconds_and_composed_preservation(mnt):
    keep_evens = ct.preservation.Custom(lambda cps: [c.step for c in cps if c.step % 2 == 0])
    mgr = ct.CheckpointManager(mnt / "run", ct.save_policy.EveryNSeconds(0.2), ct.preservation.any_of(ct.preservation.LatestN(1), keep_evens))
    saved = []
    for step in range(1, 40):
        if mgr.save(step, state(step)):
            saved.append(step)
        time.sleep(0.05)
    assert 3 <= len(saved) <= 15 and saved[0] == 1  # every ~0.2 s, not every step
    mgr.wait_until_published(timeout=60)
    mgr.prune()
    assert mgr.all_steps() == sorted({s for s in saved if s % 2 == 0} | {saved[-1]})


def test_manager_with_torch_distributed_checkpoint(mnt):
    import torch.distributed.checkpoint as dcp

    def save_fn(s, d):
        dcp.save(s, checkpoint_id=d)

    def load_fn(d):
        target = {"w": torch.zeros(64, 64), "step": torch.tensor(0)}
        dcp.load(target, checkpoint_id=d)
        return target

    mgr = ct.CheckpointManager(mnt / "dcp", ct.save_policy.EveryNSteps(2), ct.preservation.LatestN(2), save_fn=save_fn, load_fn=load_fn)
    for step in range(1, 7):
        mgr.save(step, {"w": torch.full((64, 64), float(step)), "step": torch.tensor(step)})
    mgr.wait_until_published(timeout=60)
    mgr.prune()
    assert mgr.all_steps() == [4, 6]
    got = mgr.restore()
    assert int(got["step"]) == 6 and torch.equal(got["w"], torch.full((64, 64), 6.0))
    assert {".metadata", "ckptfs-commit.json"} <= set(os.listdir(mnt / "dcp" / "step-6"))


# -- dying gasp --------------------------------------------------------------------------
def _trainer(directory: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPTS / "gasp_trainer.py"), str(directory), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_started(p: subprocess.Popen) -> None:
    line = p.stdout.readline()
    if line.strip() != "started":
        p.kill()
        _, err = p.communicate()
        raise AssertionError(f"the trainer did not start: {line}{err}")


def test_dying_gasp_on_sigterm_at_random_points(fresh_mount):
    """Six trainers, each signalled at a random time after it started (they
    run side by side: most of each run is starting Python and torch)."""
    from concurrent.futures import ThreadPoolExecutor

    m = fresh_mount
    rng = random.Random(20261121)
    pauses = [rng.uniform(0.05, 0.6) for _ in range(6)]  # lands inside or outside the update section

    def run(i: int) -> tuple[int, str, str, bool]:
        p = _trainer(m.path(f"gasp-{i}"), "run")
        _wait_started(p)
        time.sleep(pauses[i])
        out, err = signal_and_wait(p, signal.SIGTERM, 120)
        return p.returncode, out, err, (m.store / f"gasp-{i}" / "dying-gasp.pt").exists()  # as it exited

    with ThreadPoolExecutor(len(pauses)) as pool:
        runs = list(pool.map(run, range(len(pauses))))
    for i, (returncode, out, err, stored_at_exit) in enumerate(runs):
        assert returncode == 143, err  # 128 + SIGTERM, after the gasp
        completed = [int(line.split()[1]) for line in out.splitlines() if line.startswith("completed")]
        last = completed[-1] if completed else 0
        assert "published" in err, err
        # published and verified in the store before the process exited
        assert stored_at_exit, err
        stored = m.store / f"gasp-{i}" / "dying-gasp.pt"
        saved = torch.load(stored, weights_only=False)
        # never torn: every element from one step, and that step is the last completed one
        assert torch.all(saved["w"] == saved["step"]), f"torn state: {saved['w'].unique()}"
        assert last <= saved["step"] <= last + 1, (last, saved["step"])
    assert verify_store(m.store).clean


def test_dying_gasp_saves_nothing_after_an_exception_inside_the_update(fresh_mount):
    m = fresh_mount
    p = _trainer(m.path("torn"), "raise-in-update")
    _out, err = p.communicate(timeout=120)
    assert p.returncode == 1
    assert "NOT saving" in err and "torn" in err and "NaN in optimizer step" in err
    assert not m.path("torn", "dying-gasp.pt").exists()


def test_dying_gasp_saves_on_an_exception_outside_the_update_and_reraises(fresh_mount):
    m = fresh_mount
    p = _trainer(m.path("crash"), "raise-outside")
    _out, err = p.communicate(timeout=120)
    assert p.returncode == 1 and "ValueError: data loader failed" in err  # re-raised
    saved = torch.load(m.store / "crash" / "dying-gasp.pt", weights_only=False)  # published before exit
    assert saved["step"] == 4 and torch.all(saved["w"] == 4)


def test_dying_gasp_second_signal_stops_the_wait(fresh_mount):
    m = fresh_mount
    m.allowed_log_errors += OUTAGE_LOG
    with store_outage(m.store):
        p = _trainer(m.path("abort"), "run")
        try:
            _wait_started(p)
            time.sleep(0.2)
            p.send_signal(signal.SIGTERM)
            wait_until(lambda: m.path("abort", "dying-gasp.pt").exists(), 60, "the gasp saved into RAM")
            time.sleep(0.5)
            assert p.poll() is None  # waiting for the store
            _out, err = signal_and_wait(p, signal.SIGTERM, 30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert p.returncode == 143 and "second signal" in err and "stopped waiting" in err


# -- advise --measure --------------------------------------------------------------------
def test_advise_measures_a_real_save(mnt):
    r = run_cli("advise", "--measure", str(mnt), "--size", "64M", "--mtbf-hours", "12", "--json")
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout)
    assert 0 < out["save_s"] < 60 and out["daly_s"] > 0 and os.listdir(mnt) == []


def test_store_fallback_is_seen_after_a_remount(tmp_path):
    """A file the fallback wrote to the store shows up in the next mount (C9)."""
    from tests.mountutil import start_mount, stop_mount

    m = start_mount(tmp_path)
    try:
        os.kill(m.pid, signal.SIGKILL)
        m.proc.wait()
        assert ct.save(state(7), m.path("ck", "s.pt"), deadline_s=1.0) == "store"
    finally:
        stop_mount(m)
    m = start_mount(tmp_path)
    try:
        assert same(ct.load(m.path("ck", "s.pt")), state(7))
        backend = open_store(str(m.store))
        assert backend.exists("ck/s.pt")
    finally:
        stop_mount(m)


def test_a_fallback_save_is_not_overwritten_by_the_daemons_older_generation(fresh_mount):
    """Generation A is queued in the daemon (the store is down); the daemon
    then hangs and `ckptfs.torch.save` writes a newer B straight to the
    store. When the daemon is back it must not publish A over B, and the
    mount shows B (it showed A until the next mount: a trainer restarted
    from it loaded the older checkpoint)."""
    m = fresh_mount
    m.allowed_log_errors += [*OUTAGE_LOG, "keeping it", "retrying", "the mount shows it now"]
    p = m.path("run", "model.pt")
    assert ct.save(state(1), p) == "mount"
    ct.CheckpointManager(m.path("run")).wait_until_published(timeout=60)
    with store_outage(m.store):
        assert ct.save(state(2), p) == "mount"  # queued: the store is down
        time.sleep(1.0)
        os.kill(m.pid, signal.SIGSTOP)
    try:
        assert ct.save(state(3), p, deadline_s=2.0) == "store"  # the daemon hangs: straight to the store
    finally:
        os.kill(m.pid, signal.SIGCONT)
    assert run_cli("flush", str(m.mountpoint), "--timeout", "120").returncode == 0
    assert same(torch.load(m.store / "run" / "model.pt", weights_only=False), state(3))
    assert same(torch.load(p, weights_only=False), state(3))  # the name the kernel had cached, looked up again
    assert same(ct.load(p), state(3)) and os.listdir(m.path("run")) == ["model.pt"]
    assert verify_store(m.store).clean
