"""Optimizers declare the bytes of state they keep where they are defined; the planner asks them (issues 25, 32)."""
from __future__ import annotations

import functools

import pytest
import torch

from lit_speed import state_bytes_per_param, state_tensors_per_param
from lit_speed.memory.planner import measure_optimizer, plan
from lit_speed.models.configure_optimizers import param_groups
from lit_speed.optim.batched_muon import BatchedMuon
from lit_speed.optim.lion import Lion
from lit_speed.optim.muon import MuonAdamW


class TwoLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.hidden = torch.nn.Linear(8, 8, bias=True)
        self.head = torch.nn.Linear(8, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.emb(x))))


def _counted_after_a_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> float:
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    kept = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)
    return kept / sum(p.numel() for p in params)  # bytes per parameter


@pytest.mark.parametrize("build", [
    lambda ps: torch.optim.AdamW(ps),
    lambda ps: torch.optim.AdamW(ps, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True),
    lambda ps: torch.optim.Adagrad(ps),
    lambda ps: Lion(ps),
    lambda ps: BatchedMuon([p for p in ps if p.dim() == 2], ns_dtype="float32"),
], ids=["adamw", "adamw-amsgrad", "sgd", "sgd-momentum", "rmsprop-centered-momentum", "adagrad", "lion", "muon"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_declared_or_tabled_state_bytes_equal_what_a_step_allocates(build, dtype) -> None:
    params = [torch.nn.Parameter(torch.randn(4, 6, dtype=dtype)), torch.nn.Parameter(torch.randn(6, dtype=dtype))]
    optimizer = build(params)
    declared = state_bytes_per_param(optimizer)
    assert declared == state_bytes_per_param(optimizer, dtype)  # None: the parameters' own dtype
    trained = [p for g in optimizer.param_groups for p in g["params"]]
    assert declared == pytest.approx(_counted_after_a_step(optimizer, trained))
    assert state_tensors_per_param(optimizer) * 4 == state_bytes_per_param(optimizer, torch.float32)


def test_muon_adamw_declares_its_mix_of_muon_and_adamw_groups() -> None:
    model = TwoLayer()
    optimizer = MuonAdamW(param_groups(model, 0.1, names=True), ns_dtype="float32", adamw_kernel="foreach")
    declared = optimizer.state_bytes_per_param()
    matrix = model.hidden.weight.numel()  # the one hidden matrix: Muon's momentum; the rest: AdamW's two moments
    total = sum(p.numel() for p in model.parameters())
    assert declared == pytest.approx(4 * (matrix + 2 * (total - matrix)) / total)
    assert state_bytes_per_param(optimizer) == declared
    assert state_bytes_per_param(optimizer, torch.bfloat16) == pytest.approx(declared / 2)
    assert declared == pytest.approx(_counted_after_a_step(optimizer, list(model.parameters())))


def test_an_undeclared_optimizer_is_unknown_and_the_planner_counts_its_state() -> None:
    class Plain(torch.optim.Optimizer):  # a user's optimizer without a declaration: three buffers per parameter
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("a", torch.zeros_like(p)).add_(p.grad)
                    self.state[p].setdefault("b", torch.zeros_like(p))
                    self.state[p].setdefault("c", torch.zeros_like(p))

    model = TwoLayer()
    assert state_bytes_per_param(Plain(model.parameters())) is None
    probe = measure_optimizer(model, Plain)
    assert (probe.state_bytes(torch.float32), probe.name, probe.source) == (12.0, "Plain", "counted after one step")
    assert probe.state_bytes(torch.bfloat16) == 6.0  # whole tensors: like the parameters
    probe = measure_optimizer(model, functools.partial(MuonAdamW, ns_dtype="float32"))
    # named groups reach an optimizer split by name: Muon's 1 tensor on the hidden matrix, AdamW's 2 elsewhere
    assert probe.source == "declared" and 4.0 < probe.state_bytes(torch.float32) < 8.0


def test_an_optimizer_declaring_the_old_way_is_still_understood() -> None:
    class Legacy(torch.optim.SGD):  # a user's optimizer written against the tensor-count protocol
        def state_tensors_per_param(self) -> float:
            return 1.0

    params = [torch.nn.Parameter(torch.randn(4, 6))]
    optimizer = Legacy(params, lr=0.1, momentum=0.9)
    assert state_bytes_per_param(optimizer) == 4.0 and state_bytes_per_param(optimizer, torch.bfloat16) == 2.0


def test_the_plan_charges_the_optimizer_it_is_given() -> None:
    model, batch = TwoLayer(), torch.randint(0, 10, (4, 3))
    step = lambda m, b: m(b).float().pow(2).mean()  # noqa: E731
    adamw = plan(model, batch, micro_batches=[4], checkpoint_modules=(), step_fn=step, precisions=["32-true"])
    lion = plan(model, batch, micro_batches=[4], checkpoint_modules=(), step_fn=step, precisions=["32-true"],
                optimizer_factory=Lion)
    n = sum(p.numel() for p in model.parameters())
    assert "AdamW keeps 8.00 bytes of state per float32 parameter (declared)" in adamw.notes[-2]
    assert "Lion keeps 4.00 bytes of state per float32 parameter (declared)" in lion.notes[-2]
    # one state tensor less per parameter: 4 bytes each in float32, whatever the probes' noise in temporaries
    assert adamw.rows[0].peak_bytes - lion.rows[0].peak_bytes >= 4 * n
