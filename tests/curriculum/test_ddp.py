"""Two-process CPU DDP: Lightning keeps the curriculum sampler and the ranks train on disjoint shards."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_process_ddp_shards_are_disjoint_and_cover_the_allowed_set(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "curriculum.py"), str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 and r["sampler_kept"] for r in ranks)  # not wrapped in a DistributedSamplerWrapper
    for key in ("0", "6"):  # the first batch (25% allowed) and the end of widening (all of it)
        a, b = (set(r["shards"][key]) for r in ranks)
        assert not a & b
        assert a | b == set(ranks[0]["allowed"][key]) == set(ranks[1]["allowed"][key])
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == 10
    for step, (b0, b1) in enumerate(zip(ranks[0]["seen"], ranks[1]["seen"])):
        assert not set(b0) & set(b1), f"step {step}: both ranks trained on the same sample"
    assert max(ranks[0]["seen"][0] + ranks[1]["seen"][0]) < 16  # 25% of 64 at the first step
