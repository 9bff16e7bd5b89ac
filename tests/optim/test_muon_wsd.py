"""optimizer=muon (MuonAdamW) and the warm-up/stable/decay schedule: parameter split, one optimizer for
Lightning, exact resume through state_dict, refusal under ZeRO, WSD's shape and resumed position."""
from __future__ import annotations

import copy

import pytest
import torch

from lit_speed.models.configure_optimizers import configure_optimizers, param_groups
from lit_speed.models.gpt import GPT
from lit_speed.optim.muon import MuonAdamW, split_for_muon
from lit_speed.optim.schedules import warmup_stable_decay, wsd_factor


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(11, 16, n_layer=2, n_head=2, n_embd=32)


def _step(model: GPT, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 11, (4, 16), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x).view(-1, 11), x.roll(-1, 1).reshape(-1)).backward()
    opt.step()


def test_muon_takes_hidden_matrices_and_adamw_the_embeddings_head_norms_and_biases() -> None:
    model = _gpt()
    opt = MuonAdamW(param_groups(model, 0.1, names=True), lr=0.02, adamw_lr=3e-3)
    muon = {n for g in opt.muon.param_groups for n in g["param_names"]}
    adamw = {n for g in opt.adamw.param_groups for n in g["param_names"]}
    assert muon == {f"blocks.{i}.{m}" for i in range(2) for m in
                    ("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight")}
    assert adamw == {"wte.weight", "wpe.weight", "ln_f.weight"} | {f"blocks.{i}.ln_{j}.weight" for i in range(2)
                                                                    for j in (1, 2)}
    assert opt.param_groups[0]["lr"] == 0.02 and opt.param_groups[-1]["lr"] == 3e-3
    # the outer groups are the inner optimizers' groups: a scheduler that scales one scales both halves
    opt.param_groups[0]["lr"] = 0.01
    assert opt.muon.param_groups[0]["lr"] == 0.01
    assert split_for_muon(["h.weight", "wte.weight", "b"], [torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2)]) \
        == ([0], [1, 2])


def test_muon_resume_from_state_dict_is_exact() -> None:
    full = _gpt()
    opt = MuonAdamW(param_groups(full, 0.1, names=True))
    for s in range(4):
        _step(full, opt, s)
    head = _gpt()
    head_opt = MuonAdamW(param_groups(head, 0.1, names=True))
    for s in range(2):
        _step(head, head_opt, s)
    saved_model, saved_opt = copy.deepcopy(head.state_dict()), copy.deepcopy(head_opt.state_dict())
    assert len(saved_opt["state"]) == len(list(head.parameters()))  # both halves' state is saved
    tail = _gpt()
    tail.load_state_dict(saved_model)
    tail_opt = MuonAdamW(param_groups(tail, 0.1, names=True))
    tail_opt.load_state_dict(saved_opt)
    for s in range(2, 4):
        _step(tail, tail_opt, s)
    for (name, a), b in zip(full.state_dict().items(), tail.state_dict().values()):
        assert torch.equal(a, b), name


def test_muon_needs_names_and_a_matrix_and_is_refused_under_zero() -> None:
    model = _gpt()
    with pytest.raises(ValueError, match="needs parameter names"):
        MuonAdamW(param_groups(model, 0.1))
    with pytest.raises(ValueError, match="no 2-D hidden weight matrix"):
        MuonAdamW([("wte.weight", torch.nn.Parameter(torch.zeros(3, 3)))])
    from lit_speed.strategies.zero_strategy import ZeroStrategy

    strategy = ZeroStrategy.__new__(ZeroStrategy)  # only its type is inspected
    factory = __import__("functools").partial(MuonAdamW, lr=0.02)
    with pytest.raises(ValueError, match="ZeroStrategy: MuonAdamW cannot train under DeepSpeed ZeRO: ZeRO flattens parameters"):
        configure_optimizers(model, factory, None, 0.1, 10, strategy)


def test_wsd_warms_up_holds_then_decays_linearly_to_the_floor() -> None:
    f = [wsd_factor(s, 100, warmup_steps=10, decay_steps=20, min_lr_ratio=0.1) for s in range(110)]
    assert f[0] == pytest.approx(0.1) and f[9] == 1.0 and f[10:80] == [1.0] * 70
    assert f[90] == pytest.approx(0.55) and f[100] == pytest.approx(0.1) and f[109] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="decay_fraction"):
        warmup_stable_decay(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), 10, decay_fraction=1.5)


def test_wsd_resumes_its_position_and_horizon_overrides_total_steps() -> None:
    def make() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        return opt, warmup_stable_decay(opt, total_steps=1000, warmup_steps=2, decay_fraction=0.5, horizon=20)

    opt, sched = make()
    lrs = []
    for _ in range(20):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[-1] == pytest.approx(0.0) and lrs[8] == 1.0  # decays over steps 10-20 of the 20-step horizon
    opt2, sched2 = make()
    opt3, sched3 = make()
    for _ in range(7):
        opt2.step()
        sched2.step()
    sched3.load_state_dict(sched2.state_dict())
    for _ in range(13):
        opt3.step()
        sched3.step()
    assert opt3.param_groups[0]["lr"] == pytest.approx(lrs[-1]) and sched3.last_epoch == 20
