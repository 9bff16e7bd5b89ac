"""Optimizer kernels chosen on this machine: the choice is applied, kept in the checkpoint and shared by the ranks."""
from __future__ import annotations

import pytest
import torch

from lit_speed.models.gpt import GPT
from lit_speed.optim.batched_muon import BatchedMuon, newton_schulz_batched
from lit_speed.optim.kernel_choice import adamw_flags, probe_tensors
from lit_speed.optim.muon import MuonAdamW
from lit_speed.tuning import Decision


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int = 0) -> None:
    x = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).logsumexp(-1).mean().backward()
    opt.step()


@pytest.fixture
def fixed_choice(monkeypatch):
    """The timing replaced by a fixed decision (what is tested is the wiring, not this machine's speed)."""
    def choose(kind, chosen):
        decision = Decision(f"optimizer.{kind}", chosen, "stand-in")
        monkeypatch.setattr(f"lit_speed.optim.kernel_choice.choose_{kind}", lambda *a, **k: decision)
        return decision
    return choose


@pytest.mark.parametrize("kernel", ["fused", "for-loop"])
def test_auto_adamw_kernel_is_applied_before_the_first_step_and_kept_in_the_checkpoint(fixed_choice, monkeypatch,
                                                                                      kernel):
    fixed_choice("adamw_kernel", kernel)
    monkeypatch.setattr("lit_speed.optim.muon.choose_adamw_kernel",
                        __import__("lit_speed.optim.kernel_choice", fromlist=["x"]).choose_adamw_kernel)
    model = GPT(97, 16, 2, 2, 32)
    opt = MuonAdamW(model.named_parameters(), adamw_kernel="auto")
    _step(model, opt)
    groups = opt.adamw.param_groups
    assert all(g["kernel"] == kernel and g["fused"] == adamw_flags(kernel)["fused"] for g in groups)
    resumed = MuonAdamW(GPT(97, 16, 2, 2, 32).named_parameters(), adamw_kernel="auto")
    resumed.load_state_dict(opt.state_dict())
    monkeypatch.setattr("lit_speed.optim.muon.choose_adamw_kernel", lambda *a: pytest.fail("timed again on resume"))
    resumed.resolve_adamw_kernel()
    assert all(g["kernel"] == kernel for g in resumed.adamw.param_groups)


def test_auto_ns_dtype_is_decided_once_and_kept_in_the_checkpoint(fixed_choice, monkeypatch):
    fixed_choice("ns_dtype", "float32")
    model = GPT(97, 16, 2, 2, 32)
    opt = MuonAdamW(model.named_parameters(), ns_dtype="auto")
    _step(model, opt)
    assert opt.muon.ns_decision.chosen == "float32"
    assert all(g["ns_dtype"] == "float32" for g in opt.state_dict()["param_groups"][:len(opt.muon.param_groups)])
    monkeypatch.setattr("lit_speed.optim.kernel_choice.choose_ns_dtype", lambda *a, **k: pytest.fail("timed"))
    resumed = MuonAdamW(GPT(97, 16, 2, 2, 32).named_parameters(), ns_dtype="auto")
    resumed.load_state_dict(opt.state_dict())
    resumed.muon.resolve_ns_dtype()
    assert resumed.muon.param_groups[0]["ns_dtype"] == "float32"


