"""Real framework saves and loads on a real mount."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.mountutil import drop_caches, run_cli
from tests.storeutil import store_files, verify_store

torch = pytest.importorskip("torch")


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "weight": torch.randn(512, 1024, generator=g),
        "bias": torch.randn(1024, generator=g),
        "step": torch.tensor(seed),
        "half": torch.randn(333, 77, generator=g).half(),
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_torch_save_load(mnt: Path):
    sd = _state()
    torch.save(sd, mnt / "model.pt")
    drop_caches()
    _assert_same(sd, torch.load(mnt / "model.pt", map_location="cpu"))


def test_torch_load_mmap(mnt: Path):
    sd = _state(1)
    torch.save(sd, mnt / "model.pt")
    drop_caches()
    loaded = torch.load(mnt / "model.pt", mmap=True, map_location="cpu")
    _assert_same(sd, loaded)


def test_torch_from_file_shared(mnt: Path):
    p = mnt / "storage.bin"
    t = torch.arange(1 << 20, dtype=torch.float32)
    p.write_bytes(t.numpy().tobytes())
    drop_caches()
    s = torch.UntypedStorage.from_file(str(p), shared=False, nbytes=t.numel() * 4)
    # (a view of the mapped storage: `bytes(s)` would take it a byte at a time, 15 s of Python)
    assert torch.equal(torch.empty(0, dtype=torch.uint8).set_(s).view(torch.float32), t)


def test_safetensors_roundtrip(mnt: Path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    sd = {k: v.contiguous() for k, v in _state(2).items()}
    save_file(sd, mnt / "model.safetensors", metadata={"format": "pt"})
    drop_caches()
    _assert_same(sd, load_file(mnt / "model.safetensors"))
    with safe_open(mnt / "model.safetensors", framework="pt") as f:  # mmap, MAP_SHARED
        assert set(f.keys()) == set(sd)
        assert torch.equal(f.get_tensor("weight"), sd["weight"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_save_load(mnt: Path):
    import torch.distributed.checkpoint as dcp

    sd = _state(3)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(mnt / "dcp" / "step-10")))
    names = os.listdir(mnt / "dcp" / "step-10")
    assert ".metadata" in names and not any(n.endswith(".tmp") for n in names)
    drop_caches()
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(mnt / "dcp" / "step-10")))
    _assert_same(sd, target)


def test_temp_file_then_rename(mnt: Path):
    sd = _state(4)
    with tempfile.NamedTemporaryFile(dir=mnt, prefix="tmp", delete=False) as f:
        torch.save(sd, f)
    os.replace(f.name, mnt / "final.pt")
    drop_caches()
    _assert_same(sd, torch.load(mnt / "final.pt"))
    assert os.listdir(mnt) == ["final.pt"]


def test_temp_dir_then_rename(mnt: Path):
    tmp = mnt / "100.orbax-checkpoint-tmp-123"
    tmp.mkdir()
    torch.save(_state(5), tmp / "params.pt")
    (tmp / "commit_success.txt").write_text("ok")
    os.rename(tmp, mnt / "100")
    drop_caches()
    _assert_same(_state(5), torch.load(mnt / "100" / "params.pt"))


def test_rmtree_of_old_checkpoints(mnt: Path):
    for step in range(4):
        d = mnt / f"checkpoint-{step}"
        d.mkdir()
        torch.save(_state(step), d / "model.pt")
        (d / "trainer_state.json").write_text("{}")
        if step >= 2:
            shutil.rmtree(mnt / f"checkpoint-{step - 2}")
    assert sorted(os.listdir(mnt)) == ["checkpoint-2", "checkpoint-3"]
    _assert_same(_state(3), torch.load(mnt / "checkpoint-3" / "model.pt"))


def test_unlinked_while_mmapped_still_readable(mnt: Path):
    sd = _state(6)
    torch.save(sd, mnt / "model.pt")
    loaded = torch.load(mnt / "model.pt", mmap=True)
    os.unlink(mnt / "model.pt")
    drop_caches()
    _assert_same(sd, loaded)


def test_overwrite_in_place_gives_new_content(mnt: Path):
    """A rewritten file must not be served from a stale page cache."""
    for step in range(3):
        torch.save(_state(step), mnt / "latest.pt")
        _assert_same(_state(step), torch.load(mnt / "latest.pt"))


def test_lightning_model_checkpoint_top_k_and_last_link(fresh_mount, monkeypatch):
    """pytorch-lightning's ModelCheckpoint (save_top_k=2, save_last='link'),
    with TMPDIR inside the mount as Lightning >= 2.4 wants; the store ends
    up with exactly the top-k checkpoints and the `last` link, all verified."""
    import warnings

    import pytorch_lightning as pl

    m = fresh_mount
    tmp = m.path("tmp")
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss, on_epoch=True, on_step=False)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(m.path("ckpt")), monitor="train_loss", save_top_k=2, save_last="link",
                                        filename="{epoch}-{train_loss:.4f}")
    trainer = pl.Trainer(max_epochs=5, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ckpt], default_root_dir=str(m.path("root")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(), data)
    names = sorted(os.listdir(m.path("ckpt")))
    assert len(names) == 3 and "last.ckpt" in names
    assert os.path.islink(m.path("ckpt", "last.ckpt"))
    best = Tiny.load_from_checkpoint(ckpt.best_model_path)
    assert isinstance(best, Tiny)
    r = run_cli("flush", str(m.mountpoint), "--timeout", "120")
    assert r.returncode == 0, r.stderr
    stored = sorted(p for p in store_files(m.store) if p.startswith("ckpt/"))
    assert stored == sorted(f"ckpt/{n}" for n in names if n != "last.ckpt")  # the link is a manifest record (C8)
    assert verify_store(m.store).clean
    r = run_cli("verify", str(m.store))
    assert r.returncode == 0, r.stdout
