"""The host memory a process can use (issue 50, item 2): the smaller of its cgroup's limit and MemTotal, read in one
place (``lit_speed.memory.host_memory``) by the fit check, the planner, the verdict and the start-up table.

Before: a container's run read the machine's memory everywhere, and the verdict added the peak RSS to the memory
available later (``6.92 GiB peak of 26.87 GiB host memory`` on a 23.5 GiB machine). The cgroup file system is
faked in a temporary folder: the module reads its mount and ``/proc/self/cgroup`` from two module attributes.
"""
from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from lit_speed.memory import host_memory as hm
from lit_speed.run.config_error import ConfigError
from tests.helpers.repo import plan_script

GIB = 2**30


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_v2(tmp_path: Path, limit: int, usage: int, inactive: int = 0, member: str = "/job/step") -> Path:
    """A cgroup v2 tree whose limit sits on ``/job`` (its child ``step`` and the root have none)."""
    root = tmp_path / "cgroup"
    _write(root / "memory.max", "max\n")
    _write(root / "job" / "memory.max", f"{limit}\n")
    _write(root / "job" / "memory.current", f"{usage}\n")
    _write(root / "job" / "memory.stat", f"anon {usage}\ninactive_file {inactive}\nactive_file 0\n")
    _write(root / "job" / "step" / "memory.max", "max\n")
    _write(tmp_path / "self_cgroup", f"0::{member}\n")
    return root


@pytest.fixture
def limited(tmp_path, monkeypatch):
    """Put this process in a fake cgroup v2 with ``limit`` bytes, ``usage`` of them used (returns the limit file)."""
    def make(limit: int, usage: int) -> Path:
        root = fake_v2(tmp_path, limit, usage)
        monkeypatch.setattr(hm, "CGROUP_ROOT", root)
        monkeypatch.setattr(hm, "SELF_CGROUP", tmp_path / "self_cgroup")
        return root / "job" / "memory.max"
    return make


