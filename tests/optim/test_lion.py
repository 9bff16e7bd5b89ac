"""Lion: the update matches the paper's formula; state resumes; bad settings are refused."""
from __future__ import annotations

import pytest
import torch

from lit_speed.optim.lion import Lion


def test_two_steps_match_the_formula():
    torch.manual_seed(0)
    p = torch.randn(5, requires_grad=True)
    grads = [torch.randn(5), torch.randn(5)]
    lr, (b1, b2), wd = 0.1, (0.9, 0.99), 0.5
    opt = Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    ref, m = p.detach().clone(), torch.zeros(5)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        ref = ref * (1 - lr * wd) - lr * torch.sign(b1 * m + (1 - b1) * g)
        m = b2 * m + (1 - b2) * g
    torch.testing.assert_close(p.detach(), ref, rtol=0, atol=1e-7)
    torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=0, atol=1e-7)


def test_state_dict_resumes_exactly():
    torch.manual_seed(0)
    a = torch.randn(3, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    opt_a, opt_b = Lion([a], lr=0.01), Lion([b], lr=0.01)
    a.grad = torch.randn(3)
    opt_a.step()
    b.data.copy_(a.data)
    opt_b.load_state_dict(opt_a.state_dict())
    g = torch.randn(3)
    a.grad, b.grad = g.clone(), g.clone()
    opt_a.step()
    opt_b.step()
    assert torch.equal(a, b)


def test_minimises_a_quadratic():
    x = torch.tensor([3.0, -2.0], requires_grad=True)
    opt = Lion([x], lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        (x**2).sum().backward()
        opt.step()
    assert x.abs().max() < 0.1


def test_errors():
    p = [torch.zeros(1, requires_grad=True)]
    with pytest.raises(ValueError, match=r"Lion\(lr=-1\): lr must be >= 0, got -1"):
        Lion(p, lr=-1)
    with pytest.raises(ValueError, match=r"Lion\(betas=\(0.9, 1.0\)\): betas must be two values in \[0, 1\), "
                                         r"got \(0.9, 1.0\)"):
        Lion(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"Lion\(weight_decay=-0.1\): weight_decay must be >= 0"):
        Lion(p, weight_decay=-0.1)


def test_lion_yaml_builds_the_optimizer():
    import hydra

    from lit_speed.run.config_check import preflight

    cfg = preflight(["optimizer=lion", "optimizer.lr=0.0003"])
    optimizer = hydra.utils.instantiate(cfg.optimizer)([torch.zeros(2, requires_grad=True)])
    assert isinstance(optimizer, Lion) and optimizer.defaults["lr"] == 0.0003


def test_lion_is_public_and_declares_the_one_state_tensor_it_keeps():
    import lit_speed

    assert lit_speed.Lion is Lion
    p = torch.nn.Parameter(torch.ones(3, 4))
    optimizer = Lion([p])
    p.grad = torch.ones_like(p)
    optimizer.step()
    kept = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()) / p.numel()
    assert optimizer.state_bytes_per_param() == kept == 4.0
