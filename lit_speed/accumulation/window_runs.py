"""How :class:`~lit_speed.accumulation.accumulation_scheduler.AccumulationScheduler` runs one dataloader batch: as
``pieces`` micro-batches, each weighted by its item count, and, on out-of-memory, the whole window again with
micro-batches half the size (the gradients of the failed window are discarded first). A mixin: the window's state
(position, factor, pieces, counts) is the scheduler's."""
from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch.utilities import rank_zero_info

from lit_speed.accumulation.window import batch_samples, count_items, count_tokens, split_batch
from lit_speed.oom import is_oom_error


class WindowRuns:
    """``run_batch`` (called through Lightning's automatic optimization loop) and the out-of-memory retry."""

    def run_batch(self, run: Callable[..., Any], optimizer: Any, batch_idx: int, kwargs: Any) -> Any:
        """Run one dataloader batch as ``pieces`` micro-batches; on OOM, retry the window with smaller ones."""
        batch = kwargs["batch"]
        try:
            return self._run_pieces(run, optimizer, batch_idx, kwargs, batch, self._epoch_end)
        except RuntimeError as error:  # torch.OutOfMemoryError is a RuntimeError
            if not (self.oom_recovery and is_oom_error(error)):
                raise
            return self._retry_window(run, optimizer, batch_idx, kwargs, batch, self._epoch_end, error)

    def _run_pieces(self, run: Callable[..., Any], optimizer: Any, batch_idx: int, kwargs: Any, batch: Any,
                    epoch_end: bool) -> Any:
        trainer = self._trainer
        last_batch = self._pos + 1 == self._factor or epoch_end
        output = None
        for j, piece in enumerate(split_batch(batch, self._pieces)):
            self.zero_now = self._pos == 0 and j == 0
            self.step_now = last_batch and j == self._pieces - 1
            items = count_items(piece, self.normalize, self.ignore_index)
            # Lightning divides the loss by accumulate_grad_batches; undo it and weight by the item count.
            # A window of one micro-batch on one process needs neither: weight and scale would cancel.
            self._weight = 1.0 if self._one_micro_batch(trainer) else float(items * trainer.accumulate_grad_batches)
            # counted before the run: the window's last run reaches on_before_optimizer_step
            self._window[0] += items
            self._window[1] += batch_samples(piece)
            self._window[2] += count_tokens(piece, self.ignore_index)
            kwargs["batch"] = piece
            output = run(optimizer, batch_idx, kwargs)
        kwargs["batch"] = batch
        if self.oom_recovery:
            self._window_batches.append(batch)
        if self.step_now:
            self._pos, self._window, self._window_batches = 0, [0, 0, 0], []
        else:
            self._pos += 1
        return output

    def _retry_window(self, run: Callable[..., Any], optimizer: Any, batch_idx: int, kwargs: Any, batch: Any,
                      epoch_end: bool, error: BaseException) -> Any:
        batches = self._window_batches + [batch]
        while True:
            micro = self._micro()
            if micro is None or micro < 2:
                raise RuntimeError(f"out of memory at micro-batch {micro}; nothing left to halve") from error
            self._oom_count += 1
            self._pieces *= 2
            rank_zero_info(f"accumulation: out of memory at micro-batch {micro}; retrying the window with "
                           f"micro-batch {self._micro()} x {self.current_factor}")
            optimizer.zero_grad(set_to_none=True)  # discard the partial window
            self._pos, self._window, self._window_batches = 0, [0, 0, 0], []
            self._trainer.accumulate_grad_batches = self.current_factor
            try:
                output = None
                for i, cached in enumerate(batches):
                    last = epoch_end and i == len(batches) - 1
                    output = self._run_pieces(run, optimizer, batch_idx, kwargs, cached, last)
                return output
            except RuntimeError as again:
                if not is_oom_error(again):
                    raise
                error = again
