"""``optimizer=muon``: ``torch.optim.Muon`` on 2-D hidden weight matrices, AdamW on everything else.

Muon orthogonalises each matrix's momentum (Newton-Schulz) before the update, which suits the hidden
Linear layers of a transformer; embeddings, the output head, norms and biases are not matrices of that
kind and keep AdamW (the split of the GPT-2 speedruns). :func:`split_for_muon` is the plain rule;
:class:`MuonAdamW` is one ``torch.optim.Optimizer`` over both halves, so Lightning's automatic optimisation,
LR schedulers (each group keeps its own peak LR), clipping and checkpoints see a single optimizer.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import AdamW, Optimizer

from lit_speed.optim.batched_muon import NS_DTYPE_CHOICES, BatchedMuon
from lit_speed.optim.kernel_choice import ADAMW_KERNELS, adamw_flags, choose_adamw_kernel
from lit_speed.optim.state_cost import whole_tensor_bytes
from lit_speed.tuning.measured_choice import on_rank_zero

#: Parameter names (substrings) that always go to AdamW: embeddings and the output head.
DEFAULT_ADAMW_NAMES = ("wte", "wpe", "emb", "lm_head", "head")


def split_for_muon(names: Sequence[str], params: Sequence[torch.Tensor],
                   adamw_names: Sequence[str] = DEFAULT_ADAMW_NAMES) -> tuple[list[int], list[int]]:
    """Indices of the parameters Muon takes (2-D, not an embedding/head by name) and of those AdamW takes."""
    muon, adamw = [], []
    for i, (name, p) in enumerate(zip(names, params)):
        hidden_matrix = p.dim() == 2 and not any(key in name for key in adamw_names)
        (muon if hidden_matrix else adamw).append(i)
    return muon, adamw


class MuonAdamW(Optimizer):
    """Muon for hidden matrices, AdamW for the rest, as one optimizer.

    Args:
        params: Parameter groups with a ``param_names`` list each (``lit_speed.models.configure_optimizers`` passes
            them when the optimizer sets ``wants_param_names``), or ``(name, tensor)`` pairs.
        lr: Muon's peak LR.
        adamw_lr: AdamW's peak LR (embeddings, head, norms, biases).
        momentum, nesterov, ns_steps, adjust_lr_fn: ``torch.optim.Muon`` settings (the update runs as
            :class:`~lit_speed.optim.batched_muon.BatchedMuon`: torch's math, batched over same-shape matrices).
        ns_dtype: Newton-Schulz dtype: ``"bfloat16"`` (torch's), ``"float32"``, or ``"auto"`` (timed here).
        adamw_kernel: AdamW's kernel: ``"fused"``, ``"foreach"``, ``"for-loop"``, ``None`` (torch's default), or
            ``"auto"`` (timed here on the AdamW half's own parameter shapes before the first step, cached per
            machine). Both choices are kept in the param groups: checkpoints carry them, a resume does not time.
        betas, eps: AdamW settings.
        weight_decay: Used where a group does not set its own.
        adamw_names: Name substrings that always go to AdamW.

    Raises:
        ValueError: A parameter without a name, or no parameter for Muon.

    Example::

        opt = MuonAdamW(model.named_parameters(), lr=0.02, adamw_lr=3e-3)
    """

    wants_param_names = True
    #: why ZeRO cannot step it (``lit_speed.check_zero_optimizer`` refuses it with this, under any DeepSpeed strategy)
    zero_refusal = ("ZeRO flattens parameters into 1-D partitions (and offload steps on the CPU with its own Adam), "
                    "so Muon's 2-D matrices do not exist there")

    def state_bytes_per_param(self, dtype: torch.dtype | None = None) -> float:
        """One momentum buffer per Muon matrix element, two AdamW moments per other element, each like its
        parameter (the :class:`~lit_speed.interfaces.OptimizerStateCost` the memory planner asks)."""
        return whole_tensor_bytes([(self.muon.param_groups, 1), (self.adamw.param_groups if self.adamw else [], 2)],
                                  dtype)

    def __init__(self, params: Iterable[Any], lr: float = 0.02, adamw_lr: float = 3e-3, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 ns_dtype: str = "bfloat16", adamw_kernel: str | None = None,
                 betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-8, weight_decay: float = 0.0,
                 adamw_names: Sequence[str] = DEFAULT_ADAMW_NAMES) -> None:
        if ns_dtype not in NS_DTYPE_CHOICES:
            raise ValueError(f"MuonAdamW(ns_dtype={ns_dtype!r}): ns_dtype must be one of {NS_DTYPE_CHOICES}, "
                             f"got {ns_dtype!r}")
        if adamw_kernel not in (None, *ADAMW_KERNELS, "auto"):
            raise ValueError(f"MuonAdamW(adamw_kernel={adamw_kernel!r}): adamw_kernel must be one of "
                             f"{(*ADAMW_KERNELS, 'auto')} or null (torch's choice), got {adamw_kernel!r}")
        groups = _as_named_groups(params, weight_decay)
        muon_groups, adamw_groups = [], []
        for group in groups:
            muon_idx, adamw_idx = split_for_muon(group["param_names"], group["params"], adamw_names)
            rest = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            for idx, out in ((muon_idx, muon_groups), (adamw_idx, adamw_groups)):
                if idx:
                    out.append({**rest, "params": [group["params"][i] for i in idx],
                                "param_names": [group["param_names"][i] for i in idx]})
        if not muon_groups:
            raise ValueError("MuonAdamW found no 2-D hidden weight matrix for Muon (all parameters are "
                             "embeddings, head, norms or biases). Fix: AdamW for this model, or adjust "
                             "adamw_names.")
        self.muon = BatchedMuon(muon_groups, lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                adjust_lr_fn=adjust_lr_fn, weight_decay=weight_decay, ns_dtype=ns_dtype)
        flags = adamw_flags(adamw_kernel) if adamw_kernel in ADAMW_KERNELS else {}
        self.adamw = AdamW(adamw_groups, lr=adamw_lr, betas=betas, eps=eps, weight_decay=weight_decay, **flags) \
            if adamw_groups else None
        for group in self.adamw.param_groups if self.adamw is not None else []:
            group["kernel"] = adamw_kernel
        self.adamw_decision: Any = None  # the Decision of adamw_kernel="auto", once made in this process
        self._n_muon = len(self.muon.param_groups)
        all_groups = self.muon.param_groups + (self.adamw.param_groups if self.adamw else [])
        super().__init__(all_groups, {})  # the very same group dicts: an LR scheduler reaches both halves
        self._share_state()

    def _share_state(self) -> None:
        self.muon.state = self.state  # disjoint parameters: one state dict saves and restores both halves
        self.muon.param_groups = self.param_groups[:self._n_muon]
        if self.adamw is not None:
            self.adamw.state = self.state
            self.adamw.param_groups = self.param_groups[self._n_muon:]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        if self.adamw is not None:
            self.resolve_adamw_kernel()
            self.adamw.step()
        return loss

    def final_summary(self) -> dict[str, Any]:
        """The kernels in use, and how they were chosen (for ``summary.json``)."""
        return {"ns_dtype": self.muon.param_groups[0].get("ns_dtype"),
                "ns_dtype_decision": self.muon.ns_decision.line() if self.muon.ns_decision else None,
                "adamw_kernel": self.adamw.param_groups[0].get("kernel") if self.adamw is not None else None,
                "adamw_kernel_decision": self.adamw_decision.line() if self.adamw_decision else None}

    def resolve_adamw_kernel(self) -> None:
        """Decide ``adamw_kernel="auto"`` now (see the class docstring); nothing once every group has a kernel."""
        groups = [g for g in (self.adamw.param_groups if self.adamw is not None else []) if g.get("kernel") == "auto"]
        if not groups:
            return
        params = [p for g in groups for p in g["params"]]
        self.adamw_decision = on_rank_zero(lambda: choose_adamw_kernel(params))
        for g in groups:
            g.update(adamw_flags(self.adamw_decision.chosen), kernel=self.adamw_decision.chosen)
        rank_zero_info(f"MuonAdamW: {self.adamw_decision.line()}")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share_state()


def _as_named_groups(params: Iterable[Any], weight_decay: float) -> list[dict[str, Any]]:
    items = list(params)
    if items and isinstance(items[0], tuple):
        return [{"params": [p for _, p in items], "param_names": [n for n, _ in items], "weight_decay": weight_decay}]
    groups = [dict(g) for g in items]
    for g in groups:
        if "param_names" not in g or len(g["param_names"]) != len(g["params"]):
            raise ValueError("MuonAdamW needs parameter names to tell hidden matrices from embeddings and the "
                             "head. Fix: pass model.named_parameters(), or groups with a 'param_names' list.")
        g["params"] = list(g["params"])
    return groups
