"""``ModelCheckpoint`` whose ``last.ckpt`` is always the newest state, not the newest *best* one.

Lightning 2.6 writes ``last.ckpt`` only when a top-k checkpoint is written at the same step ("Only save last
checkpoint if a checkpoint was actually saved in this step"), and at the end of fit only when no ``last.ckpt`` was
ever written. With ``monitor=val/acc, save_top_k=1`` a run's ``last.ckpt`` is therefore its last *improvement*:
measured on the digits default run, ``last.ckpt`` was step 414 of 460, so ``ckpt_path=last`` re-trained 46 steps
and a finished run's ``last.ckpt`` was not its final model (weights 0.0203 off). :class:`BestAndLastCheckpoint`
keeps Lightning's top-k logic unchanged and writes ``last.ckpt`` at every point where a checkpoint is due (each
validation, or epoch end, or ``every_n_train_steps``) and once more at the end of fit if the last one is older.
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lit_speed.compat import lightning as pl_compat


class BestAndLastCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same arguments), with ``save_last=True`` meaning the newest state.

    Top-k checkpoints (``monitor``, ``save_top_k``, ``filename``) are Lightning's own. ``last.ckpt`` is written
    at every checkpoint point whether or not the monitored metric improved, and at the end of fit when the
    final step is newer than the last ``last.ckpt``: ``ckpt_path=last`` loses at most the steps since the last
    checkpoint point, and a finished run's ``last.ckpt`` holds its final weights.

    Example::

        trainer = Trainer(callbacks=[BestAndLastCheckpoint(dirpath="ckpts", monitor="val/loss", save_last=True)])
    """

    _built_with: tuple[str | None, str] | None = None  # (monitor, mode) before follow_monitor changed them

    def follow_monitor(self, monitor: str, mode: str) -> None:
        """Keep the best checkpoint by ``monitor`` from now on (chosen at the first validation), unless one was named.

        Raises:
            ValueError: If ``mode`` is not ``"min"`` or ``"max"``.
        """
        if self.monitor is not None:
            return
        if mode not in ("min", "max"):
            raise ValueError(f"BestAndLastCheckpoint.follow_monitor(mode={mode!r}): mode must be 'min' or 'max'")
        self._built_with = (self.monitor, self.mode)
        self.monitor, self.mode = monitor, mode
        if not self.best_k_models:  # as ModelCheckpoint sets it; a resumed run keeps the checkpoint's
            self.kth_value = torch.tensor(torch.inf if mode == "min" else -torch.inf)

    @property
    @override
    def state_key(self) -> str:
        # Lightning keys a callback's checkpoint state by its monitor and mode: a callback that took its monitor after
        # construction keeps the key it was built with, so a resumed run (built with monitor=None again) finds it
        if self._built_with is None:
            return super().state_key
        followed, (self.monitor, self.mode) = (self.monitor, self.mode), self._built_with
        try:
            return super().state_key
        finally:
            self.monitor, self.mode = followed

    def _save_last_if_due(self, trainer: "pl.Trainer", hook: str) -> None:
        """Write ``last.ckpt`` when a checkpoint is due here and the newest file is older than this step."""
        if self.save_last and trainer.global_step > 0 and pl_compat.checkpoint_due(self, trainer, hook) \
                and pl_compat.step_last_saved(self) != trainer.global_step:
            pl_compat.save_last_checkpoint(self, trainer)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._save_last_if_due(trainer, "on_train_batch_end")

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self._save_last_if_due(trainer, "on_train_epoch_end")

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_validation_end(trainer, pl_module)
        self._save_last_if_due(trainer, "on_validation_end")

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_end(trainer, pl_module)
        self._save_last_if_due(trainer, "on_train_end")
