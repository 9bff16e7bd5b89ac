"""threads=auto: the intra-op thread count timed on the model's first batch, applied, checkpointed, reused on resume."""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lit_speed import GuardedPrecision
from lit_speed.precision.step_timing import choose_threads, thread_candidates
from lit_speed.tuning import Decision


def test_thread_candidates_are_powers_of_two_up_to_the_process_share():
    assert thread_candidates(2) == [1, 2]
    assert thread_candidates(6) == [1, 2, 4, 6]
    assert thread_candidates(16, processes=2) == [1, 2, 4, 8]
    assert thread_candidates(1, processes=4) == [1]


def test_a_bad_thread_setting_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"GuardedPrecision\(threads=0\): threads must be an int >= 1, 'auto' or None"):
        GuardedPrecision(threads=0)


def test_more_threads_than_cores_is_refused_naming_the_cores(monkeypatch):
    # issue 33: threads=1000 ran 1000 threads on 2 cores (3.5x slower), without a word
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(ValueError, match=r"GuardedPrecision\(threads=3\): more than the 2 CPU core\(s\) this process "
                                         r"may run on .*Fix: threads=2 \(or fewer\), threads=auto"):
        GuardedPrecision(threads=3)
    assert GuardedPrecision(threads=2).threads.chosen == 2


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)),
                          batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(root, plugin, max_steps, ckpt_path=None):
    trainer = pl.Trainer(max_steps=max_steps, plugins=[plugin], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root,
                         callbacks=[ModelCheckpoint(dirpath=root, save_last=True)])
    trainer.fit(Tiny(), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_deterministic_run_sets_torchs_own_count_so_mkl_cannot_change_it(monkeypatch, deterministic):
    # MKL_DYNAMIC is on until torch.set_num_threads is called; a deterministic run calls it with torch's count
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    GuardedPrecision().threads.apply_fixed()
    assert calls == ([torch.get_num_threads()] if deterministic else [])
    GuardedPrecision(threads=1).threads.apply_fixed()
    assert calls[-1] == 1

def test_auto_threads_are_decided_on_the_first_batch_saved_and_reused_on_resume(tmp_path, monkeypatch):
    calls = []

    def stand_in(module, batch, mode, counts, device=None):  # the timing itself is tested below, for real
        calls.append(list(counts))
        return Decision("precision.threads", "1", "stand-in timing")

    monkeypatch.setattr("lit_speed.precision.step_timing.choose_threads", stand_in)
    plugin = GuardedPrecision("32-true", threads="auto")
    assert plugin.describe()["threads"].startswith("auto: times this model's step")
    _fit(tmp_path, plugin, 2)
    assert len(calls) == 1 and torch.get_num_threads() == 1
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["GuardedPrecision"]["threads"] == 1

    torch.set_num_threads(2)
    resumed = GuardedPrecision("32-true", threads="auto")
    _fit(tmp_path, resumed, 4, ckpt_path=str(tmp_path / "last.ckpt"))
    assert len(calls) == 1, "timed again on resume"
    assert torch.get_num_threads() == 1 and "restored from the checkpoint" in resumed.threads.reason


def test_choose_threads_times_the_real_step_and_leaves_no_trace():
    model = Tiny()
    before = [p.detach().clone() for p in model.parameters()]
    batch = (torch.randn(8, 8), torch.randn(8, 1))
    rng = torch.get_rng_state()
    torch.set_num_threads(2)  # the run's own count joins the candidates: on a 16-core box it would be a third one
    decision = choose_threads(model, batch, "32-true", [1, 2])
    assert decision.chosen in {"1", "2"} and set(decision.times) == {"1", "2"}
    assert all(t is not None and t > 0 for t in decision.times.values())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(rng, torch.get_rng_state())
