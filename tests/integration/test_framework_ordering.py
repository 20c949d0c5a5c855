"""Real frameworks saving through a mount while a watcher reads the store:
Orbax's CheckpointManager (jax on CPU) and Hugging Face's Trainer with
`save_total_limit`. The store may lag the mount, never contradict it."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.hfutil import tiny_gpt2, tiny_tokens
from tests.mountutil import run_cli, start_mount, stop_mount
from tests.storeutil import StoreWatcher, store_files, verify_store, wait_until


class Observed:
    """Every distinct file set seen in the store under each step directory;
    `split(path)` gives (step, path inside the step) or None."""

    def __init__(self, split) -> None:
        self.split = split
        self.first: dict[str, frozenset[str]] = {}  # the first file set seen under each step
        self.first_at: dict[str, float] = {}  # when the snapshot that first showed each step was taken (its end)
        self.sets: dict[str, set[frozenset[str]]] = {}
        self.lock = threading.Lock()

    def __call__(self, snap: dict) -> list[str]:
        by_step: dict[str, set[str]] = {}
        for path in snap:
            found = self.split(path)
            if found is not None:
                by_step.setdefault(found[0], set()).add(found[1])
        with self.lock:
            for step, files in by_step.items():
                self.first.setdefault(step, frozenset(files))
                self.first_at.setdefault(step, time.monotonic())
                self.sets.setdefault(step, set()).add(frozenset(files))
        return []


def test_orbax_checkpoint_manager_steps_appear_whole(tmp_path):
    jnp = pytest.importorskip("jax.numpy")
    ocp = pytest.importorskip("orbax.checkpoint")
    m = start_mount(tmp_path)
    expected: dict[str, frozenset[str]] = {}

    def split(path: str) -> tuple[str, str] | None:
        parts = path.split("/", 2)
        return (parts[1], parts[2]) if len(parts) == 3 and parts[0] == "run" and parts[1].isdigit() else None

    seen = Observed(split)
    saving: dict[str, float] = {}  # when the save of each step began
    try:
        with StoreWatcher(m.store, seen) as w:
            options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
            with ocp.CheckpointManager(m.path("run"), options=options) as mngr:
                for step in range(5):
                    state = {"w": jnp.full((256, 64), float(step)), "b": jnp.arange(64.0) + step,
                             **{f"layer{i}": jnp.full((512, 256), float(step + i)) for i in range(4)}}
                    saving[str(step)] = time.monotonic()
                    mngr.save(step, args=ocp.args.StandardSave(state))
                    mngr.wait_until_finished()
                    root = m.path("run", str(step))
                    expected[str(step)] = frozenset(os.path.relpath(os.path.join(d, n), root) for d, _, ns in os.walk(root) for n in ns)
                restored = mngr.restore(4, args=ocp.args.StandardRestore({"w": jnp.zeros((256, 64)), "b": jnp.zeros(64),
                                                                         **{f"layer{i}": jnp.zeros((512, 256)) for i in range(4)}}))
                assert float(restored["w"][0, 0]) == 4.0
            assert run_cli("umount", str(m.mountpoint)).returncode == 0
        assert not w.violations, w.violations[:5]
        assert seen.sets, "the watcher saw no step in the store"
        for step, sets in seen.sets.items():
            # Whole from its first appearance; after that only shrinking (max_to_keep deletes it file by file).
            assert all(files <= expected[step] for files in sets), f"step {step}: {sorted(map(sorted, sets))}"
            if expected[step] not in sets:
                # Whole in the store only between its publication and its removal (max_to_keep=2: during the save of
                # step + 2). With write-back behind, that can be shorter than one of the watcher's polls, which read
                # and hash every file: a step never seen whole must have been seen first after its removal began.
                removal = saving.get(str(int(step) + 2))
                assert removal is not None and seen.first_at[step] > removal, f"step {step} never seen whole: {sorted(map(sorted, sets))}"
        assert sorted({found[0] for p in store_files(m.store) if (found := split(p))}) == ["3", "4"]
        assert not any("orbax-checkpoint-tmp" in p for p in store_files(m.store))
        assert verify_store(m.store).clean
    finally:
        stop_mount(m)


def test_hf_trainer_rotation_and_markers(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    m = start_mount(tmp_path)
    ever = threading.Event()
    needs = ("model.safetensors", "optimizer.pt", "trainer_state.json")
    was_complete: set[str] = set()

    def check(snap: dict) -> list[str]:
        out = []
        ckpts = {p.split("/")[1] for p in snap if p.startswith("out/checkpoint-")}
        complete = [c for c in ckpts if all(f"out/{c}/{n}" in snap for n in needs)]
        was_complete.update(complete)
        for c in ckpts:
            # trainer_state.json is written last: it must not appear before the rest. (A checkpoint
            # that was complete and is being rotated out goes away file by file, as in the mount.)
            if f"out/{c}/trainer_state.json" in snap and c not in was_complete:
                out.append(f"{c}/trainer_state.json visible before the rest of {c}")
        if complete:
            ever.set()
        elif ever.is_set():
            out.append("no complete checkpoint in the store")
        return out

    try:
        with StoreWatcher(m.store, check) as w:
            model = tiny_gpt2()
            args = transformers.TrainingArguments(output_dir=str(m.path("out")), max_steps=10, save_steps=2, save_total_limit=2,
                                                  per_device_train_batch_size=4, report_to=[], use_cpu=True, logging_steps=100,
                                                  disable_tqdm=True)
            transformers.Trainer(model=model, args=args, train_dataset=tiny_tokens()).train()
            assert run_cli("umount", str(m.mountpoint)).returncode == 0
        assert not w.violations, w.violations[:5]
        assert sorted({p.split("/")[1] for p in store_files(m.store) if p.startswith("out/checkpoint-")}) == ["checkpoint-10", "checkpoint-8"]
        assert verify_store(m.store).clean
    finally:
        stop_mount(m)


def test_an_async_save_while_dataloader_workers_fork_publishes_data_before_marker(tmp_path):
    """A save in a thread (as async checkpointing does) while the main
    thread starts a DataLoader with persistent workers: the workers fork
    holding the checkpoint's open file, and keep it for the whole run. Its
    data reached the store only when they let go, and the completion marker
    written after it went first: the store showed a checkpoint with no data.
    The data is published first now, without a flush and with the workers
    still alive."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    state = {f"t{i}": torch.randn(1 << 20) for i in range(24)}  # 96 MiB: the save is under way when the workers fork

    def check(snap: dict[str, bytes]) -> list[str]:
        return ["the marker came before the data"] if "ck/done" in snap and "ck/model.pt" not in snap else []

    m = start_mount(tmp_path)
    try:
        os.mkdir(m.path("ck"))
        opened = threading.Event()

        def save() -> None:
            with open(m.path("ck", "model.pt"), "wb") as f:
                opened.set()
                torch.save(state, f)
            m.path("ck", "done").write_text("ok")

        with StoreWatcher(m.store, check) as w:
            saver = threading.Thread(target=save)
            saver.start()
            opened.wait(30)
            loader = iter(DataLoader(TensorDataset(torch.randn(100, 4)), batch_size=10, num_workers=2, persistent_workers=True))
            next(loader)  # the workers are forked
            saver.join(60)
            wait_until(lambda: {"ck/model.pt", "ck/done"} <= set(store_files(m.store)), 30, "the checkpoint published")
            assert all(worker.is_alive() for worker in loader._workers)
            del loader
        assert not w.violations, w.violations
        assert torch.load(m.store / "ck" / "model.pt")["t3"].equal(state["t3"])
    finally:
        stop_mount(m)
