"""BatchedMuon keeps torch.optim.Muon's math: same updates (to bf16 rounding), same state, fewer matmul calls."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.optim import Muon

from lit_speed.models.gpt import GPT
from lit_speed.optim.batched_muon import (
    BatchedMuon,
    _gram_newton_schulz,
    _standard_newton_schulz,
    adjusted_lr,
    gram_flops,
    newton_schulz_batched,
    use_gram_form,
)


def _matrices() -> list[torch.nn.Parameter]:
    """A GPT's hidden matrices: tall, wide and square shapes, several of each (as in a transformer)."""
    torch.manual_seed(0)
    model = GPT(11, 16, n_layer=2, n_head=2, n_embd=32)
    return [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith(("wte", "wpe"))]


def _run(cls: type[Muon], steps: int, **kw: object) -> tuple[list[torch.Tensor], dict]:
    params = [torch.nn.Parameter(p.detach().clone()) for p in _matrices()]
    opt = cls(params, lr=0.02, weight_decay=0.01, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach() for p in params], opt.state_dict()


@pytest.mark.parametrize("kw", [{}, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"}])
def test_updates_match_torch_muon_to_bf16_rounding(kw: dict) -> None:
    start = [p.detach().clone() for p in _matrices()]
    ours, our_state = _run(BatchedMuon, 3, **kw)
    ref, ref_state = _run(Muon, 3, **kw)
    for s, a, b in zip(start, ours, ref):
        step_ours, step_ref = a - s, b - s
        # Newton-Schulz runs in bf16 in both (8 mantissa bits): a batched bmm may round in another order, so
        # the updates agree to ~1% of their size, not bitwise; the momentum (fp32, same ops) agrees exactly.
        assert (step_ours - step_ref).norm() <= 0.02 * step_ref.norm()
        assert step_ref.norm() > 0
    for k in ref_state["state"]:
        assert torch.equal(our_state["state"][k]["momentum_buffer"], ref_state["state"][k]["momentum_buffer"])
    # torch's hyper-parameters, plus the Newton-Schulz dtype (bf16 by default, torch's)
    assert [{k: v for k, v in g.items() if k != "ns_dtype"} for g in our_state["param_groups"]] == \
        ref_state["param_groups"] and all(g["ns_dtype"] == "bfloat16" for g in our_state["param_groups"])


def test_a_torch_muon_checkpoint_loads_and_continues_exactly() -> None:
    params, state = _run(Muon, 2)
    a = [torch.nn.Parameter(p.clone()) for p in params]
    b = [torch.nn.Parameter(p.clone()) for p in params]
    opt_a, opt_b = BatchedMuon(a, lr=0.02), BatchedMuon(b, lr=0.02)
    opt_a.load_state_dict(copy.deepcopy(state))
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for opt, ps in ((opt_a, a), (opt_b, b)):
        g = torch.Generator().manual_seed(3)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_same_shape_matrices_share_one_batched_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = newton_schulz_batched

    def spy(updates: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(tuple(updates.shape))
        return real(updates, *args)

    monkeypatch.setattr("lit_speed.optim.batched_muon.newton_schulz_batched", spy)
    _run(BatchedMuon, 1)
    # 2 blocks x (qkv 96x32, proj 32x32, fc 128x32, mlp proj 32x128): fc is stored tall and oriented wide
    assert sorted(calls) == sorted([(2, 32, 96), (2, 32, 32), (4, 32, 128)])


def test_orthogonalised_rows_have_unit_scale_and_the_lr_rule_is_torchs() -> None:
    x = newton_schulz_batched(torch.randn(3, 8, 32), (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    singular = torch.linalg.svdvals(x)
    assert singular.min() > 0.5 and singular.max() < 1.5  # the quintic's known band around 1
    assert adjusted_lr(0.02, None, torch.Size([128, 32])) == pytest.approx(0.04)
    assert adjusted_lr(0.02, "match_rms_adamw", torch.Size([32, 128])) == pytest.approx(0.02 * 0.2 * 128 ** 0.5)


def test_a_parameter_that_stopped_being_a_matrix_is_refused_by_name_of_its_shape() -> None:
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = BatchedMuon([p])  # torch's constructor checks 2-D; the step checks again, as torch's does
    p.data = torch.zeros(4)
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match=r"2-D matrices only; got a parameter of shape \(4,\)"):
        opt.step()


COEFFICIENTS = (3.4445, -4.7750, 2.0315)


@pytest.mark.parametrize("shape", [(4, 32, 128), (3, 16, 48), (2, 8, 9)])
def test_the_gram_form_is_the_standard_iteration_up_to_float32_rounding(shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    # momentum-like: singular values spread over three decades (the near-zero ones are where Q grows)
    x = torch.randn(shape, dtype=torch.float64) @ torch.diag(torch.logspace(0, -3, shape[2], dtype=torch.float64))
    x = x / x.norm(dim=(1, 2), keepdim=True)
    exact = _standard_newton_schulz(x, *COEFFICIENTS, 5)
    assert (_gram_newton_schulz(x, *COEFFICIENTS, 5) - exact).norm() <= 1e-10 * exact.norm()  # same polynomial
    gram32 = _gram_newton_schulz(x.float(), *COEFFICIENTS, 5).double()
    standard32 = _standard_newton_schulz(x.float(), *COEFFICIENTS, 5).double()
    bf16 = _standard_newton_schulz(x.bfloat16(), *COEFFICIENTS, 5).double()
    # float32: the Gram form rounds to ~1e-4 of the update (Q amplifies the near-zero directions' rounding), the
    # standard form to ~1e-6, and torch's own bf16 iteration to ~1e-2: the Gram form is far inside torch's default
    assert (gram32 - exact).norm() <= 1e-3 * exact.norm()
    assert (standard32 - exact).norm() <= 1e-5 * exact.norm()
    assert (bf16 - exact).norm() >= 10 * (gram32 - exact).norm()


def test_the_gram_form_runs_where_it_saves_flops_and_never_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    standard, gram = gram_flops(128, 512, 5)
    assert (standard, gram) == (5 * (4 * 128 ** 2 * 512 + 2 * 128 ** 3), 4 * 128 ** 2 * 512 + 34 * 128 ** 3)
    assert gram < 0.6 * standard  # an MLP matrix (4x wide): 44% fewer
    assert use_gram_form(128, 512, 5, torch.float32) and use_gram_form(128, 384, 5, torch.float64)
    assert not use_gram_form(128, 128, 5, torch.float32)  # square: the standard iteration is cheaper
    assert not use_gram_form(128, 512, 5, torch.bfloat16) and not use_gram_form(128, 512, 1, torch.float32)
    used: list[str] = []
    monkeypatch.setattr("lit_speed.optim.batched_muon._gram_newton_schulz",
                        lambda *a: used.append("gram") or _gram_newton_schulz(*a))
    monkeypatch.setattr("lit_speed.optim.batched_muon._standard_newton_schulz",
                        lambda *a: used.append("standard") or _standard_newton_schulz(*a))
    for dtype in (torch.float32, torch.bfloat16):
        out = newton_schulz_batched(torch.randn(2, 8, 32), COEFFICIENTS, 5, 1e-7, dtype)
        assert out.dtype == dtype and out.shape == (2, 8, 32)
    newton_schulz_batched(torch.randn(2, 8, 8), COEFFICIENTS, 5, 1e-7, torch.float32)
    assert used == ["gram", "standard", "standard"]
