"""The memory planner counts adapters: frozen parameters take parameter memory, no gradient, no optimizer state."""
from __future__ import annotations

import subprocess
import sys

import torch

from lit_speed.finetune.adapters import add_adapters
from lit_speed.memory.model_state import state_bytes
from lit_speed.memory.planner import plan
from lit_speed.models.gpt import GPTModule
from tests.helpers.repo import ROOT


def test_frozen_parameters_count_as_weights_only():
    full = state_bytes(1000, "32-true", 2)
    lora = state_bytes(100, "32-true", 2, frozen_params=900)
    assert lora.params == full.params == 4000
    assert (lora.grads, lora.optimizer) == (400, 800) and (full.grads, full.optimizer) == (4000, 8000)
    zero3 = state_bytes(100, "bf16-mixed", 2, "zero3", world_size=2, frozen_params=900)
    assert zero3.params == 2 * 1000 // 2 and zero3.grads == 2 * 100 // 2  # both sharded over the 2 processes


def test_plan_of_a_lora_model_predicts_less_memory_than_full_training():
    torch.manual_seed(0)
    sizes = {"vocab_size": 97, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64}
    batch = (torch.randint(0, 97, (4, 32)), torch.randint(0, 97, (4, 32)))
    full = plan(GPTModule(**sizes), batch, micro_batches=[4], precisions=["32-true"], checkpoint_modules=())
    model = GPTModule(**sizes)
    add_adapters(model, "lora", ["all-linear"], r=4)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    lora = plan(model, batch, micro_batches=[4], precisions=["32-true"], checkpoint_modules=())
    assert f"{trainable:,} trainable + {frozen:,} frozen parameters" in lora.notes[0]
    # full: weights + grads + 2 Adam states of the base (16 B/param); LoRA: weights of base + adapters, grads and
    # states of the adapters: 16 * frozen - (4 * (frozen + trainable) + 12 * trainable) less, before activations
    state_saving = 12 * frozen - 16 * trainable
    assert full.rows[0].peak_bytes - lora.rows[0].peak_bytes > 0.5 * state_saving > 0


def test_plan_script_applies_the_peft_option(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan.py"), "experiment=charlm_cpu", "peft=lora",
                           "data.max_bytes=100000", "--micro-batches", "4", "--precisions", "32-true",
                           "--checkpoint", ""], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trainable +" in done.stdout and "frozen parameters" in done.stdout, done.stdout[-2000:]
    assert "peft=lora" in done.stdout  # the commands it prints keep the option
