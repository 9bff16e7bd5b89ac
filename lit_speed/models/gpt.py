"""A small decoder-only transformer (nanoGPT-like) for character-level language modelling."""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lit_speed.models.next_token import NextTokenSteps
from lit_speed.run_contract import TokenLimits


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: the unit that activation checkpointing and regional compile wrap."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm, tied LM head."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float = 0.0, bias: bool = False) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"GPT(n_embd={n_embd}): n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2 scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The final hidden states (after ``ln_f``): what the LM head turns into logits."""
        t = idx.size(1)
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds the model's block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(idx))


class GPTModule(NextTokenSteps, pl.LightningModule):
    """Character-level GPT as a LightningModule.

    Args:
        vocab_size: Token vocabulary (97 for the charlm corpus).
        block_size: Maximum context length.
        n_layer: Transformer blocks.
        n_head: Attention heads.
        n_embd: Embedding width.
        dropout: Dropout on embeddings, attention and MLP outputs.
        bias: Bias in Linear and LayerNorm layers.
        optimizer: Factory ``params -> Optimizer`` (a Hydra ``_partial_``).
        scheduler: Optional factory ``(optimizer, total_steps) -> LRScheduler``.
        weight_decay: Weight decay on matrices and embeddings only.
        loss_chunk_mib: Run the LM head and the loss in chunks of at most this many MiB of logits
            (``lit_speed.chunked_lm_loss``); ``None``: the plain loss. ``lit_speed.ChunkedLMLoss`` sets it too.
    """

    accepted_batch_kinds = ("tokens->next-token",)  # lit_speed.run_contract.BatchConsumer

    def __init__(self, vocab_size: int = 97, block_size: int = 64, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0, bias: bool = False,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 scheduler: Callable[..., Any] | None = None, weight_decay: float = 0.1,
                 loss_chunk_mib: float | None = None) -> None:
        super().__init__()
        if min(n_layer, n_head, n_embd, block_size) < 1:
            sizes = {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, "block_size": block_size}
            bad = next(name for name, size in sizes.items() if size < 1)
            raise ValueError(f"GPTModule({bad}={sizes[bad]}): n_layer, n_head, n_embd and block_size must be >= 1, "
                             f"got n_layer={n_layer}, n_head={n_head}, n_embd={n_embd}, block_size={block_size}. "
                             f"Fix: {bad}=<an int >= 1>, e.g. n_layer=4")
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.model = GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        if loss_chunk_mib is not None:
            self.use_chunked_loss(int(float(loss_chunk_mib) * 2**20))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def head_inputs(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        head = self.model.lm_head
        scale = getattr(head, "held_weight_scale", None)  # an int8-held head (peft.base_dtype=int8)
        return self.model.hidden(idx), head.weight, head.bias, {} if scale is None else {"weight_scale": scale}

    @classmethod
    def input_limits(cls, config: Mapping[str, Any]) -> TokenLimits:
        """Embedding rows and learned positions from the constructor arguments (``lit_speed.run_contract.TokenModel``)."""
        vocab, block = int(config.get("vocab_size", 97)), int(config.get("block_size", 64))
        return TokenLimits(vocab, block, f"vocab_size={vocab}", "learned", "GPT", f"block_size={block}")