def test_v2_the_lowest_limit_on_the_path_binds_and_the_inactive_file_cache_is_not_usage(tmp_path):
    root = fake_v2(tmp_path, limit=4 * GIB, usage=GIB, inactive=GIB // 4)
    found = hm.cgroup_memory(root, tmp_path / "self_cgroup")
    assert found == hm.CgroupMemory(4 * GIB, GIB - GIB // 4, str(root / "job" / "memory.max"))


def test_v1_limit_in_bytes_and_its_no_limit_value(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    _write(root / "memory" / "a" / "memory.limit_in_bytes", f"{2 * GIB}\n")
    _write(root / "memory" / "a" / "memory.usage_in_bytes", f"{GIB}\n")
    _write(root / "memory" / "a" / "memory.stat", f"cache 5\ntotal_inactive_file {GIB // 2}\n")
    _write(tmp_path / "self_cgroup", "5:cpu:/\n4:memory:/a\n0::/\n")
    assert hm.cgroup_memory(root, tmp_path / "self_cgroup") == hm.CgroupMemory(
        2 * GIB, GIB // 2, str(root / "memory" / "a" / "memory.limit_in_bytes"))
    _write(root / "memory" / "a" / "memory.limit_in_bytes", "9223372036854771712\n")
    assert hm.cgroup_memory(root, tmp_path / "self_cgroup") is None


def test_inside_a_container_the_mount_is_the_process_cgroup(tmp_path):
    # /proc/self/cgroup names the host's path, which does not exist below the container's mount
    root = tmp_path / "cgroup"
    _write(root / "memory.max", f"{3 * GIB}\n")
    _write(root / "memory.current", f"{GIB}\n")
    _write(tmp_path / "self_cgroup", "0::/docker/4f1e\n")
    assert hm.cgroup_memory(root, tmp_path / "self_cgroup").limit == 3 * GIB


def test_host_memory_is_the_smaller_of_the_limit_and_memtotal(limited):
    machine = psutil.virtual_memory()
    limit_file = limited(GIB, GIB // 4)
    memory = hm.host_memory()
    assert memory.total == GIB and memory.available == min(machine.available, GIB - GIB // 4)
    assert memory.source == f"cgroup limit {limit_file}"
    assert hm.describe(memory).startswith(f"1.0 GiB (cgroup limit {limit_file}), ")


def test_a_limit_above_the_machine_leaves_memtotal(limited):
    limited(1024 * psutil.virtual_memory().total, 0)
    memory = hm.host_memory()
    assert memory.total == psutil.virtual_memory().total and memory.source == "MemTotal"


# ---- the callers: each reads the cgroup's numbers -------------------------------------------------------------
QUICK = ["trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "logger=none",
         "validate=false", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
         "callbacks=[device_stats]", "callbacks.device_stats.interval=1"]


def test_the_verdict_and_the_startup_table_use_the_cgroup_limit(make_cfg, limited):
    from lit_speed.run.runner import train

    limit_file = limited(3 * GIB, GIB)
    summary = train(make_cfg(QUICK))
    assert summary["startup"]["host memory"].startswith(f"3.0 GiB (cgroup limit {limit_file}), ")
    evidence = summary["components"]["DeviceStatsLogger"]["evidence"]
    assert evidence["memory_peak_bytes"] < evidence["memory_capacity_bytes"] <= 3 * GIB


def test_the_activation_check_reads_the_cgroup(make_cfg, limited):
    from lit_speed.run.model_checks import check_activation_memory

    cfg = make_cfg(["experiment=charlm_cpu", "data.block_size=512"])
    check_activation_memory(cfg)  # the machine's memory: fits
    limited(GIB, GIB)  # the cgroup is full
    with pytest.raises(ConfigError, match=r"data\.block_size=512 .* 0\.0 GiB is free"):
        check_activation_memory(cfg)


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.helpers.tiny_hf import save_tiny_causal_lm, write_texts

    tmp = tmp_path_factory.mktemp("host_memory")
    folder, texts = save_tiny_causal_lm(tmp / "hf"), write_texts(tmp_path_factory.mktemp("texts"))
    return ["model=hf_causal_lm", "data=text_folder", f"model.pretrained={folder}", f"data.root={texts}",
            "data.block_size=32", "data.batch_size=2", "peft=lora"]


def test_the_fit_check_reads_the_cgroup(make_cfg, limited, hf_run):
    from lit_speed.run.memory_fit.fit_gate import check_fits_memory

    cfg = make_cfg(hf_run)
    check_fits_memory(cfg)  # the machine's memory: a tiny model fits
    limited(GIB, GIB)
    with pytest.raises(ConfigError, match=r"this run needs about .* of RAM at its peak.* is there"):
        check_fits_memory(cfg)


def test_the_planner_reads_the_cgroup(make_cfg, limited, hf_run, capsys):
    plan = plan_script()
    cfg = make_cfg(hf_run)
    assert plan.plan_hf_run(cfg, None) == 0
    process = psutil.Process().memory_info().rss
    limited(GIB, GIB)
    assert plan.plan_hf_run(cfg, None) == 1  # nothing fits in what the cgroup has left
    budget = float(capsys.readouterr().out.split("predicted peak RSS (budget ")[-1].split(" GiB")[0])
    assert budget < process / GIB + 0.1


def test_kept_freed_memory_is_released_by_the_cgroup_s_numbers(limited):
    from types import SimpleNamespace

    from lit_speed.memory.allocator import KeepFreedMemory

    keep = KeepFreedMemory(min_available_fraction=0.15)
    keep.applied = True
    limited(2 * GIB, 2 * GIB - GIB // 10)  # 5% of the limit left
    with pytest.warns(UserWarning, match=r"KeepFreedMemory: 0\.1 GiB of 2\.0 GiB available"):
        keep._check(SimpleNamespace(global_step=7))
    assert keep.released_at_step == 7
