"""8-bit and 4-bit AdamW (torchao's, issue 32): declared bytes equal what a step allocates, the state round-trips
through torch.save and a Lightning checkpoint bitwise, and wrong states, block sizes and ZeRO are refused.

The first step of each parameter shape compiles torchao's kernel (inductor, cached on disk): the parameters here
share three shapes."""
from __future__ import annotations

import io

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("torchao", reason="the low-bit AdamWs are torchao's (pip install -e '.[finetune]')")

from lit_speed import state_bytes_per_param  # noqa: E402
from lit_speed.optim.low_bit import AdamW4bit, AdamW8bit, low_bit_state_bytes, state_bytes_of  # noqa: E402
from lit_speed.strategies.zero_config import check_zero_optimizer  # noqa: E402

# one quantised matrix (8,192 elements, a multiple of both blocks), one too small, one not a multiple of the block
SHAPES = [(64, 128), (10,), (4100,)]


def _params(dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, dtype=dtype, device=device)) for s in SHAPES]


def _step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
    optimizer.step()


@pytest.mark.parametrize(("cls", "dtype"), [(AdamW8bit, torch.float32), (AdamW4bit, torch.float32),
                                            (AdamW8bit, torch.bfloat16)], ids=["8bit", "4bit", "8bit-bf16"])
def test_declared_bytes_equal_the_bytes_a_step_allocates(cls, dtype) -> None:
    params = _params(dtype)
    optimizer = cls(params, lr=1e-3)
    declared = state_bytes_per_param(optimizer)
    _step(optimizer, params, seed=1)
    assert type(optimizer.state[params[0]]["exp_avg"]) is not torch.Tensor, "the matrix's moments are not quantised"
    assert type(optimizer.state[params[2]]["exp_avg"]) is torch.Tensor, "torchao's size rule changed"
    n = sum(p.numel() for p in params)
    assert declared * n == pytest.approx(state_bytes_of(optimizer.state), abs=1e-6)
    moments = 2
    whole = moments * (10 + 4100) * dtype.itemsize  # below torchao's size rule: like the parameter
    codes = moments * (8192 * cls.bits // 8 + 8192 // optimizer.block_size * 4 + 2 ** cls.bits * 4)
    assert declared * n == pytest.approx(whole + codes)


def test_the_declaration_needs_no_memory_and_matches_the_formula_at_real_size() -> None:
    # a decoder layer of Qwen2.5-0.5B's dimensions on the meta device: nothing is allocated to answer
    shapes = [(896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864), (896,), (896,)]
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
    for cls in (AdamW8bit, AdamW4bit):
        optimizer = cls(params)
        expected = sum(low_bit_state_bytes(p.numel(), cls.bits, optimizer.block_size) for p in params)
        n = sum(p.numel() for p in params)
        assert optimizer.state_bytes_per_param() * n == pytest.approx(expected)
    assert AdamW8bit(params).state_bytes_per_param() == pytest.approx(2.03, abs=0.01)  # vs AdamW's 8.0
    assert AdamW4bit(params).state_bytes_per_param() == pytest.approx(1.06, abs=0.01)
    assert state_bytes_per_param(torch.optim.AdamW(params)) == 8.0
    assert state_bytes_per_param(AdamW8bit(params), torch.bfloat16) < state_bytes_per_param(AdamW8bit(params))


@pytest.mark.parametrize("cls", [AdamW8bit, AdamW4bit])
def test_the_state_round_trips_through_a_safe_torch_save_bitwise(cls) -> None:
    params = _params()
    optimizer = cls(params, lr=1e-2)
    for seed in (1, 2):
        _step(optimizer, params, seed)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    saved = [p.detach().clone() for p in params]
    for seed in (3, 4):
        _step(optimizer, params, seed)
    uninterrupted = [p.detach().clone() for p in params]

    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    packed = state["state"][0]["exp_avg"]
    assert packed["bits"] == cls.bits and type(packed["codes"]) is torch.Tensor  # plain tensors: no torchao to load
    resumed = [torch.nn.Parameter(s.clone()) for s in saved]
    again = cls(resumed, lr=1e-2)
    again.load_state_dict(state)
    for seed in (3, 4):
        _step(again, resumed, seed)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))
    assert torch.equal(optimizer.state[params[0]]["exp_avg"].codes, again.state[resumed[0]]["exp_avg"].codes)


def test_a_state_of_another_optimizer_bit_width_or_block_size_is_refused_naming_the_fix() -> None:
    params = _params()
    adamw = torch.optim.AdamW(params)
    _step(adamw, params, 1)
    with pytest.raises(ValueError, match=r"^AdamW8bit: cannot resume the checkpoint's optimizer state: its exp_avg of a "
                                         r"\(64, 128\) parameter is a whole torch\.float32 tensor, this optimizer "
                                         r"keeps 8-bit codes .*Fix: the optimizer="):
        AdamW8bit(params).load_state_dict(adamw.state_dict())
    eight = AdamW8bit(params)
    _step(eight, params, 1)
    with pytest.raises(ValueError, match=r"AdamW4bit: .*holds 8-bit codes in 32 blocks, this optimizer keeps 4-bit "
                                         r"codes in 64 blocks"):
        AdamW4bit(params).load_state_dict(eight.state_dict())
    with pytest.raises(ValueError, match=r"holds 8-bit codes in 32 blocks, this optimizer keeps 8-bit codes in 128 "
                                         r"blocks \(block_size=64\)"):
        AdamW8bit(params, block_size=64).load_state_dict(eight.state_dict())


