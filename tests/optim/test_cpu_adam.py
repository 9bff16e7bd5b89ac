"""CPUAdam: DeepSpeed's CPU Adam that resumes bitwise (its C++ bias-correction product is replayed on load)."""
from __future__ import annotations

import pytest
import torch

from lit_speed.optim.cpu_adam import CPUAdam


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("replay", [True, False], ids=["replayed", "control-not-replayed"])
def test_resumed_cpu_adam_steps_bitwise_like_the_uninterrupted_one(replay, monkeypatch):
    # resumed before step 12: float32 0.9**12 by std::pow and by 12 multiplications differ in the last bit
    reference = _model()
    _train(reference, CPUAdam(reference.parameters(), lr=1e-2), range(16))

    model = _model()
    first = CPUAdam(model.parameters(), lr=1e-2)
    _train(model, first, range(11))
    state = first.state_dict()
    if not replay:  # what DeepSpeedCPUAdam itself does: the next step recomputes beta**step with std::pow
        monkeypatch.setattr("lit_speed.optim.cpu_adam.replay_step_product", lambda *a: None)
    resumed = CPUAdam(model.parameters(), lr=1e-2)
    resumed.load_state_dict(state)
    _train(model, resumed, range(11, 16))

    same = all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
    assert same is replay, [float((a - b).abs().max()) for a, b in zip(reference.parameters(), model.parameters())]
