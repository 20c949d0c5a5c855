"""How often to checkpoint: Young's and Daly's optimum intervals, and the
expected fraction of time lost to saves, re-done work and restarts.

With C the time one checkpoint blocks training, M the mean time between
failures and R the time a restart takes (all seconds):

- Young (1974): tau = sqrt(2 C M).
- Daly (2006), higher order: tau = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C
  for C < 2M, else tau = M.
- Expected wall time per unit of work (Daly's model, exponential failures):
  M e^(R/M) (e^((tau + C)/M) - 1) / tau, so the fraction wasted is
  1 - tau / (M e^(R/M) (e^((tau + C)/M) - 1)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def young(save_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * save_s * mtbf_s)


def daly(save_s: float, mtbf_s: float) -> float:
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def waste(interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected fraction of wall time not spent on new training progress."""
    try:
        wall_per_work = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + save_s) / mtbf_s) / interval_s
    except OverflowError:  # saves or restarts far longer than the MTBF: the job (almost) never gets anywhere
        return 1.0
    return 1 - 1 / wall_per_work


@dataclass(frozen=True)
class Advice:
    save_s: float
    mtbf_s: float
    restart_s: float
    young_s: float
    daly_s: float
    waste_at_daly: float
    table: list[tuple[str, float, float]]  # (label, interval_s, waste fraction)


def advise(save_s: float, mtbf_s: float, restart_s: float = 0.0) -> Advice:
    if save_s <= 0 or mtbf_s <= 0 or restart_s < 0:
        raise ValueError("save time and MTBF must be positive, restart time not negative")
    y, d = young(save_s, mtbf_s), daly(save_s, mtbf_s)
    rows = [("Young", y), ("Daly (optimum)", d)]
    rows += [(f"{f:g} x Daly", d * f) for f in (0.25, 0.5, 2, 4)]
    rows.sort(key=lambda r: r[1])
    return Advice(save_s, mtbf_s, restart_s, y, d, waste(d, save_s, mtbf_s, restart_s),
                  [(label, t, waste(t, save_s, mtbf_s, restart_s)) for label, t in rows])