def test_auto_choices_are_timed_on_the_optimizers_own_shapes(monkeypatch):
    seen = {}

    def ns(shapes, orthogonalise, device, default="bfloat16", key=None):
        seen["ns"] = (sorted(map(tuple, shapes)), key["steps"])
        return Decision("optimizer.ns_dtype", "bfloat16", "stand-in")

    def adamw(params, default="foreach"):
        seen["adamw"] = sorted(tuple(p.shape) for p in params)
        return Decision("optimizer.adamw_kernel", "foreach", "stand-in")

    monkeypatch.setattr("lit_speed.optim.kernel_choice.choose_ns_dtype", ns)
    monkeypatch.setattr("lit_speed.optim.muon.choose_adamw_kernel", adamw)
    model = GPT(97, 16, 2, 2, 32)
    opt = MuonAdamW(model.named_parameters(), ns_dtype="auto", adamw_kernel="auto", ns_steps=3)
    _step(model, opt)
    # 2 blocks: qkv (32x96), attention proj (32x32) and the two MLP matrices (32x128, oriented wide), per block
    assert seen["ns"] == ([(2, 32, 32), (2, 32, 96), (4, 32, 128)], 3)
    assert (97, 32) in seen["adamw"] and all(len(s) == 1 or "wte" for s in seen["adamw"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_newton_schulz_in_float32_orthogonalises_like_bf16(dtype):
    torch.manual_seed(0)
    out = newton_schulz_batched(torch.randn(3, 16, 48), (3.4445, -4.7750, 2.0315), 5, 1e-7, dtype)
    assert out.dtype == dtype
    singular = torch.linalg.svdvals(out.float())
    # the quintic drives every singular value into ~[0.7, 1.2] (it is tuned for speed, not exactness)
    assert singular.min() > 0.6 and singular.max() < 1.25


def test_bad_choices_are_refused_naming_the_setting():
    model = GPT(97, 16, 2, 2, 32)
    with pytest.raises(ValueError, match=r"MuonAdamW\(adamw_kernel='fast'\): adamw_kernel must be one of"):
        MuonAdamW(model.named_parameters(), adamw_kernel="fast")
    with pytest.raises(ValueError, match=r"BatchedMuon\(ns_dtype='fp8'\): ns_dtype must be one of"):
        BatchedMuon([torch.nn.Parameter(torch.zeros(4, 4))], ns_dtype="fp8")


def test_probe_tensors_cap_the_copied_elements_but_keep_one():
    params = [torch.zeros(1000, 1000), torch.zeros(10), torch.zeros(3000, 3000)]
    assert [t.shape for t in probe_tensors(params, max_elements=1_000_010)] == [(1000, 1000), (10,)]
    assert len(probe_tensors([torch.zeros(5000, 5000)], max_elements=10)) == 1


def _rank_decides(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from lit_speed.tuning.measured_choice import on_rank_zero

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # each rank would choose differently on its own (a busy core, a close call): rank 0's choice is used by both
        decision = on_rank_zero(lambda: Decision("optimizer.adamw_kernel", ["fused", "foreach"][rank], f"rank {rank}"))
        torch.save(decision.chosen, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_on_two_processes_rank_zero_decides_for_both(tmp_path):
    import torch.multiprocessing as mp

    from lit_speed.run.launch_env import free_port

    mp.spawn(_rank_decides, args=(free_port(), str(tmp_path)), nprocs=2)
    assert [torch.load(tmp_path / f"{r}.pt") for r in range(2)] == ["fused", "fused"]


@pytest.mark.parametrize("native", [False, True])
def test_bf16_newton_schulz_is_not_timed_on_a_cpu_without_bf16_kernels(monkeypatch, tmp_path, native):
    # issue 52: a candidate the machine's own facts rule out costs no timing (Zen3: 949.6 ms a bf16 call vs 15.5 fp32)
    from lit_speed.optim import kernel_choice

    monkeypatch.setenv("LIT_SPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_choice, "cpu_has_native_bf16", lambda: native)
    timed = []

    def orthogonalise(stack, dtype):
        timed.append(dtype)
        return newton_schulz_batched(stack, (3.4445, -4.775, 2.0315), 1, 1e-7, dtype)

    decision = kernel_choice.choose_ns_dtype([(2, 8, 8)], orthogonalise, "cpu")
    if native:
        assert torch.bfloat16 in timed and torch.float32 in timed
    else:
        assert decision.chosen == "float32" and timed == []
        assert "bfloat16 ruled out, not timed: this CPU has no native bf16 kernels" in decision.reason
