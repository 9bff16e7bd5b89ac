"""Run ``scripts/train.py`` under a hard address-space limit (RLIMIT_AS, Linux): a reproducible out-of-memory.

``python train_under_memory_limit.py <headroom MiB> [train.py overrides...]``: the limit is the address space
already mapped once torch and Lightning are imported, plus the headroom, so the import cost does not count.
Run it with ``MALLOC_ARENA_MAX=1`` and one thread, or glibc's per-thread arenas reserve address space by
the 64 MiB and the limit hits at an arbitrary place.
"""
from __future__ import annotations

import resource
import runpy
import sys
from pathlib import Path

# mapped before the limit: torch, Lightning and the digits data's loader (scikit-learn imports pandas when it is
# installed, as `datasets` brings it: ~150 MiB of address space that is not the run's)
import lightning.pytorch  # noqa: F401
import sklearn.datasets  # noqa: F401
import torch  # noqa: F401

TRAIN = Path(__file__).resolve().parents[3] / "scripts" / "train.py"


def address_space_bytes() -> int:
    """This process's mapped virtual memory (VmSize), from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


if __name__ == "__main__":
    # oneDNN reports a failed allocation of its workspace as "could not create a primitive", at a place that
    # depends on the CPU; without it the allocator's own "can't allocate memory" surfaces, the same everywhere
    torch.backends.mkldnn.enabled = False
    headroom = int(sys.argv.pop(1)) * 2**20
    limit = address_space_bytes() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    print(f"RLIMIT_AS set to {limit / 2**20:.0f} MiB ({headroom / 2**20:.0f} MiB above the imports)", flush=True)
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")
