"""A hand-written PyTorch loop doing the same math as the charlm GPT run, with no Lightning at all.

Same model class (:class:`lit_speed.models.gpt.GPT`), same corpus windows, same parameter groups,
AdamW and warm-up + cosine schedule, same validation windows. It is the floor the benchmarks compare
Lightning and lit_speed against (``bench_overhead.py``, ``bench_time_to_target.py``).

    python benchmarks/plain_loop.py --steps 200     # trains, prints val loss vs the unigram baseline
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import Any

import _common  # noqa: F401 - puts the repository on sys.path
import torch
import torch.nn.functional as F

from lit_speed.data.charlm import CharLMDataModule
from lit_speed.models.configure_optimizers import param_groups
from lit_speed.models.gpt import GPT
from lit_speed.optim.schedules import warmup_cosine


@dataclass
class LoopConfig:
    """The charlm_cpu experiment's settings (conf/experiment/charlm_cpu.yaml + conf/model/gpt.yaml)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    batch_size: int = 12
    lr: float = 0.003
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    max_steps: int = 200
    val_every: int = 100          # training batches between validations (0 = never)
    val_batches: int = 8          # validation batches of 64 windows
    target: float | None = None   # stop at the first validation with val loss <= target
    fused: bool | None = None     # AdamW fused kernel; None = torch's default implementation
    seed: int = 42
    cache_dir: str = ".cache/charlm"
    constant_lr: bool = False     # True: no warm-up/cosine (the plain_lightning reference recipe of the race)


@dataclass
class LoopResult:
    step_start_times: list[float] = field(default_factory=list)  # perf_counter at the start of every step
    val_history: list[tuple[int, float, float]] = field(default_factory=list)  # (step, seconds, val loss)
    final_train_loss: float = math.nan
    time_to_target_s: float | None = None
    cpu_time_to_target_s: float | None = None  # process CPU seconds: steadier than wall time on a shared machine
    target_step: int | None = None
    wall_time_s: float = 0.0
    steps: int = 0

    def step_times(self, skip: int = 5) -> list[float]:
        """Seconds between consecutive step starts, after ``skip`` warm-up steps (validation steps excluded)."""
        val_steps = {s for s, _, _ in self.val_history}
        times = self.step_start_times
        return [b - a for i, (a, b) in enumerate(zip(times, times[1:]), start=1) if i > skip and i not in val_steps]


def build(cfg: LoopConfig) -> tuple[GPT, torch.optim.Optimizer, Any, CharLMDataModule]:
    torch.manual_seed(cfg.seed)
    dm = CharLMDataModule(cache_dir=cfg.cache_dir, block_size=cfg.block_size, batch_size=cfg.batch_size)
    dm.setup("fit")
    model = GPT(97, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, dropout=0.0, bias=False)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, fused=cfg.fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0) if cfg.constant_lr else \
        warmup_cosine(opt, cfg.max_steps, cfg.warmup_steps, cfg.min_lr_ratio)
    return model, opt, sched, dm


def loss_of(model: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-100)


@torch.no_grad()
def validate(model: GPT, dm: CharLMDataModule, batches: int) -> float:
    model.eval()
    losses = [loss_of(model, b) for b, _ in zip(dm.val_dataloader(), range(batches))]
    model.train()
    return float(torch.stack(losses).mean())


def _probe_eval(model: GPT, dm: CharLMDataModule, probe: Any) -> float:
    from lit_speed.reporting.fixed_validation import mean_token_loss

    model.eval()
    try:
        return mean_token_loss(model, probe.dataset, probe.batch_size)
    finally:
        model.train()


def train(cfg: LoopConfig, probe: Any = None) -> LoopResult:
    """Train for ``cfg.max_steps`` (or until ``cfg.target``); the clock starts before the first batch.

    ``probe``: a :class:`lit_speed.reporting.fixed_validation.TokenCadenceProbe` called after every batch
    (the time-to-target race's shared instrument); training stops when it reports the target met.
    """
    model, opt, sched, dm = build(cfg)
    result = LoopResult()
    if probe is not None and probe.dataset is None:
        probe.dataset = dm.val_dataset
    start, cpu_start = time.perf_counter(), time.process_time()
    step = 0
    while step < cfg.max_steps:
        for batch in dm.train_dataloader():
            result.step_start_times.append(time.perf_counter())
            loss = loss_of(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if probe is not None and probe.after_batch(batch[0].numel(), step, lambda: _probe_eval(model, dm, probe)):
                result.target_step = step
                break
            if cfg.val_every and step % cfg.val_every == 0:
                val = validate(model, dm, cfg.val_batches)
                result.val_history.append((step, time.perf_counter() - start, val))
                if cfg.target is not None and val <= cfg.target:
                    result.time_to_target_s, result.target_step = time.perf_counter() - start, step
                    result.cpu_time_to_target_s = time.process_time() - cpu_start
                    break
            if step >= cfg.max_steps:
                break
        if result.target_step is not None:
            break
    result.final_train_loss = float(loss.detach())
    result.wall_time_s = time.perf_counter() - start
    result.steps = step
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--target", type=float, default=None)
    args = parser.parse_args()
    cfg = LoopConfig(max_steps=args.steps, target=args.target, cache_dir=str(_common.ROOT / ".cache" / "charlm"))
    result = train(cfg)
    _, _, _, dm = build(cfg)
    steps = result.step_times()
    print(f"{result.steps} steps in {result.wall_time_s:.1f} s; median step {1000 * sorted(steps)[len(steps) // 2]:.1f} ms;"
          f" final train loss {result.final_train_loss:.4f}")
    for step, seconds, val in result.val_history:
        print(f"  step {step:5d}  {seconds:6.1f} s  val/loss {val:.4f}")
    print(f"unigram baseline val/loss {dm.unigram_baseline():.4f}")


if __name__ == "__main__":
    main()
