"""TRL's ``SFTTrainer`` on the same model folder, JSONL, LoRA adapters and steps as a lit_speed ``data=sft`` row.

    python benchmarks/sft_peers.py --model <folder> --data <examples.jsonl> --out row.json [--packing] [--padding-free]

What a TRL user writes: ``SFTConfig`` + ``SFTTrainer(model=<peft model>, train_dataset=load_dataset("json", ...))``.
The adapters are made the way lit_speed's ``PEFTAdapters`` makes them (``seed_everything(42)``, the float32 model, then
``peft``'s LoRA on every linear layer but the head), so both runs start from the same adapter values; ``--order
sequential`` trains the examples in the file's order (lit_speed: ``data.shuffle=false``), to compare the losses step by
step. ``--chat-template`` gives TRL a template with ``{% generation %}`` markers for ``assistant_only_loss`` on
``messages`` data (TRL needs them to mask the prompts of a conversation). Loss per step, per-step seconds, the tokens
each step computed (``attention_mask`` or packed positions) and trained (``labels != -100`` after the shift), the
phases from launch, and ``ru_maxrss`` go to ``--out``; the merged model is exported as a user ships it.
"""
from __future__ import annotations

import argparse
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
from real_size_peers import load, native_bf16, since_launch  # noqa: E402


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    args.mode = "lora"
    model = load(args, record)  # seed_everything(42), the float32 model, peft's LoRA on every linear but the head
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.chat_template:  # TRL reads the markers off the tokenizer's own template (SFTTrainer.__init__)
        tokenizer.chat_template = Path(args.chat_template).read_text()
    start = time.perf_counter()
    data = datasets.load_dataset("json", data_files=args.data, split="train")
    record["phases"]["data_load"] = time.perf_counter() - start

    bf16 = args.precision == "bf16" and native_bf16()
    config = SFTConfig(
        output_dir=str(Path(args.out).with_suffix(".trl")), per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8, max_grad_norm=args.clip,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
        bf16=bf16, optim="adamw_torch_fused", dataloader_num_workers=0, seed=args.seed, data_seed=args.seed,
        max_length=args.max_length, packing=args.packing, padding_free=args.padding_free,
        assistant_only_loss=args.chat_template is not None,
        train_sampling_strategy=args.order, dataset_num_proc=None, shuffle_dataset=False)
    record["settings"] = {"bf16": bf16, "packing": args.packing, "padding_free": args.padding_free,
                          "assistant_only_loss": config.assistant_only_loss, "order": args.order}

    class Steps(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, targs, state, control, **kwargs):
            record["step_s"].append(time.perf_counter() - self.start)

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                record["loss"].append(float(logs["loss"]))

    class Counted(SFTTrainer):  # what each step computed and trained, read off the batch it got
        def training_step(self, model, inputs, *a, **k):
            labels = inputs["labels"]
            if "attention_mask" in inputs:
                computed, real = labels.numel(), int(inputs["attention_mask"].sum())
            else:  # padding-free or packed: one row of real positions (padded to the batch's longest row)
                computed, real = labels.numel(), labels.numel()
            record["positions"].append(computed)
            record["real_positions"].append(real)
            record["trained"].append(int((labels[:, 1:] != -100).sum()))
            return super().training_step(model, inputs, *a, **k)

    start = time.perf_counter()
    trainer = Counted(model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[Steps()])
    record["phases"]["data_prepare"] = time.perf_counter() - start
    start = time.perf_counter()
    trainer.train()
    record["phases"]["training"] = time.perf_counter() - start
    if args.export:
        start = time.perf_counter()
        merged = trainer.model.merge_and_unload()
        merged.save_pretrained(Path(args.out).with_suffix(".export"))
        tokenizer.save_pretrained(Path(args.out).with_suffix(".export"))
        record["phases"]["export"] = time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model folder (benchmarks/model_folders.py)")
    parser.add_argument("--data", required=True, help="a JSONL of examples")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--clip", type=float, default=0.0, help="max_grad_norm (0: none)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--padding-free", action="store_true")
    parser.add_argument("--order", choices=["sequential", "random", "group_by_length"], default="random")
    parser.add_argument("--chat-template", default=None, help="a .jinja with {%% generation %%} markers")
    parser.add_argument("--seed", type=int, default=42, help="the adapters' initialisation and the data order")
    parser.add_argument("--export", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    record: dict[str, Any] = {"tool": "trl", "phases": {}, "step_s": [], "loss": [], "positions": [],
                              "real_positions": [], "trained": []}
    record["phases"]["startup"] = since_launch()
    run(args, record)
    record["launch_to_end_s"] = since_launch()
    record["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
