"""ReturnFreedMemory: freed tensors go back to the system (glibc), measured in a fresh process."""
from __future__ import annotations

import subprocess
import sys

import pytest

from lit_speed.memory.allocator import ReturnFreedMemory, glibc
from tests.helpers.repo import ROOT

PATTERN = r"""
import sys, torch, psutil
from lit_speed.memory.allocator import return_freed_memory
if sys.argv[1] == "on":
    assert return_freed_memory(256)
big = torch.ones(30 * 2**20 // 4); del big  # freeing a 30 MiB mapped block raises glibc's threshold to 30 MiB
base = psutil.Process().memory_info().rss
keep, tmp = [], []
for i in range(100):
    tmp.append(torch.ones(2**19))  # 2 MiB each, as a step's activations
    keep.append(torch.ones(4096))  # 16 KiB, interleaved, as what a step keeps
tmp.clear()
print((psutil.Process().memory_info().rss - base) // 2**20)
"""


@pytest.mark.skipif(glibc() is None, reason="mallopt is glibc's: this machine's C library is not glibc")
def test_freed_tensors_stay_in_the_process_by_default_and_go_back_with_the_threshold_pinned():
    kept = {mode: int(subprocess.run([sys.executable, "-c", PATTERN, mode], cwd=ROOT, capture_output=True, text=True,
                                     check=True).stdout.split()[-1]) for mode in ("off", "on")}
    assert kept["off"] >= 150 and kept["on"] <= 20, kept  # MiB of the 200 MiB freed still counted in RSS


@pytest.mark.parametrize("bad", [0, 40_000, 1.5, True, "256"])
def test_a_threshold_outside_glibcs_range_is_refused_naming_the_fix(bad):
    with pytest.raises(ValueError, match=r"ReturnFreedMemory\(threshold_kib=.*\): an int in 1\.\.32768 .*Fix: "
                                         r"threshold_kib=256"):
        ReturnFreedMemory(threshold_kib=bad)
