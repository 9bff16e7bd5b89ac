"""A loader-bound job vs the same math through preload + a vectorised batch transform.

    python benchmarks/bench_data_pipeline.py [--epochs 2] [--rounds 5] [--batch-size 64]

Workload: scikit-learn digits (1438 training images, 8x8), augmented with a random shift of up to one pixel
(zero-filled) and Gaussian pixel noise (sigma 0.05), feeding the default MLP (64-256-256-10, AdamW).

- ``plain``: the textbook pipeline: a ``Dataset`` whose ``__getitem__`` augments one image on the CPU,
  ``DataLoader(batch_size=64, shuffle=True, num_workers=0)`` and its per-sample collate;
- ``fast``: the tensors preloaded, one ``tensor[indices]`` per batch (``BatchSampler`` + ``BatchFetch``, as
  ``DigitsDataModule(preload=True)`` does) and :func:`lit_speed.data.pipeline.jitter_images` applied to the
  whole batch (what ``batch_transform`` does in ``on_after_batch_transfer``).

Both draw the same augmentation distribution (``tests/data/test_pipeline.py`` checks the shift is identical
for the same draw). Measured: samples/s of the loader alone, and of the whole training step (loader +
forward/backward/AdamW) in a plain loop, variants interleaved round by round; ratio = median of per-round
ratios. One torch thread, so the numbers do not depend on what else the shared machine runs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import stats, write_result  # noqa: E402
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler  # noqa: E402

from lit_speed.data.digits import load_digits_tensors  # noqa: E402
from lit_speed.data.pipeline import BatchFetch, jitter_images  # noqa: E402
from lit_speed.models.mlp import MLPClassifier  # noqa: E402

SIDE, SHIFT, NOISE = 8, 1, 0.05


class AugmentedDigits(Dataset):
    """Per-sample CPU augmentation: the loader-bound baseline."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = F.pad(self.x[i].view(SIDE, SIDE), (SHIFT,) * 4)
        dr, dc = torch.randint(0, 2 * SHIFT + 1, (2,)).tolist()
        out = img[dr:dr + SIDE, dc:dc + SIDE].reshape(-1) + NOISE * torch.randn(SIDE * SIDE)
        return out, self.y[i]


def loaders(batch_size: int) -> dict[str, tuple[DataLoader, object]]:
    train, _ = load_digits_tensors()
    x, y = train.tensors
    plain = DataLoader(AugmentedDigits(x, y), batch_size=batch_size, shuffle=True, num_workers=0)
    fast = DataLoader(BatchFetch(train), sampler=BatchSampler(RandomSampler(train), batch_size, drop_last=False),
                      batch_size=None, num_workers=0)
    return {"plain": (plain, None), "fast": (fast, lambda b: jitter_images(b, SIDE, SHIFT, NOISE))}


def run_epochs(loader: DataLoader, transform, epochs: int, step=None) -> tuple[float, int]:
    n, t0 = 0, time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            if transform is not None:
                batch = transform(batch)
            if step is not None:
                step(batch)
            n += len(batch[1])
    return time.perf_counter() - t0, n


def make_step():
    model = MLPClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2, help="epochs per timed repeat")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repeats per variant")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    variants = loaders(args.batch_size)
    results: dict[str, dict] = {}
    for mode in ("loader", "train_step"):
        rates: dict[str, list[float]] = {name: [] for name in variants}
        steps = {name: make_step() for name in variants} if mode == "train_step" else {name: None for name in variants}
        for name, (loader, transform) in variants.items():  # warm-up
            run_epochs(loader, transform, 1, steps[name])
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                loader, transform = variants[name]
                seconds, n = run_epochs(loader, transform, args.epochs, steps[name])
                rates[name].append(n / seconds)
        ratios = [f / p for f, p in zip(rates["fast"], rates["plain"])]
        results[mode] = {"samples_per_sec": {k: stats(v) for k, v in rates.items()}, "ratio_fast_over_plain": stats(ratios)}
        print(f"{mode:>10}: plain {stats(rates['plain'])['median']:>9,.0f} samples/s | fast "
              f"{stats(rates['fast'])['median']:>9,.0f} samples/s | ratio {stats(ratios)['median']:.2f}x "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
    results["config"] = vars(args) | {"torch_threads": 1, "augmentation": f"shift<={SHIFT}px + N(0,{NOISE})"}
    line = (f"digits loader-bound (per-sample aug, DataLoader nw=0) vs preload+vectorised batch transform, batch "
            f"{args.batch_size}, 1 thread: loader {results['loader']['ratio_fast_over_plain']['median']:.1f}x, "
            f"whole train step {results['train_step']['ratio_fast_over_plain']['median']:.1f}x samples/s "
            f"(median of {args.rounds} interleaved rounds)")
    write_result("data_pipeline", results, line)


if __name__ == "__main__":
    main()
