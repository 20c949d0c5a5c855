"""A trainer for the dying-gasp tests: `python gasp_trainer.py DIR MODE`.

The model state is a tensor that the update section rewrites in slices, with
pauses, so a fault inside it would leave a torn mix of two steps. Prints
"completed N" after each whole step (flushed), "started" once running.
MODE: "run" (until signalled), "raise-in-update", "raise-outside".
"""

import logging
import sys
import time

import torch

import ckptfs.torch as ct

directory, mode = sys.argv[1], sys.argv[2]
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
state = {"step": 0, "w": torch.zeros(4096)}


def snapshot():
    return {"step": state["step"], "w": state["w"].clone()}


with ct.dying_gasp(snapshot, directory, deadline_s=30) as gasp:
    print("started", flush=True)
    step = 0
    while True:
        step += 1
        time.sleep(0.003)  # forward/backward: the state is consistent here
        if mode == "raise-outside" and step == 5:
            raise ValueError("data loader failed")
        with gasp.update():
            for i in range(8):
                state["w"][i * 512 : (i + 1) * 512] = step
                time.sleep(0.0005)
                if mode == "raise-in-update" and step == 5 and i == 3:
                    raise RuntimeError("NaN in optimizer step")
            state["step"] = step
        print(f"completed {step}", flush=True)