@pytest.mark.parametrize(("cls", "block_size", "need"), [(AdamW8bit, 0, "an int >= 1"), (AdamW8bit, 2.5, "an int"),
                                                         (AdamW4bit, 3, "an even int >= 2")])
def test_a_bad_block_size_is_refused_by_name(cls, block_size, need) -> None:
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\(block_size={block_size!r}\): block_size must be {need}"):
        cls(_params(), block_size=block_size)


def test_amsgrad_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"^AdamW8bit\(amsgrad=True\): torchao's quantised step cannot keep the running "
                                         r"maximum .*pytorch/ao issue 2497.*Fix: amsgrad=False"):
        AdamW8bit(_params(), amsgrad=True)


def test_zero_refuses_a_low_bit_optimizer_naming_both_sides_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"^ZeroStrategy: AdamW4bit cannot train under DeepSpeed ZeRO: .*flat float32 "
                                         r"partition.*Fix: strategy=auto or strategy=ddp to keep AdamW4bit, or a ZeRO "
                                         r"strategy with optimizer=adamw"):
        check_zero_optimizer(AdamW4bit(_params()))
    check_zero_optimizer(torch.optim.AdamW(_params()))  # others pass


class _Regression(pl.LightningModule):
    """A 64x128 matrix (quantised) and a bias (whole) trained on a fixed batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(128, 64)
        self.x, self.y = torch.randn(16, 128), torch.randn(16, 64)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.layer(self.x), self.y)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(8, 1), batch_size=1)

    def configure_optimizers(self):
        optimizer = AdamW8bit(self.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)  # updates the tensor lr
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _fit(tmp_path, max_steps: int, ckpt_path=None) -> tuple[_Regression, pl.Trainer]:
    model = _Regression()
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2,
                                                                 save_top_k=-1)])
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


def test_a_plain_trainer_resumes_the_low_bit_state_bitwise(tmp_path) -> None:
    uninterrupted, _ = _fit(tmp_path / "a", max_steps=6)
    _fit(tmp_path / "b", max_steps=2)
    checkpoint = tmp_path / "b" / "epoch=0-step=2.ckpt"
    assert torch.load(checkpoint, weights_only=True)["optimizer_states"][0]["state"][0]["exp_avg"]["bits"] == 8
    resumed, trainer = _fit(tmp_path / "b", max_steps=6, ckpt_path=checkpoint)
    assert torch.equal(uninterrupted.layer.weight, resumed.layer.weight)
    assert torch.equal(uninterrupted.layer.bias, resumed.layer.bias)
    assert float(trainer.optimizers[0].param_groups[0]["lr"]) == pytest.approx(1e-2 * 0.5 ** 3)


def test_the_planner_charges_the_declared_bytes_and_step_of_a_low_bit_optimizer() -> None:
    from lit_speed.memory.memory_tracker import LiveTensorTracker
    from lit_speed.memory.model_state import model_state_bytes
    from lit_speed.memory.planner import measure_optimizer, plan

    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    probe = measure_optimizer(model, AdamW8bit)  # its compiled step cannot run under the tracker: declared
    assert probe.source == "declared; step temporaries declared, not traced" and probe.step_bytes == 8 * 128 * 64
    assert probe.state_bytes(torch.float32) == pytest.approx(AdamW8bit(list(model.parameters())).state_bytes_per_param())
    step = lambda m, b: m(b).pow(2).mean()  # noqa: E731
    batch = torch.randn(4, 128)
    rows = {name: plan(model, batch, micro_batches=[4], checkpoint_modules=(), step_fn=step, precisions=["32-true"],
                       optimizer_factory=factory).rows[0]
            for name, factory in (("adamw", None), ("8bit", AdamW8bit))}
    assert rows["8bit"].peak_bytes < rows["adamw"].peak_bytes  # ~2.7 bytes of state instead of 8, a larger step
    n = sum(p.numel() for p in model.parameters())
    states = model_state_bytes(n, "32-true", state_bytes=probe.state_bytes)
    assert states.optimizer == int(probe.state_bytes(torch.float32) * n) and states.params == 4 * n
    optimizer = AdamW8bit([torch.nn.Parameter(torch.randn(64, 128))])
    _step(optimizer, optimizer.param_groups[0]["params"], 1)
    with LiveTensorTracker() as tracker:  # a quantised state passing through the tracker is skipped, not a crash
        moment = optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"]
        assert type(moment.float()) is type(moment)
    assert tracker.peak_bytes == 0
