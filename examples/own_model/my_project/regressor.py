"""A residual MLP regressor: a plain LightningModule, written the way a Lightning user writes one.

Nothing here imports lit_speed. The two class attributes marked *optional* are read by lit_speed's pre-flight if
present (``lit_speed.run_contract``); without them the run is the same, only the data/model pairing is not checked.
"""
from __future__ import annotations

from typing import Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class ResidualMLPRegressor(pl.LightningModule):
    """``in_features -> width -> depth x (LayerNorm, Linear, GELU, Linear) + skip -> 1``, trained on mean squared error.

    Args:
        in_features: Input features per sample.
        width: Hidden width.
        depth: Residual blocks.
        optimizer: Factory ``params -> Optimizer`` (a Hydra ``_partial_``, e.g. lit_speed's ``optimizer=`` group);
            ``None`` = AdamW at 1e-3.
    """

    accepted_batch_kinds = ("features->value",)  # optional: lets lit_speed refuse data= that does not fit

    def __init__(self, in_features: int = 32, width: int = 256, depth: int = 3,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer"])
        self.inp = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.optimizer_factory = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h).squeeze(-1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x).float(), y.float())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val/mse", F.mse_loss(self(x).float(), y.float()), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_factory is None:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return self.optimizer_factory(self.parameters())
