"""Training helpers for torch: save/load with fallback, continuous
checkpointing with retention, and the dying gasp. Importing `ckptfs` never
imports torch; this module does.

    import ckptfs.torch as ct
    ct.save(model.state_dict(), "/mnt/ckpt/run1/model.pt")     # RAM speed, or straight to the store
    mgr = ct.CheckpointManager("/mnt/ckpt/run1", policy=ct.save_policy.ContinuousCheckpointing(30),
                               preservation=ct.preservation.LatestN(2))
    with ct.dying_gasp(lambda: {"model": model.state_dict(), "step": step}, "/mnt/ckpt/run1") as gasp:
        for step in ...:
            ...
            with gasp.update():
                optimizer.step()
            mgr.save(step, {"model": model.state_dict(), "step": step})
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import types
from collections.abc import Callable
from typing import Any

import torch

from ckptfs import checkpoint, fallback, policies
from ckptfs.client import CkptfsError, Client
from ckptfs.gasp import DyingGasp

log = logging.getLogger("ckptfs.torch")

DEADLINE_S = 5.0  # how long the daemon may take to answer before the store is written directly
STATE_FILE = "state.pt"
GASP_FILE = "dying-gasp.pt"

save_policy = types.SimpleNamespace(
    EveryNSteps=policies.EveryNSteps, EveryNSeconds=policies.EveryNSeconds,
    ContinuousCheckpointing=policies.ContinuousCheckpointing, AnyOf=policies.AnySavePolicy, any_of=policies.any_of)
preservation = types.SimpleNamespace(
    LatestN=policies.LatestN, EveryNSeconds=policies.KeepEveryNSeconds, EveryNSteps=policies.KeepEveryNSteps,
    AnyOf=policies.AnyPreservation, Custom=policies.CustomPreservation, KeepAll=policies.KeepAll, any_of=policies.any_of)


def save(obj: Any, path: str | os.PathLike[str], *, deadline_s: float = DEADLINE_S, storage_options: dict | None = None,
         **torch_kwargs: Any) -> str:
    """torch.save `obj` to `path`; returns where it went: "mount", "store" or
    "plain" (not a ckptfs path: a plain torch.save).

    On a ckptfs mount whose daemon answers within `deadline_s`, the save is
    written under a temporary name and renamed (so a crash mid-save never
    leaves a torn file to publish). If the daemon does not answer, the mount
    is gone, or the write fails, the bytes go straight to the same relative
    path in the store (staged, checksummed in the manifest, published in one
    step), with a warning: saved into a local temporary file ($TMPDIR) first,
    and sent from there, never held in memory whole (in memory only if
    $TMPDIR cannot take it). Credentials for that come from
    `storage_options` or $CKPTFS_STORE_OPTIONS.
    """
    r = fallback.route(path, deadline_s)
    if r.kind == "plain":
        torch.save(obj, r.path, **torch_kwargs)
        return "plain"
    if r.kind == "mount":
        tmp = os.path.join(os.path.dirname(r.path), f".{os.path.basename(r.path)}.ckptfs-tmp-{os.getpid()}")
        try:
            os.makedirs(os.path.dirname(r.path), exist_ok=True)
            torch.save(obj, tmp, **torch_kwargs)
            os.replace(tmp, r.path)
            return "mount"
        except OSError as exc:
            log.warning("saving %s into the mount failed (%s); writing it straight to the store", r.path, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            r = _store_route(r, exc)
    else:
        log.warning("ckptfs: %s; writing %s straight to the store %s", r.reason, r.relpath, r.store_url)
    from ckptfs.writeback.storeio import write_file

    backend = fallback.open_route_store(r, storage_options)
    with contextlib.ExitStack() as held:
        digest = write_file(backend, r.relpath, _saved_here(obj, torch_kwargs, held))
    log.warning("ckptfs: saved %s to the store directly (%d bytes, xxh3 %s)", r.relpath, digest.size, digest.xxh3)
    return "store"


def _saved_here(obj: Any, torch_kwargs: dict, held: contextlib.ExitStack) -> Any:
    """`obj` torch.saved on this machine, for the store: into a temporary
    file in $TMPDIR (as the manager's saves), mapped, never whole in memory;
    into memory if $TMPDIR cannot take it (full, read-only)."""
    try:
        local = held.enter_context(tempfile.TemporaryDirectory(prefix="ckptfs-fallback-"))
        torch.save(obj, os.path.join(local, "state"), **torch_kwargs)
        return held.enter_context(fallback.mapped(os.path.join(local, "state")))
    except (OSError, RuntimeError) as exc:  # (torch's file writer says a full disk with a RuntimeError)
        log.warning("ckptfs: cannot save into a temporary file in %s (%s); holding the save in memory instead",
                    tempfile.gettempdir(), fallback.said(exc))
        buf = io.BytesIO()
        torch.save(obj, buf, **torch_kwargs)
        return buf.getbuffer()


def load(path: str | os.PathLike[str], *, deadline_s: float = DEADLINE_S, storage_options: dict | None = None,
         **torch_kwargs: Any) -> Any:
    """torch.load from the mount, or, if the mount cannot serve, from the same
    relative path in the store, verified against its checksum: through a
    local temporary file ($TMPDIR), never whole in memory (in memory only if
    $TMPDIR is full or read-only)."""
    torch_kwargs.setdefault("weights_only", False)
    r = fallback.route(path, deadline_s)
    if r.kind in ("plain", "mount"):
        try:
            return torch.load(r.path, **torch_kwargs)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if r.kind == "plain":
                raise
            log.warning("loading %s from the mount failed (%s); reading it from the store", r.path, exc)
            r = _store_route(r, exc)
    else:
        log.warning("ckptfs: %s; loading %s from the store %s", r.reason, r.relpath, r.store_url)
    from ckptfs.writeback.storeio import copy_file, read_file

    backend = fallback.open_route_store(r, storage_options)
    try:
        with tempfile.TemporaryDirectory(prefix="ckptfs-fallback-") as local:  # (verified there, never whole in memory)
            with open(os.path.join(local, "state"), "wb") as f:
                copy_file(backend, r.relpath, f)
            return torch.load(os.path.join(local, "state"), **torch_kwargs)
    except OSError as exc:
        if exc.errno not in fallback.LOCAL_FULL:
            raise  # (the store's: a read from it never says a disk is full)
        log.warning("ckptfs: cannot load into a temporary file in %s (%s); holding the load in memory instead",
                    tempfile.gettempdir(), exc)
    return torch.load(io.BytesIO(read_file(backend, r.relpath)), **torch_kwargs)


def _store_route(r: fallback.Route, exc: OSError) -> fallback.Route:
    """The store behind a mount route whose I/O failed; re-raises `exc` if unknown."""
    from ckptfs import runtime
    from ckptfs.client import find_mount

    try:
        info = runtime.MountInfo.read(find_mount(r.path)[0])
    except CkptfsError:
        info = None
    if info is None:
        raise exc
    return fallback.Route("store", r.path, r.relpath, info.store_url, str(exc))


# -- checkpoint manager ---------------------------------------------------------------
def _save_state(state: Any, directory: str) -> None:
    save(state, os.path.join(directory, STATE_FILE))


def _load_state(directory: str) -> Any:
    return load(os.path.join(directory, STATE_FILE))


class CheckpointManager(checkpoint.CheckpointManager):
    """`ckptfs.checkpoint.CheckpointManager` saving with `save` (one
    `state.pt` per step, fallback included) unless given another
    `save_fn`/`load_fn` (e.g. torch.distributed.checkpoint into the step
    directory). The default policy is continuous checkpointing."""

    def __init__(self, directory: str | os.PathLike[str], policy: policies.SavePolicy | None = None,
                 preservation: policies.PreservationPolicy | None = None, *, save_fn: Callable[[Any, str], None] = _save_state,
                 load_fn: Callable[[str], Any] = _load_state, client_timeout: float = DEADLINE_S) -> None:
        super().__init__(directory, policy or policies.ContinuousCheckpointing(), preservation,
                         save_fn=save_fn, load_fn=load_fn, client_timeout=client_timeout)


# -- dying gasp -----------------------------------------------------------------------
def dying_gasp(state_fn: Callable[[], Any], directory: str | os.PathLike[str], *, deadline_s: float = 60.0,
               filename: str = GASP_FILE) -> DyingGasp:
    """See ckptfs.gasp. Saves `state_fn()` with `save` (fallback included) to
    `directory/filename` and waits until it is published."""
    path = os.path.join(os.path.abspath(directory), filename)

    def save_gasp(state: Any, p: str) -> None:
        save_gasp.where = save(state, p, deadline_s=min(DEADLINE_S, deadline_s))  # type: ignore[attr-defined]

    def wait(p: str, timeout: float) -> None:
        if getattr(save_gasp, "where", "") == "mount":  # the store and plain files are durable already
            Client(p, timeout=min(DEADLINE_S, max(timeout, 0.5))).flush(p, timeout=timeout)

    return DyingGasp(state_fn, save_gasp, path, deadline_s=deadline_s, wait_fn=wait)


__all__ = ["CheckpointManager", "dying_gasp", "load", "preservation", "save", "save_policy"]
