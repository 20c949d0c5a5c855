"""`CheckpointManager`: numbered checkpoints in a directory, saved by policy,
pruned by policy, restored from the latest one that is complete *and*
published. Framework-agnostic: the caller's `save_fn(state, directory)` writes
any layout (a torch.save file, a DCP directory, ...); `ckptfs.torch` gives
torch defaults.

Layout: `<directory>/step-<N>/` holds what `save_fn` wrote, then a commit
marker `ckptfs-commit.json` written last. A checkpoint is *complete* when its
marker exists; it is *published* when the marker is in the store, which by
C3 (ordered publication) means everything saved before it is too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptfs import fallback
from ckptfs.client import CkptfsError, Client, DaemonUnavailable, RequestFailed, find_mount
from ckptfs.writeback import storeio

from .policies import Checkpoint, KeepAll, PreservationPolicy, SaveContext, SavePolicy

if TYPE_CHECKING:
    from ckptfs.writeback.backend import Backend

log = logging.getLogger("ckptfs.checkpoint")

MARKER = "ckptfs-commit.json"
SHM = "/dev/shm"  # where a save or restore past a hung daemon goes when $TMPDIR cannot take it
NEXT, PREV = ".next", ".prev"  # a re-save of a step is made beside it, then takes its place (`_swap_in`)
_STEP_DIR = re.compile(r"^step-(\d+)$")
_STORED_MARKER = re.compile(rf"step-(\d+)/{re.escape(MARKER)}")
_SWAP_DIR = re.compile(r"^step-(\d+)(\.next|\.prev)$")


class CheckpointManager:
    def __init__(self, directory: str | os.PathLike[str], policy: SavePolicy, preservation: PreservationPolicy | None = None, *,
                 save_fn: Callable[[Any, str], None], load_fn: Callable[[str], Any], client_timeout: float = 5.0) -> None:
        self.directory = os.path.abspath(directory)
        self.policy = policy
        self.preservation = preservation or KeepAll()
        self.save_fn = save_fn
        self.load_fn = load_fn
        self.client_timeout = client_timeout
        self._last_step: int | None = None
        self._last_in_store = False  # the last save went straight to the store: published when it returned
        self._last_time: float | None = None
        r = fallback.route(self.directory, client_timeout)
        if r.kind == "store":  # a hung or dead daemon: touching the mount could block forever
            log.warning("%s: %s; checkpoints will go straight to the store", self.directory, r.reason)
            return
        os.makedirs(self.directory, exist_ok=True)
        self._finish_swaps()
        latest = self._complete()
        if latest:
            self._last_step, self._last_time = latest[-1].step, latest[-1].time

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step}")

    # -- saving -----------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return self.policy.should_save(step, SaveContext(self._last_step, self._last_time, self._previous_published))

    def save(self, step: int, state: Any, force: bool = False) -> bool:
        """Save `state` as checkpoint `step` if the policy says so (or
        `force`); prune by the preservation policy. True if saved."""
        if not force and not self.should_save(step):
            return False
        d = self.step_dir(step)
        now = time.time()
        marker = json.dumps({"step": step, "time": now})
        r = fallback.route(d, self.client_timeout)
        if r.kind == "store":  # the daemon cannot serve: never touch the mount (C7)
            log.warning("checkpoint %d goes straight to the store %s: %s", step, r.store_url, r.reason)
            self._save_to_store(r, state, marker)
            self._last_step, self._last_time, self._last_in_store = step, now, True
            return True
        # A re-save of a complete checkpoint goes beside it and takes its place
        # only once complete: deleting it first would leave none at all (in the
        # mount, and in the store once the deletion is published) if this save
        # failed or the trainer died during it.
        work = d + NEXT if self._is_complete(step) else d
        if os.path.exists(work):
            shutil.rmtree(work)  # an incomplete one from a crash
        os.makedirs(work)
        self.save_fn(state, work)
        with open(os.path.join(work, MARKER), "w") as f:  # last: makes it complete
            f.write(marker)
        if work != d:
            self._swap_in(step)
        self._last_step, self._last_time, self._last_in_store = step, now, False
        self.prune()
        return True

    def _save_to_store(self, r: fallback.Route, state: Any, marker: str) -> None:
        """`save_fn` writes into a local temporary directory (given the
        mount's path, a save_fn of the user's own, such as DCP's, blocked
        for good on the hung daemon); then each file it wrote goes to the
        store under the step's path, from there (`fallback.mapped`),
        checksummed and recorded as the daemon would, and the commit
        marker last."""
        store = fallback.open_route_store(r)
        with contextlib.ExitStack() as held:
            local = self._saved_here(state, held)
            for top, dirs, files in os.walk(local):
                dirs.sort()
                for name in sorted(files):
                    path = os.path.join(top, name)
                    with fallback.mapped(path) as data:
                        storeio.write_file(store, f"{r.relpath}/{os.path.relpath(path, local)}", data)
        storeio.write_file(store, f"{r.relpath}/{MARKER}", marker.encode())

    def _saved_here(self, state: Any, held: contextlib.ExitStack) -> str:
        """`save_fn` into a temporary directory in $TMPDIR; in RAM (/dev/shm)
        if $TMPDIR cannot take it (full, read-only), as `ct.save`'s own
        fallback holds its save in memory then. The directory it saved in."""
        try:
            local = held.enter_context(tempfile.TemporaryDirectory(prefix="ckptfs-fallback-"))
            self.save_fn(state, local)
            return local
        except (OSError, RuntimeError) as exc:  # (torch's file writer says a full disk with a RuntimeError)
            if not os.path.isdir(SHM):
                raise
            log.warning("%s: cannot save into a temporary directory in %s (%s); saving into %s instead", self.directory,
                        tempfile.gettempdir(), fallback.said(exc), SHM)
        local = held.enter_context(tempfile.TemporaryDirectory(prefix="ckptfs-fallback-", dir=SHM))
        self.save_fn(state, local)
        return local

    def wait_until_published(self, timeout: float | None = None) -> None:
        """Until every checkpoint saved so far is in the store (a no-op
        outside ckptfs). Raises ckptfs.client.FlushIncomplete on timeout,
        or when what is left can never be published as it is (parked)."""
        client = self._client()
        if client is not None:
            client.flush(self.directory, timeout=timeout)

    # -- reading ----------------------------------------------------------------
    # With the daemon hung, each reads the store instead: what it holds is
    # complete (its marker there) and published, and the mount is never
    # touched (a hung daemon's mount blocks whatever looks into it).
    def all_steps(self) -> list[int]:
        """Complete checkpoints, published or not, oldest first."""
        r = self._route()
        return [c.step for c in (self._in_store(r) if r.kind == "store" else self._complete())]

    def latest_step(self) -> int | None:
        """The newest checkpoint that is complete and published."""
        published = [c.step for c in self.checkpoints() if c.published]
        return published[-1] if published else None

    def checkpoints(self) -> list[Checkpoint]:
        r = self._route()
        if r.kind == "store":
            return self._in_store(r)
        found = self._complete()
        states = self._states()
        return [Checkpoint(c.step, c.time, c.path, states is None or states.get(f"{c.path}/{MARKER}") == "published") for c in found]

    def restore(self, step: int | None = None) -> Any:
        """Load checkpoint `step` (default: the latest published one)."""
        r = self._route()
        if r.kind == "store":
            return self._restore_from_store(r, step)
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no published checkpoint in {self.directory}")
        if not os.path.exists(os.path.join(self.step_dir(step), MARKER)):
            raise FileNotFoundError(f"checkpoint {step} in {self.directory} is missing or incomplete")
        return self.load_fn(self.step_dir(step))

    # -- pruning ----------------------------------------------------------------
    def prune(self) -> list[int]:
        """Delete what the preservation policy drops, except the newest
        published checkpoint, which stays until a newer one is published
        (an unpublished one dropped meanwhile never reaches the store, C4).
        Incomplete directories older than it (crashed saves) go too.
        Nothing, with the daemon hung (the store is the daemon's to change)."""
        r = self._route()
        if r.kind == "store":
            log.warning("%s: %s; pruning nothing", self.directory, r.reason)
            return []
        cps = self.checkpoints()
        keep = set(self.preservation.keep(cps))
        published = [c.step for c in cps if c.published]
        newest_published = published[-1] if published else None
        if newest_published is not None:
            keep.add(newest_published)
        deleted = []
        for c in cps:
            if c.step in keep:
                continue
            shutil.rmtree(self.step_dir(c.step), ignore_errors=True)
            deleted.append(c.step)
        complete = {c.step for c in cps}
        for step in self._step_dirs():
            if step not in complete and newest_published is not None and step < newest_published:
                shutil.rmtree(self.step_dir(step), ignore_errors=True)  # a crashed save
        if deleted:
            log.info("pruned checkpoints %s from %s", deleted, self.directory)
        return deleted

    # -- internals ----------------------------------------------------------------
    def _route(self) -> fallback.Route:
        return fallback.route(self.directory, self.client_timeout)

    def _in_store(self, r: fallback.Route) -> list[Checkpoint]:
        """The checkpoints whose markers are in the store behind a hung
        daemon's mount, oldest first."""
        store = fallback.open_route_store(r)
        prefix = f"{r.relpath}/" if r.relpath else ""
        out = []
        for path in store.find(r.relpath):
            m = _STORED_MARKER.fullmatch(path.removeprefix(prefix))
            if m is None:
                continue
            try:
                t = float(json.loads(storeio.read_file(store, path))["time"])
            except storeio.IntegrityError as exc:  # its bytes are not what was written: not a checkpoint to load
                log.warning("%s: leaving checkpoint %s out: %s", self.directory, m.group(1), exc)
                continue
            except (ValueError, KeyError, TypeError, FileNotFoundError):  # garbled, or gone since it was listed
                continue
            out.append(Checkpoint(int(m.group(1)), t, f"step-{m.group(1)}", True))
        return sorted(out, key=lambda c: c.step)

    def _restore_from_store(self, r: fallback.Route, step: int | None) -> Any:
        """`load_fn` of a local temporary directory holding checkpoint
        `step`'s files from the store, each verified against its checksum
        (deleted once `load_fn` returns)."""
        steps = [c.step for c in self._in_store(r)]
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint in the store {r.store_url} for {self.directory}")
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(f"checkpoint {step} of {self.directory} is not in the store {r.store_url}, or incomplete")
        log.warning("%s: %s; loading checkpoint %d from the store %s", self.directory, r.reason, step, r.store_url)
        store = fallback.open_route_store(r)
        base = f"{r.relpath}/step-{step}" if r.relpath else f"step-{step}"
        with contextlib.ExitStack() as held:
            return self.load_fn(self._copied_here(store, base, step, held))

    def _copied_here(self, store: Backend, base: str, step: int, held: contextlib.ExitStack) -> str:
        """The store's files under `base` (checkpoint `step`), each verified,
        into a temporary directory in $TMPDIR; in RAM (/dev/shm) if $TMPDIR
        cannot take them (full, read-only), as `_saved_here` saves there.
        The directory they are in."""
        paths = store.find(base)
        try:
            with contextlib.ExitStack() as here:
                local = here.enter_context(tempfile.TemporaryDirectory(prefix="ckptfs-fallback-"))
                _copy(store, base, paths, local)
                held.push(here.pop_all())
                return local
        except OSError as exc:
            if exc.errno not in fallback.LOCAL_FULL or not os.path.isdir(SHM):
                raise  # (the store's: a read from it never says a disk is full)
            log.warning("%s: cannot copy checkpoint %d into a temporary directory in %s (%s); copying it into %s instead",
                        self.directory, step, tempfile.gettempdir(), fallback.said(exc), SHM)
        local = held.enter_context(tempfile.TemporaryDirectory(prefix="ckptfs-fallback-", dir=SHM))
        _copy(store, base, paths, local)
        return local

    def _swap_in(self, step: int) -> None:
        """The complete re-save of `step` (in `step-N.next`) takes the place
        of the old one, which is then deleted. Each step is one rename or one
        deletion, published in order (C3): a crash between them leaves a
        complete checkpoint under one of the names, and `_finish_swaps` puts
        it back in place."""
        d = self.step_dir(step)
        shutil.rmtree(d + PREV, ignore_errors=True)
        os.rename(d, d + PREV)
        os.rename(d + NEXT, d)
        shutil.rmtree(d + PREV)

    def _finish_swaps(self) -> None:
        """After a crash during a re-save: where a step has no complete
        checkpoint in its place, the complete one beside it (the new one
        first) takes it; what is left beside any step goes."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for step in sorted({int(m.group(1)) for n in names if (m := _SWAP_DIR.match(n))}):
            d = self.step_dir(step)
            if not self._is_complete(step):
                for kind in (NEXT, PREV):
                    if self._is_complete(step, kind):
                        shutil.rmtree(d, ignore_errors=True)
                        os.rename(d + kind, d)
                        break
            for kind in (NEXT, PREV):
                shutil.rmtree(d + kind, ignore_errors=True)

    def _is_complete(self, step: int, suffix: str = "") -> bool:
        return os.path.isfile(os.path.join(self.step_dir(step) + suffix, MARKER))

    def _step_dirs(self) -> list[int]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.match(n)))

    def _complete(self) -> list[Checkpoint]:
        out = []
        for step in self._step_dirs():
            try:
                with open(os.path.join(self.step_dir(step), MARKER)) as f:
                    t = float(json.load(f)["time"])
            except (OSError, ValueError, KeyError):
                continue
            out.append(Checkpoint(step, t, f"step-{step}", True))
        return out

    def _client(self) -> Client | None:
        try:
            find_mount(self.directory)
        except CkptfsError:
            return None  # not on ckptfs: every saved file is as durable as it gets
        return Client(self.directory, timeout=self.client_timeout)

    def _states(self) -> dict[str, str] | None:
        """State of each file under the directory, relative to it; None when
        not on ckptfs (everything counts as published)."""
        client = self._client()
        if client is None:
            return None
        rows = client.status(files=True, path=self.directory)["files"]
        prefix = client.relpath + "/" if client.relpath else ""
        return {r["path"].removeprefix(prefix): r["state"] for r in rows}

    def _previous_published(self) -> bool:
        if self._last_step is None or self._last_in_store:  # (not asking a daemon that did not answer, for each step again)
            return True
        client = self._client()
        if client is None or fallback.unanswered.why(client.mountpoint) is not None:
            return True  # (not on ckptfs; or the daemon did not answer lately: the next save goes to the store)
        marker = os.path.join(self.step_dir(self._last_step), MARKER)
        try:
            rows = client.status(files=True, path=marker)["files"]
        except RequestFailed:  # pruned or deleted meanwhile: nothing in flight
            return True
        except DaemonUnavailable as exc:  # hung or gone: the next save goes to the store, with nothing of the daemon's in flight before it
            if exc.hung:
                fallback.unanswered.add(client.mountpoint, str(exc), self.client_timeout)
            return True
        return all(r["state"] == "published" for r in rows)


def _copy(store: Backend, base: str, paths: list[str], local: str) -> None:
    """The store's files `paths` under `base` into the directory `local`, each verified."""
    for path in paths:
        dst = os.path.join(local, path.removeprefix(base + "/"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            storeio.copy_file(store, path, f)
