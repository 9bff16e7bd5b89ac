"""PEFTAdapters with ZeRO-2/3 and across a kill: each through ``scripts/train.py`` in a fresh interpreter (slow tier)."""
from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.fault_scripts.compare_checkpoints import assert_bitwise_equal
from tests.helpers.fault_scripts.runs import explain, kill_at, train, train_side_by_side
from tests.helpers.tiny_hf import STDLIB, save_tiny_causal_lm

pytestmark = pytest.mark.slow

GPT = ["experiment=charlm_cpu", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.block_size=16",
       "data.max_bytes=100000", "trainer.max_steps=12", "trainer.val_check_interval=4", "trainer.limit_val_batches=1",
       "trainer.num_sanity_val_steps=0", "trainer.deterministic=true", "seed=7", "logger=none", "validate=false",
       "callbacks=[model_checkpoint,fault_tolerance]", "callbacks.model_checkpoint.every_n_train_steps=2",
       "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "peft=lora", "peft.r=4"]


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_composes_with_zero_and_checkpoints_only_the_adapters(tmp_path, stage):
    extra = [f"strategy=zero{stage}"] + (["peft.export=false"] if stage == 3 else [])
    done = train([*GPT, *extra], tmp_path / "run")
    assert done.returncode == 0, explain(done)
    states = sorted((tmp_path / "run" / "checkpoints" / "last.ckpt").rglob("*model_states.pt"))
    module = torch.load(states[0], map_location="cpu", weights_only=False)["module"]
    # the frozen base is not written; DeepSpeed's exclude_frozen_parameters drops frozen parameters by
    # named_parameters(), which lists a tied weight once: its alias (lm_head.weight = wte.weight) stays
    assert module and all("lora_" in k or k == "model.lm_head.weight" for k in module), sorted(module)
    assert sum("lora_" in k for k in module) == 2 * 8
    assert "PEFTAdapters: lora on 8 modules" in done.stdout + done.stderr
    if stage == 2:
        assert (tmp_path / "run" / "merged" / "model.pt").is_file()


def test_export_under_zero3_is_refused_before_training(tmp_path):
    done = train([*GPT, "strategy=zero3"], tmp_path / "run")
    assert done.returncode == 2, explain(done)
    assert re.search(r"^Config error: peft\.export=True: PEFTAdapters\(export=True\): cannot merge and export under "
                     r"ZeRO stage 3 .*Fix: peft\.export=false", done.stderr, flags=re.M), explain(done)
    assert "Epoch 0" not in done.stdout and "Traceback" not in done.stderr


def test_killed_hf_lora_run_resumes_bitwise_from_its_adapters_only_checkpoint(tmp_path):
    folder = save_tiny_causal_lm(tmp_path / "hf", "gpt2", seed=1)
    texts = tmp_path / "texts"
    texts.mkdir()
    for name in ["csv.py", "shlex.py", "token.py", "calendar.py", "bisect.py", "heapq.py"]:
        (texts / f"{name}.txt").write_text((STDLIB / name).read_text())
    args = ["model=hf_causal_lm", "data=text_folder", f"model.pretrained={folder}", f"data.root={texts}",
            "data.block_size=32", "data.batch_size=4", "data.val_every=3", *GPT[6:], "peft.target_modules=[c_attn]"]
    # the stopped run first: up_grad=auto's timing lands in the run's cache and the uninterrupted run reuses it.
    # Run side by side on an empty cache, each timed its own choice on a busy machine: CI (stop 45) saw one choose
    # standard and the other transposed, 1e-10..1e-7 apart (the same sums in another order), not a resume fault.
    stopped = train(args + kill_at(7), tmp_path / "run")
    assert stopped.returncode == -9, explain(stopped)
    resumed, reference = train_side_by_side((args + ["ckpt_path=last"], tmp_path / "run"),
                                            (args, tmp_path / "reference"))
    assert reference.returncode == 0, explain(reference)
    assert resumed.returncode == 0, explain(resumed)
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr, explain(resumed)
    chosen = [re.search(r"weight gradient (standard|transposed) \((.*)\)", run.stdout + run.stderr)
              for run in (stopped, resumed, reference)]
    assert all(chosen), [explain(run) for run in (stopped, resumed, reference)]
    assert len({m.group(1) for m in chosen}) == 1, [m.group(0) for m in chosen]
    assert chosen[1].group(2).startswith("restored from the checkpoint"), chosen[1].group(0)
    assert "(cached " in chosen[2].group(2), chosen[2].group(0)  # the uninterrupted run reused the stopped run's timing
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert all("lora_" in k for k in torch.load(last, weights_only=True)["state_dict"])
    assert_bitwise_equal(tmp_path / "reference" / "checkpoints" / "last.ckpt", last)
