"""The tools a user would otherwise pick, on the same model folder, corpus, batches and steps as lit_speed's row.

    python benchmarks/real_size_peers.py trainer   --model <folder> --mode lora --out row.json [--flags speed]
    python benchmarks/real_size_peers.py lightning --model <folder> --mode full --out row.json

``trainer``: Hugging Face ``transformers.Trainer`` (+ ``peft``'s ``get_peft_model`` for LoRA), with a set of its
documented flags: ``default`` (what ``TrainingArguments`` gives), ``speed`` (bf16 autocast where the CPU has native
bf16 kernels, else float32 - on a CPU without them bf16 matmuls are 50-500x slower -, the fused AdamW), ``memory``
(``speed`` plus gradient checkpointing, and torchao's 8-bit AdamW for full fine-tuning: ``optim="adamw_torch_8bit"``),
``compile`` (``speed`` plus ``torch_compile=True``: the whole model through ``torch.compile``, inductor),
``bf16base`` (``speed`` with the base loaded in bf16, ``from_pretrained(dtype=torch.bfloat16)`` as Hugging Face's LoRA
guides load it; peft keeps the adapters float32, ``autocast_adapter_dtype``; the export is then a bf16 folder).
``--device cuda``: the row on the GPU (the Trainer with ``bf16=True, tf32=True``; Lightning ``accelerator="gpu"``), each
step's clock stopped after a CUDA synchronise, the GPU's peak allocated memory recorded.
``lightning``: the same model in a plain LightningModule (``labels=input_ids``, ``torch.optim.AdamW``), the way a
Lightning user writes it. Both export what a user ships: LoRA merged (``merge_and_unload``) then ``save_pretrained``.

The batches are lit_speed's: the text folder tokenised by ``lit_speed.data.text_folder`` (cached, the same token
arrays) and drawn by its DataModule after the same seeding as ``scripts/train.py`` (``seed_everything(42)``, the
model, the adapters, then the first training iterator), so every row sees the same windows in the same order; each
row prints the SHA-256 of its first batch to check it. Labels are ``input_ids`` as users pass them to a Hugging Face
model; each window carries its next token (``block + 1`` tokens), so the model's own shift gives exactly the targets
lit_speed's rows train on.

Each run writes one JSON (``--out``): seconds from launch to each phase (imports, model load, adapters, data,
training steps, export), per-step seconds and losses, tokens per step, ``ru_maxrss``, and where the step's memory
goes (``memory_breakdown.py``: weights, gradients, optimizer state, activations saved for backward).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from memory_breakdown import Breakdown  # noqa: E402

LAUNCH = time.time()

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # all-linear, no head


def since_launch() -> float:
    """Seconds since this process started, by lit_speed's clock (its rows report launch-to-end by the same one)."""
    from lit_speed.reporting.fixed_validation import process_start_time

    return time.time() - process_start_time()


def native_bf16(device: str = "cpu") -> bool:
    import torch

    from lit_speed.compat.torch import cpu_has_native_bf16

    return torch.cuda.is_bf16_supported() if device == "cuda" else cpu_has_native_bf16()


def step_done(device: str) -> float:
    """The clock at the end of a step: on a GPU once its queued kernels have run."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


def cuda_peak(record: dict[str, Any]) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        record["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()


def batches(args: argparse.Namespace, n: int) -> list[Any]:
    """The first ``n`` training batches of lit_speed's TextFolderDataModule for this folder and corpus, each window
    with its next token appended (``block + 1`` tokens: the model's own shift of ``labels`` gives lit_speed's targets;
    the extra position costs 1/block more compute and its prediction has no target)."""
    import torch

    from lit_speed.data.text_folder import TextFolderDataModule

    dm = TextFolderDataModule(args.data_root, args.model, str(ROOT / ".cache" / "text_folder"),
                              block_size=args.block, batch_size=args.micro, max_bytes=args.max_bytes)
    dm.setup()
    loader = dm.train_dataloader()
    out = []
    for x, y in loader:  # the window plus its last target: labels=input_ids then predicts exactly lit_speed's y
        out.append(torch.cat([x, y[:, -1:]], dim=1))
        if len(out) == n:
            break
    return out


def sha(window: Any) -> str:
    """The hash lit_speed's recorder prints for the same batch (its inputs: the window without its last token)."""
    return hashlib.sha256(window[:, :-1].contiguous().numpy().tobytes()).hexdigest()[:16]


