"""fp32 master weights for a bf16 model: the functional core of ``precision=bf16-master``.

The module's parameters are bf16, so every op runs in bf16 with no per-op autocast casts; the optimizer
sees float32 copies ("masters") instead of the module's parameters:

- after each backward, a post-accumulate-grad hook adds the bf16 gradient into the master's float32
  ``.grad`` and frees the bf16 one (gradient accumulation sums in float32; clipping, the non-finite
  guard and the optimizer all see float32 gradients, and the optimizer keeps float32 state);
- after each optimizer step, :meth:`MasterWeights.copy_to_model` rounds the masters into the bf16
  parameters;
- ``module.state_dict()`` returns the float32 masters (a checkpoint holds full-precision weights and a
  resume is bitwise exact), and ``module.load_state_dict()`` refreshes them.

Works the same on CPU and CUDA (only ``torch`` tensor APIs). Usable without Lightning::

    masters = MasterWeights(model)          # model becomes bf16
    opt = torch.optim.AdamW(masters.parameters(), lr=1e-3)   # or masters.attach([opt]) on an existing one
    loss(model(x)).backward(); opt.step(); opt.zero_grad(); masters.copy_to_model()
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from lit_speed.compat import torch as torch_compat


class MasterWeights:
    """Keeps float32 masters of ``module``'s floating parameters and casts the module to ``dtype``.

    Args:
        module: The model; its floating parameters are cast to ``dtype`` in place (buffers too).
        dtype: The compute dtype (``torch.bfloat16``).
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        self.module = module
        self.dtype = dtype
        params = [p for p in module.parameters() if p.is_floating_point()]  # tied weights appear once
        self.masters: dict[nn.Parameter, nn.Parameter] = {}
        for p in params:
            master = nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad)
            self.masters[p] = master
        module.to(dtype)  # in place: the same Parameter objects, now bf16
        self._by_master = {id(m): p for p, m in self.masters.items()}
        self._handles = [p.register_post_accumulate_grad_hook(self._move_grad) for p in params if p.requires_grad]
        # plain functions: torch marks public-API hooks with an attribute, which a bound method cannot carry
        self._handles.append(module.register_state_dict_post_hook(lambda *a: self._state_dict_hook(*a)))
        self._handles.append(module.register_load_state_dict_pre_hook(lambda *a: self._load_state_dict_hook(*a)))

    def parameters(self) -> Iterator[nn.Parameter]:
        """The float32 masters, in the module's parameter order (give these to the optimizer)."""
        return iter(self.masters.values())

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        return self.masters.get(param, param)  # type: ignore[call-overload]

    def attach(self, optimizers: list[torch.optim.Optimizer]) -> dict[int, str]:
        """Point the optimizers' param groups at the masters (before they have state); ``{id(master): name}``."""
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [self.master_of(p) for p in group["params"]]
        return {id(self.master_of(p)): n for n, p in self.module.named_parameters()}

    def _move_grad(self, param: torch.Tensor) -> None:
        master = self.masters[param]  # type: ignore[index]
        grad = param.grad.float()
        if master.grad is None:
            master.grad = grad
        else:
            master.grad.add_(grad)
        param.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the module's bf16 parameters (after each optimizer step)."""
        params = list(self.masters)
        torch_compat.foreach_copy_(params, [self.masters[p] for p in params])

    # ---- checkpoints: the state dict holds the masters -------------------------------------------------

    def _names(self) -> dict[str, nn.Parameter]:
        return dict(self.module.named_parameters(remove_duplicate=False))

    def _state_dict_hook(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
        for name, p in self._names().items():
            key = prefix + name
            if key in state_dict and p in self.masters:
                state_dict[key] = self.masters[p].detach()

    @torch.no_grad()
    def _load_state_dict_hook(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, p in self._names().items():
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and p in self.masters:
                self.masters[p].copy_(value)

    # ---- leaving: back to a float32 module -------------------------------------------------------------

    @torch.no_grad()
    def release(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Make the module float32 again with the masters' values, and the optimizers step it directly.

        Used when a run falls back to ``32-true``: the optimizer state moves to the module's parameters,
        so nothing of the float32 trajectory is lost.
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for p, master in self.masters.items():
            p.data = master.data  # the float32 values, shared storage
            p.grad = None if master.grad is None else master.grad
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [self._by_master.get(id(q), q) for q in group["params"]]
            for master_id, p in self._by_master.items():
                for key in list(optimizer.state):
                    if id(key) == master_id:
                        optimizer.state[p] = optimizer.state.pop(key)
        for buffer in self.module.buffers():
            if buffer.is_floating_point():
                buffer.data = buffer.data.float()
        self.masters = {}
        self._by_master = {}
