"""Young's and Daly's intervals and the waste model, against values worked
out by hand from the formulas (see ckptfs/advise.py)."""

from __future__ import annotations

import json

import pytest

from ckptfs.advise import advise, daly, waste, young
from tests.mountutil import run_cli


def test_young_and_daly_by_hand():
    # C = 30 s, M = 24 h: sqrt(2 * 30 * 86400) = sqrt(5_184_000) = 2276.84 s
    assert young(30, 86400) == pytest.approx(2276.84, abs=0.01)
    # x = C/2M = 1.7361e-4: 2276.84 * (1 + 0.013176/3 + 1.929e-5) - 30 = 2256.88 s
    assert daly(30, 86400) == pytest.approx(2256.88, abs=0.01)
    # C = 600 s, M = 1 h: x = 1/12: 2078.46 * (1 + 0.288675/3 + 0.009259) - 600 = 1697.71 s
    assert young(600, 3600) == pytest.approx(2078.46, abs=0.01)
    assert daly(600, 3600) == pytest.approx(1697.71, abs=0.01)
    assert daly(8000, 3600) == 3600  # C >= 2M: checkpoint every M


def test_waste_by_hand():
    # tau = 2256.88, C = 30, M = 86400, R = 300:
    # M e^(R/M) (e^((tau+C)/M) - 1) = 86400 * 1.003478 * 0.026822 = 2325.46; 1 - 2256.88/2325.46 = 2.95%
    assert waste(2256.88, 30, 86400, 300) == pytest.approx(0.02950, abs=0.0001)
    assert waste(1697.71, 600, 3600) == pytest.approx(0.4720, abs=0.0005)
    a = advise(30, 86400, 300)
    assert a.waste_at_daly == pytest.approx(0.02950, abs=0.0001)
    assert min(a.table, key=lambda r: r[2])[0] == "Daly (optimum)"  # the optimum wastes least
    with pytest.raises(ValueError):
        advise(0, 10)


def test_advise_cli():
    r = run_cli("advise", "--save-seconds", "30", "--mtbf-hours", "24", "--restart-seconds", "300")
    assert r.returncode == 0, r.stderr
    assert "37.6 min (Daly; Young: 37.9 min)" in r.stdout and "2.95%" in r.stdout
    out = json.loads(run_cli("advise", "--save-seconds", "600", "--mtbf-hours", "1", "--json").stdout)
    assert out["daly_s"] == pytest.approx(1697.71, abs=0.01) and len(out["table"]) == 6
    r = run_cli("advise", "--mtbf-hours", "24")
    assert r.returncode == 2 and "give one of" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("advise", "--save-seconds", "-1", "--mtbf-hours", "24")
    assert r.returncode == 2 and "Traceback" not in r.stderr