def load(args: argparse.Namespace, record: dict[str, Any]) -> Any:
    import lightning.pytorch as pl
    import torch
    from transformers import AutoModelForCausalLM

    pl.seed_everything(getattr(args, "seed", 42))  # sft_peers: --seed; real_size_peers: 42
    start = time.perf_counter()
    dtype = torch.bfloat16 if getattr(args, "flags", None) == "bf16base" else torch.float32  # sft_peers: no flags
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    record["phases"]["model_load"] = time.perf_counter() - start
    start = time.perf_counter()
    if args.mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.r, lora_alpha=2 * args.r, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS))
    model.train()
    record["phases"]["model_prepare"] = time.perf_counter() - start
    record["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model


def export(model: Any, args: argparse.Namespace, record: dict[str, Any]) -> None:
    if not args.export:
        return
    start = time.perf_counter()
    out = Path(args.out).with_suffix(".export")
    if args.mode == "lora":
        model = model.merge_and_unload()
    model.save_pretrained(out)
    record["phases"]["export"] = time.perf_counter() - start


def run_trainer(args: argparse.Namespace, record: dict[str, Any]) -> None:
    import torch
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = load(args, record)
    start = time.perf_counter()
    data = batches(args, args.steps)
    record["phases"]["data"] = time.perf_counter() - start
    record["first_batch_sha"] = sha(data[0])

    class Windows(Dataset):  # the batches in order, one window per item; Trainer re-batches them unshuffled
        def __init__(self):
            self.rows = [row for b in data for row in b]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    class Steps(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, targs, state, control, **kwargs):
            record["step_s"].append(step_done(args.device) - self.start)

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                record["loss"].append(float(logs["loss"]))

    bf16 = args.flags in ("speed", "memory", "compile", "bf16base") and native_bf16(args.device)
    optim = {"default": "adamw_torch", "speed": "adamw_torch_fused", "memory": "adamw_torch_fused",
             "compile": "adamw_torch_fused", "bf16base": "adamw_torch_fused"}[args.flags]
    if args.flags == "memory" and args.mode == "full":
        optim = "adamw_torch_8bit"  # torchao's 8-bit AdamW (TrainingArguments' documented memory option)
    targs = TrainingArguments(
        output_dir=str(Path(args.out).with_suffix(".trainer")), per_device_train_batch_size=args.micro,
        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, use_cpu=args.device == "cpu", bf16=bf16,
        tf32=True if args.device == "cuda" else None, optim=optim, dataloader_num_workers=0,
        gradient_checkpointing=args.flags == "memory", torch_compile=args.flags == "compile", seed=42, data_seed=42)
    record["settings"] = {"bf16": bf16, "optim": optim, "gradient_checkpointing": targs.gradient_checkpointing,
                          "torch_compile": targs.torch_compile}

    breakdown = Breakdown()

    class Ordered(Trainer):  # lit_speed's order, not a reshuffle
        def _get_train_sampler(self, *a, **k):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, model, *a, **k):  # the forward and the loss: what they save for backward
            with breakdown.forward(model):
                return super().compute_loss(model, *a, **k)

    class Memory(TrainerCallback):
        def on_pre_optimizer_step(self, targs, state, control, **kwargs):
            breakdown.before_optimizer_step(trainer.model)

        def on_optimizer_step(self, targs, state, control, **kwargs):
            breakdown.after_optimizer_step(trainer.optimizer)

    trainer = Ordered(model=model, args=targs, train_dataset=Windows(), callbacks=[Steps(), Memory()])
    start = time.perf_counter()
    trainer.train()
    record["phases"]["training"] = time.perf_counter() - start
    record["memory_breakdown"] = breakdown.result()
    export(model, args, record)


def run_lightning(args: argparse.Namespace, record: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    import torch

    model = load(args, record)
    start = time.perf_counter()
    data = batches(args, args.steps)
    record["phases"]["data"] = time.perf_counter() - start
    record["first_batch_sha"] = sha(data[0])

    breakdown = Breakdown()

    class Plain(pl.LightningModule):
        def __init__(self, hf):
            super().__init__()
            self.hf = hf

        def training_step(self, batch, batch_idx):
            with breakdown.forward(self.hf):
                loss = self.hf(input_ids=batch, labels=batch).loss
            record["loss"].append(float(loss.detach()))
            return loss

        def on_train_batch_start(self, batch, batch_idx):
            self._t = time.perf_counter()

        def on_before_optimizer_step(self, optimizer):
            breakdown.before_optimizer_step(self.hf)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            record["step_s"].append(step_done(args.device) - self._t)
            breakdown.after_optimizer_step(self.trainer.optimizers[0])

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=args.lr,
                                     betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)

    precision = "bf16-mixed" if args.flags in ("speed", "memory") and native_bf16(args.device) else "32-true"
    record["settings"] = {"precision": precision}
    trainer = pl.Trainer(accelerator="gpu" if args.device == "cuda" else "cpu", devices=1, max_steps=args.steps,
                         precision=precision, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, gradient_clip_val=1.0)  # the Trainer's max_grad_norm default
    start = time.perf_counter()
    trainer.fit(Plain(model), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    record["phases"]["training"] = time.perf_counter() - start
    record["memory_breakdown"] = breakdown.result()
    export(model, args, record)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tool", choices=["trainer", "lightning"])
    parser.add_argument("--model", required=True, help="a model folder (benchmarks/model_folders.py)")
    parser.add_argument("--data-root", required=True, help="a folder of text files")
    parser.add_argument("--mode", choices=["lora", "full"], default="lora")
    parser.add_argument("--flags", choices=["default", "speed", "memory", "compile", "bf16base"], default="speed")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-bytes", type=int, default=4_000_000)
    parser.add_argument("--export", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    record: dict[str, Any] = {"tool": args.tool, "mode": args.mode, "flags": args.flags, "phases": {},
                              "step_s": [], "loss": [], "tokens_per_step": args.micro * args.block}
    record["phases"]["startup"] = since_launch()
    {"trainer": run_trainer, "lightning": run_lightning}[args.tool](args, record)
    record["launch_to_end_s"] = since_launch()
    cuda_peak(record)
    record["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
