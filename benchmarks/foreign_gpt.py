"""A user's own GPT LightningModule (not ``lit_speed.models``), trained plainly or with lit_speed's levers plugged in.

The model is written here the way a user writes one (nanoGPT's layout: fused qkv, GELU MLP, pre-norm, tied head;
the same size as the charlm preset's: 4 layers, 4 heads, 128 wide, block 64). :func:`plain_parts` is the plain
Lightning recipe (AdamW 1e-3 constant, fp32); :func:`lit_speed_parts` adds the levers of ``experiment=charlm_fast``
the way a user copies them into their own project, every value read from the preset's YAML:

- ``plugins=[GuardedPrecision("auto", threads="auto", attention="auto")]``: the precision mode, the thread count
  and the attention kernel timed on this model's first batch;
- ``callbacks=[AccumulationScheduler(effective_batch=..., ramp="step", lr_scaling="none")]``: the batch ramp;
- ``MuonAdamW(self.named_parameters(), ..., ns_dtype="auto", adamw_kernel="auto")`` and ``warmup_stable_decay``
  in ``configure_optimizers``.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        return self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))


class Layer(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = SelfAttention(width, heads)
        self.c_fc, self.c_out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.c_out(F.gelu(self.c_fc(self.norm2(x))))


class UserGPT(pl.LightningModule):
    """The user's model. ``make_optimizer(module)`` returns what ``configure_optimizers`` returns."""

    def __init__(self, vocab: int, block: int, make_optimizer: Callable[["UserGPT"], Any], layers: int = 4,
                 heads: int = 4, width: int = 128) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.layers = nn.ModuleList(Layer(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied, as in GPT-2
        self.make_optimizer = make_optimizer
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") or name.endswith("c_out.weight") \
                    else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.size(1), device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))  # the mean over the micro-batch

    def configure_optimizers(self) -> Any:
        return self.make_optimizer(self)


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's split: matrices and embeddings decay, biases and norms do not (with names, for Muon)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return [{"params": [p for _, p in named if p.dim() >= 2], "param_names": [n for n, p in named if p.dim() >= 2],
             "weight_decay": weight_decay},
            {"params": [p for _, p in named if p.dim() < 2], "param_names": [n for n, p in named if p.dim() < 2],
             "weight_decay": 0.0}]


def plain_parts(lr: float = 1e-3) -> tuple[Callable[[UserGPT], Any], list[Any], list[Any]]:
    """The plain recipe: ``(make_optimizer, plugins, callbacks)`` with AdamW at a constant LR, fp32."""
    def make_optimizer(module: UserGPT) -> Any:
        groups = [{k: v for k, v in g.items() if k != "param_names"} for g in decay_groups(module, 0.1)]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))
    return make_optimizer, [], []


def lit_speed_parts(recipe: dict[str, Any]) -> tuple[Callable[[UserGPT], Any], list[Any], list[Any]]:
    """The preset's levers plugged into the user's module: ``(make_optimizer, plugins, callbacks)``.

    ``recipe`` is :func:`preset_levers` (the preset's own values).
    """
    from lit_speed import AccumulationScheduler, GuardedPrecision
    from lit_speed.optim.muon import MuonAdamW
    from lit_speed.optim.schedules import warmup_stable_decay

    opt = recipe["optimizer"]

    def make_optimizer(module: UserGPT) -> Any:
        optimizer = MuonAdamW(decay_groups(module, recipe["weight_decay"]), **opt)
        schedule = warmup_stable_decay(optimizer, total_steps=recipe["max_steps"], **recipe["scheduler"])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    plugins = [GuardedPrecision(recipe["precision"], threads=recipe["threads"], attention=recipe["attention"])]
    callbacks = [AccumulationScheduler(effective_batch=recipe["effective_batch"], ramp=recipe["ramp"],
                                       lr_scaling=recipe["lr_scaling"])]
    return make_optimizer, plugins, callbacks


def preset_levers(root: str) -> dict[str, Any]:
    """The values of ``experiment=charlm_fast`` a user copies (read from its YAML, so they cannot drift)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=f"{root}/conf", version_base="1.3"):
        cfg = compose("train", overrides=["experiment=charlm_fast"])
    c = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("optimizer", "model", "precision", "data",
                                                                     "accumulation")}
    c["trainer"] = {"max_steps": cfg.trainer.max_steps}
    opt = {k: v for k, v in c["optimizer"].items() if not k.startswith("_") and k != "weight_decay"}
    opt["betas"] = tuple(opt["betas"])
    return {"optimizer": opt, "weight_decay": c["model"]["weight_decay"],
            "scheduler": {k: v for k, v in c["model"]["scheduler"].items() if not k.startswith("_")},
            "precision": c["precision"]["mode"], "threads": c["precision"]["threads"],
            "attention": c["precision"]["attention"], "batch_size": c["data"]["batch_size"],
            "effective_batch": {int(k): int(v) for k, v in c["accumulation"]["effective_batch"]},
            "ramp": c["accumulation"]["ramp"], "lr_scaling": c["accumulation"]["lr_scaling"],
            "max_steps": c["trainer"]["max_steps"]}
