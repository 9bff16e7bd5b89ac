"""threads=auto: the intra-op thread count timed on the run's first steps (copies of the step in a deterministic run),
applied, cached, checkpointed, reused on resume."""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
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


class CountsSeen(Callback):
    """The intra-op thread count each training batch ran at, and the optimizer step it belonged to."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((trainer.global_step, torch.get_num_threads()))


def _fit(root, plugin, max_steps, ckpt_path=None, **trainer_args):
    counts = CountsSeen()
    trainer = pl.Trainer(max_steps=max_steps, plugins=[plugin], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root,
                         callbacks=[ModelCheckpoint(dirpath=root, save_last=True), counts], **trainer_args)
    trainer.fit(Tiny(), ckpt_path=ckpt_path)
    trainer.counts_seen = counts.seen
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

def test_a_deterministic_run_times_copies_on_the_first_batch_saves_and_reuses_the_count_on_resume(tmp_path,
                                                                                                    monkeypatch):
    # every step of a deterministic run runs at one count (MKL's sums depend on it): copies are timed first
    calls = []

    def stand_in(module, batch, mode, counts, device=None):  # the timing itself is tested below, for real
        calls.append(list(counts))
        return Decision("precision.threads", "1", "stand-in timing")

    monkeypatch.setattr("lit_speed.precision.step_timing.choose_threads", stand_in)
    plugin = GuardedPrecision("32-true", threads="auto")
    assert plugin.describe()["threads"].startswith("auto: times this model's step")
    _fit(tmp_path, plugin, 2, deterministic=True)
    assert len(calls) == 1 and torch.get_num_threads() == 1
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["GuardedPrecision"]["threads"] == 1

    torch.set_num_threads(2)
    resumed = GuardedPrecision("32-true", threads="auto")
    _fit(tmp_path, resumed, 4, ckpt_path=str(tmp_path / "last.ckpt"), deterministic=True)
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


def _no_copies(monkeypatch, cache):
    monkeypatch.setenv("LIT_SPEED_CACHE_DIR", str(cache))  # this test's own machine cache
    def copies(*args, **kwargs):
        raise AssertionError("threads=auto timed copies of the step in a run that can time its own steps")

    monkeypatch.setattr("lit_speed.precision.step_timing.choose_threads", copies)
    monkeypatch.setattr("lit_speed.precision.step_timing.thread_candidates", lambda cores, processes=1: [1, 2])


def _windows(seen):
    """The thread count of each optimizer step, checking that all batches of a step ran at one count."""
    steps: dict[int, set[int]] = {}
    for step, count in seen:
        steps.setdefault(step, set()).add(count)
    assert all(len(c) == 1 for c in steps.values()), f"a count changed inside an accumulation window: {steps}"
    return [c.pop() for _, c in sorted(steps.items())]


def test_auto_threads_are_timed_on_the_runs_own_optimizer_steps_then_cached(tmp_path, monkeypatch, caplog):
    # issue 52: copies of the step took 0.5-1.2 s of a ~30 s run before its first step; the run's own steps cost
    # only the slower count's extra time on a few of them
    _no_copies(monkeypatch, tmp_path / "cache")
    torch.set_num_threads(2)
    plugin = GuardedPrecision("32-true", threads="auto")
    trainer = _fit(tmp_path / "a", plugin, 24, accumulate_grad_batches=2, deterministic=False)
    windows = _windows(trainer.counts_seen)
    assert windows[:2] == [2, 1], "the warm-up round: the count in use first, then the other"
    chosen = plugin.threads.chosen
    assert chosen in (1, 2) and plugin.threads.trial is None
    reason = plugin.threads.reason
    assert reason.startswith("timed on this run's first ") and "optimizer steps: 2 " in reason and ", 1 " in reason
    timed = int(reason.split("first ")[1].split(" ")[0])
    assert timed % 2 == 0 and 8 <= timed <= 14, "a warm-up round, then 3 to 6 rounds of one step per count"
    rounds = [windows[i:i + 2] for i in range(2, timed, 2)]
    assert all(sorted(r) == [1, 2] for r in rounds), f"each round times every count once: {windows[:timed]}"
    assert set(windows[timed:]) == {chosen}, "the rest of the run trains at the chosen count"
    assert torch.get_num_threads() == chosen
    assert torch.load(tmp_path / "a" / "last.ckpt", weights_only=True)["GuardedPrecision"]["threads"] == chosen

    torch.set_num_threads(2)  # the next run on this machine starts at torch's count again: no trial
    again = GuardedPrecision("32-true", threads="auto")
    trainer = _fit(tmp_path / "b", again, 4, accumulate_grad_batches=2, deterministic=False)
    assert set(_windows(trainer.counts_seen)) == {chosen} and "(cached " in again.threads.reason


@pytest.mark.parametrize("max_steps", [3, 5])
def test_a_run_that_ends_during_the_trial_keeps_the_count_says_so_and_caches_nothing(tmp_path, monkeypatch, max_steps):
    # 5 steps: the warm-up round and one timed step per count, fewer than the two rounds a decision needs
    _no_copies(monkeypatch, tmp_path / "cache")
    torch.set_num_threads(2)
    plugin = GuardedPrecision("32-true", threads="auto")
    _fit(tmp_path, plugin, max_steps, deterministic=False)
    assert plugin.threads.chosen == 2 and plugin.threads.trial is None
    assert plugin.threads.reason == f"kept: the run ended during the trial ({max_steps - 1} optimizer steps)"
    assert not (tmp_path / "cache" / "precision.threads.json").exists()


@pytest.mark.parametrize("device, deterministic, world_size", [("cuda", False, 1), ("cpu", True, 1), ("cpu", False, 2)])
def test_copies_are_timed_where_the_run_cannot_time_its_own_steps(monkeypatch, device, deterministic, world_size):
    # a GPU step's time needs a synchronisation, a deterministic run one count for every step, ranks one decision:
    # the routing is checked with a stand-in trainer (no GPU or second process here)
    from types import SimpleNamespace

    calls = []

    def stand_in(module, batch, mode, counts, device=None):
        calls.append(device)
        return Decision("precision.threads", "1", "stand-in timing")

    monkeypatch.setattr("lit_speed.precision.step_timing.choose_threads", stand_in)
    monkeypatch.setattr("lit_speed.precision.step_timing.thread_candidates", lambda cores, processes=1: [1, 2])
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    trainer = SimpleNamespace(world_size=world_size, num_devices=1, global_rank=0, lightning_module=Tiny(),
                              strategy=SimpleNamespace(root_device=torch.device(device), broadcast=lambda obj, src: obj))
    choice = GuardedPrecision("32-true", threads="auto").threads
    choice.decide(trainer, (torch.randn(8, 8), torch.randn(8, 1)), "32-true")
    assert calls == [torch.device(device)] and choice.trial is None and choice.chosen == 1


def test_a_checkpoint_taken_during_the_trial_leaves_the_count_to_the_resumed_run(tmp_path, monkeypatch):
    # a run stopped during its trial (preempted, or short) saved no count: the resumed run times its own steps
    _no_copies(monkeypatch, tmp_path / "cache")
    torch.set_num_threads(2)
    _fit(tmp_path, GuardedPrecision("32-true", threads="auto"), 3, deterministic=False)
    assert "threads" not in torch.load(tmp_path / "last.ckpt", weights_only=True)["GuardedPrecision"]
    torch.set_num_threads(2)
    resumed = GuardedPrecision("32-true", threads="auto")
    _fit(tmp_path, resumed, 24, ckpt_path=str(tmp_path / "last.ckpt"), deterministic=False)
    assert resumed.threads.reason.startswith("timed on this run's first "), resumed.threads.reason


def _busy_trials(monkeypatch, busy):
    """``OtherLoad.busy`` of the n-th trial's load (n from 0) is ``busy(n)``: a neighbour's burst, on demand."""
    from lit_speed.tuning.machine_cache import OtherLoad

    made: list[OtherLoad] = []
    enter = OtherLoad.__enter__

    def entered(self):
        made.append(self)
        return enter(self)

    monkeypatch.setattr(OtherLoad, "__enter__", entered)
    monkeypatch.setattr(OtherLoad, "busy", property(lambda self: busy(made.index(self))))
    monkeypatch.setattr("lit_speed.precision.thread_choice.RETIME_AFTER", 6)
    return made


def test_a_trial_beside_other_load_is_run_again_later_and_the_quiet_one_decides_and_is_cached(tmp_path, monkeypatch,
                                                                                               caplog):
    # race 10 on Z4: a trial during a neighbour's burst timed 2 threads at 322 ms, 1 at 91 ms, and its run trained at
    # one thread to the end (43.9 s against its peers' 33): a busy trial's count holds only until a quiet trial
    _no_copies(monkeypatch, tmp_path / "cache")
    trials = _busy_trials(monkeypatch, lambda n: n == 0)
    torch.set_num_threads(2)
    plugin = GuardedPrecision("32-true", threads="auto")
    with caplog.at_level("INFO"):
        trainer = _fit(tmp_path / "a", plugin, 40, deterministic=False)
    assert len(trials) == 2 and plugin.threads.retime is None
    first = int(next(r.message for r in caplog.records if "-> " in r.message).split("first ")[1].split(" ")[0])
    again = next(r.message for r in caplog.records if " again from optimizer step " in r.message)
    assert f"again from optimizer step {first + 6}: the last trial ran while other processes kept" in again
    windows = _windows(trainer.counts_seen)
    busy_choice = windows[first]
    assert set(windows[first:first + 6]) == {busy_choice}, "the busy trial's count trains until the trial again"
    assert windows[first + 6] == busy_choice and sorted(windows[first + 6:first + 8]) == [1, 2], \
        "the trial again: the count in use first, then the other"
    reason = plugin.threads.reason
    assert reason.startswith(f"timed again on this run's optimizer steps {first + 6}-"), reason
    assert set(windows[-5:]) == {plugin.threads.chosen}
    assert (tmp_path / "cache" / "precision.threads.json").exists(), "the quiet trial is the machine's answer"

    torch.set_num_threads(2)  # the next run starts at torch's count, as the first did: it finds the quiet answer
    later = GuardedPrecision("32-true", threads="auto")
    _fit(tmp_path / "b", later, 4, deterministic=False)
    assert "(cached " in later.threads.reason and len(trials) == 2


def test_trials_beside_other_load_are_run_again_at_most_retimes_times_and_nothing_is_cached(tmp_path, monkeypatch):
    from lit_speed.precision.thread_choice import RETIMES

    _no_copies(monkeypatch, tmp_path / "cache")
    trials = _busy_trials(monkeypatch, lambda n: True)
    torch.set_num_threads(2)
    plugin = GuardedPrecision("32-true", threads="auto")
    _fit(tmp_path, plugin, 120, deterministic=False)
    assert len(trials) == 1 + RETIMES and plugin.threads.retime is None and plugin.threads.trial is None
    assert plugin.threads.reason.startswith("timed again on this run's optimizer steps ")
    assert not (tmp_path / "cache" / "precision.threads.json").exists()


def test_a_count_from_a_trial_beside_other_load_is_timed_again_by_the_resumed_run(tmp_path, monkeypatch):
    _no_copies(monkeypatch, tmp_path / "cache")
    trials = _busy_trials(monkeypatch, lambda n: n == 0)
    monkeypatch.setattr("lit_speed.precision.thread_choice.RETIME_AFTER", 50)
    torch.set_num_threads(2)
    stopped = GuardedPrecision("32-true", threads="auto")
    _fit(tmp_path, stopped, 16, deterministic=False)  # the busy trial ended, its trial again still due
    assert stopped.threads.retime is not None
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["GuardedPrecision"]
    assert saved["threads"] == stopped.threads.chosen and saved["threads_busy"] is True
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)  # the busy trial chose 1 thread, as in race 10
    ckpt["GuardedPrecision"]["threads"] = 1
    torch.save(ckpt, tmp_path / "last.ckpt")
    torch.set_num_threads(2)
    resumed = GuardedPrecision("32-true", threads="auto")
    _fit(tmp_path, resumed, 40, ckpt_path=str(tmp_path / "last.ckpt"), deterministic=False)
    assert len(trials) == 2 and resumed.threads.reason.startswith("timed on this run's first "), resumed.threads.reason
    torch.set_num_threads(2)  # a fresh run finds the resumed run's quiet answer: the same key as a first run's
    later = GuardedPrecision("32-true", threads="auto")
    _fit(tmp_path / "later", later, 4, deterministic=False)
    assert "(cached " in later.threads.reason and len(trials) == 2
