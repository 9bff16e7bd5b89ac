"""AdamW with 8-bit or 4-bit optimizer states (torchao's), declaring its bytes and resuming bitwise under Lightning.

Full fine-tuning in float32 keeps 16 bytes per parameter before activations: the weight, its gradient and AdamW's two
float32 moments. :class:`AdamW8bit` keeps the moments as 8-bit codes with one float32 scale per block of 256 values
(Dettmers et al. 2021, https://arxiv.org/abs/2110.02861): ~2.03 bytes per parameter instead of 8; :class:`AdamW4bit`
as 4-bit codes with a scale per 128 (Li et al. 2023, https://arxiv.org/abs/2309.01507): ~1.06. The math and the
kernels are torchao's (``torchao.optim.AdamW8bit`` / ``AdamW4bit``, the ones ``transformers``' ``adamw_torch_8bit`` /
``adamw_torch_4bit`` use): each step dequantises a block, updates in float32 and re-quantises, in one kernel per
parameter shape that ``torch.compile`` builds on the first step (inductor's C++ on a CPU: seconds to a minute, then
cached on disk).

What this module adds to torchao's classes, for a Lightning run:

* :meth:`state_bytes_per_param`: the bytes the state really takes (the :class:`~lit_speed.interfaces.OptimizerStateCost`
  the planner asks), including the block scales, the lookup tables and torchao's small-tensor rule: a parameter with
  fewer than 4096 elements, or whose size is not a multiple of the block, keeps whole moments like itself.
* A checkpoint in plain tensors: :meth:`state_dict` writes each quantised moment as ``{"codes", "scale", "qmap",
  "bits", "signed"}``, so a Lightning checkpoint or ``torch.save`` loads with ``weights_only=True`` without torchao
  imported, and :meth:`load_state_dict` rebuilds the very same codes (bitwise resume) or refuses a state written by
  another optimizer, bit width or block size, naming the fix.
* ``zero_refusal``: ``ZeroStrategy`` refuses these optimizers (DeepSpeed ZeRO steps flat float32 partitions and
  restores their state by element copies).
"""
from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch


@contextmanager
def _quiet(loggers: Iterable[str]) -> Iterator[None]:
    """Raise ``loggers`` to ERROR for the block: torchao's import reports every CUDA-only library it cannot load."""
    saved = {name: logging.getLogger(name).level for name in loggers}
    for name in saved:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


try:
    with _quiet(["torchao", "torch.utils._pytree"]):
        import torchao.optim as ao
        from torchao.optim.subclass_4bit import OptimState4bit
        from torchao.optim.subclass_8bit import OptimState8bit
except ModuleNotFoundError as error:  # pragma: no cover - the finetune extra installs it
    raise ModuleNotFoundError(f"lit_speed.optim.low_bit needs torchao (pip install 'torchao>=0.18', or "
                              f"pip install -e '.[finetune]'): {error}", name="torchao") from error

#: torchao quantises a state only for parameters of at least this many elements whose size is a multiple of the
#: block (torchao 0.18 ``_AdamBase._new_buffer``, "follow bitsandbytes"); smaller ones keep whole moments.
MIN_QUANTISED_NUMEL = 4096
#: Which moments are signed (a signed lookup table) and which are not.
SIGNED = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}
SCALE_BYTES = 4  # one float32 scale per block
QMAP_BYTES = 4   # the lookup table: 2**bits float32 values per quantised tensor
STEP_WARNINGS = r".*does not implement _stable_hash_for_caching.*"  # torch.compile on torchao's tensor subclasses


def is_quantised(numel: int, block_size: int) -> bool:
    """Whether torchao keeps the moments of a parameter of ``numel`` elements quantised (else whole, like it)."""
    return numel >= MIN_QUANTISED_NUMEL and numel % block_size == 0


def low_bit_state_bytes(numel: int, bits: int, block_size: int, dtype: torch.dtype = torch.float32,
                        moments: int = 2) -> int:
    """Bytes the low-bit AdamW keeps for one parameter of ``numel`` elements held in ``dtype``: per moment, the codes
    (``bits`` per element), one float32 scale per block and a ``2**bits``-entry float32 lookup table; or, below
    torchao's size rule, a whole moment like the parameter. ``moments``: 2 (3 with ``amsgrad``).

    Example::

        low_bit_state_bytes(896 * 4864, bits=8, block_size=256)  # 2 x (4,358,144 + 68,096 + 1,024) = 8,854,528
    """
    if not is_quantised(numel, block_size):
        return moments * numel * dtype.itemsize
    return moments * (numel * bits // 8 + numel // block_size * SCALE_BYTES + 2 ** bits * QMAP_BYTES)


def _check_arguments(cls: str, block_size: Any, bits: int, amsgrad: bool) -> None:
    if amsgrad:
        raise ValueError(f"{cls}(amsgrad=True): torchao's quantised step cannot keep the running maximum of the second "
                         "moment (aten.maximum is not implemented on its state: pytorch/ao issue 2497, torchao 0.18). "
                         "Fix: amsgrad=False, or optimizer=adamw with amsgrad")
    even = bits == 4  # two 4-bit codes share a byte
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or (even and block_size % 2):
        need = "an even int >= 2 (two 4-bit codes per byte)" if even else "an int >= 1"
        raise ValueError(f"{cls}(block_size={block_size!r}): block_size must be {need} (values sharing one scale; "
                         f"torchao's default: {256 if bits == 8 else 128})")


class LowBitAdamW:
    """What :class:`AdamW8bit` and :class:`AdamW4bit` add to torchao's optimizers (see the module docstring)."""

    bits: int = 8
    state_class: Any = OptimState8bit
    block_size: int
    param_groups: list[dict[str, Any]]
    state: Any
    zero_refusal = ("DeepSpeed ZeRO steps one flat float32 partition per group and restores and reshards its state "
                    "by element copies, which block-quantised states do not support")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        self.param_groups[-1].setdefault("state_bits", self.bits)  # in every checkpoint: who wrote this state

    def state_bytes_per_param(self, dtype: torch.dtype | None = None) -> float:
        """Bytes of state per parameter (codes, scales and lookup tables; whole moments below torchao's size rule),
        for parameters held in ``dtype`` (``None``: their own dtypes); see :func:`low_bit_state_bytes`."""
        total = kept = 0
        for group in self.param_groups:
            moments = 3 if group.get("amsgrad") else 2
            for p in group["params"]:
                total += p.numel()
                kept += low_bit_state_bytes(p.numel(), self.bits, self.block_size, dtype or p.dtype, moments)
        return kept / total if total else 0.0

    def step_temporary_bytes(self) -> int:
        """An estimate of the bytes one step allocates on top of the state: the float32 moments of the largest
        parameter, materialised while its blocks are re-quantised (its compiled kernel runs one parameter at a time).
        Declared because a compiled step cannot be traced under a dispatch mode (the planner's tracker)."""
        largest = max((p.numel() for g in self.param_groups for p in g["params"]), default=0)
        return 2 * 4 * largest

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """torchao's step (compiled per parameter shape on first use), without torch.compile's note on its tensor
        subclasses' cache keys."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=STEP_WARNINGS)
            return super().step(closure)  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict with each quantised moment as plain tensors (codes, scales, lookup table)."""
        saved = super().state_dict()  # type: ignore[misc]
        saved["state"] = {index: {key: self._packed(value) for key, value in entry.items()}
                          for index, entry in saved["state"].items()}
        return saved

    def _packed(self, value: Any) -> Any:
        if not isinstance(value, self.state_class):
            return value
        return {"codes": value.codes, "scale": value.scale, "qmap": value.qmap, "bits": self.bits,
                "signed": bool(value.signed)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Rebuild the quantised moments from :meth:`state_dict`'s plain tensors, then torch's load.

        Raises:
            ValueError: When a moment is not what this optimizer keeps for its parameter (a whole tensor where it
                quantises, another bit width or block size): the checkpoint was written by another optimizer.
        """
        saved_params = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        by_index = dict(zip(saved_params, params))
        state = {}
        for index, entry in state_dict["state"].items():
            param = by_index.get(index)
            state[index] = entry if param is None else {k: self._unpacked(param, k, v) for k, v in entry.items()}
        super().load_state_dict({**state_dict, "state": state})  # type: ignore[misc]

    def _unpacked(self, param: torch.Tensor, key: str, value: Any) -> Any:
        if key not in SIGNED:
            return value
        name, shape = type(self).__name__, tuple(param.shape)
        wanted = is_quantised(param.numel(), self.block_size)
        fix = ("Fix: the optimizer= (and optimizer.block_size) of the run that wrote it, or ckpt_path=null to start "
               "fresh")
        if isinstance(value, dict):
            blocks = param.numel() // self.block_size
            if not wanted or value.get("bits") != self.bits or value["scale"].numel() != blocks:
                found = f"{value.get('bits')}-bit codes in {value['scale'].numel()} blocks"
                kept = f"{self.bits}-bit codes in {blocks} blocks" if wanted else f"a whole {param.dtype} tensor"
                raise ValueError(f"{name}: cannot resume the checkpoint's optimizer state: its {key} of a {shape} "
                                 f"parameter holds {found}, this optimizer keeps {kept} (block_size="
                                 f"{self.block_size}). {fix}")
            rebuilt = self.state_class.zeros(shape, SIGNED[key], self.block_size, param.device, dtype=param.dtype)
            if not torch.equal(rebuilt.qmap, value["qmap"].to(rebuilt.qmap)):
                raise ValueError(f"{name}: cannot resume the checkpoint's optimizer state: its {key} lookup table "
                                 f"differs from this torchao's (another torchao version wrote it). {fix}")
            rebuilt.codes.copy_(value["codes"])
            rebuilt.scale.copy_(value["scale"])
            return rebuilt
        if wanted and isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: cannot resume the checkpoint's optimizer state: its {key} of a {shape} "
                             f"parameter is a whole {value.dtype} tensor, this optimizer keeps {self.bits}-bit codes "
                             f"(written by another optimizer, e.g. optimizer=adamw). {fix}")
        return value


class AdamW8bit(LowBitAdamW, ao.AdamW8bit):
    """AdamW with 8-bit moments (torchao's ``AdamW8bit``): ~2.03 bytes of state per parameter instead of 8.

    Args:
        params: Parameters or param groups (a group may set its own ``lr`` and ``weight_decay``).
        lr: Learning rate (kept as a tensor in each group, as torchao needs; LR schedulers update it in place).
        betas: Decay rates of the first and second moment.
        eps: Denominator guard.
        weight_decay: Decoupled weight decay.
        amsgrad: Refused when True (torchao 0.18's quantised step cannot keep the running maximum); kept in the
            signature so that a config that sets it is told why.
        block_size: Values sharing one float32 scale (256: torchao's and bitsandbytes' default).
        bf16_stochastic_round: For bfloat16 parameters, round updates stochastically (draws from torch's global RNG).

    Raises:
        ValueError: A ``block_size`` that is not an int >= 1, ``amsgrad=True`` (and torchao's checks of lr, eps and
            betas).

    Example::

        optimizer = AdamW8bit(model.parameters(), lr=1e-4)
        optimizer.state_bytes_per_param()   # ~2.03 for a model of large matrices
    """

    bits = 8
    state_class = OptimState8bit

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, block_size: int = 256,
                 bf16_stochastic_round: bool = False) -> None:
        _check_arguments(type(self).__name__, block_size, self.bits, amsgrad)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         block_size=block_size, bf16_stochastic_round=bf16_stochastic_round)


class AdamW4bit(LowBitAdamW, ao.AdamW4bit):
    """AdamW with 4-bit moments (torchao's ``AdamW4bit``): ~1.06 bytes of state per parameter instead of 8.

    Args: as :class:`AdamW8bit`; ``block_size`` defaults to 128 and must be even (two codes per byte).

    Example::

        optimizer = AdamW4bit(model.parameters(), lr=1e-4)
    """

    bits = 4
    state_class = OptimState4bit

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, block_size: int = 128,
                 bf16_stochastic_round: bool = False) -> None:
        _check_arguments(type(self).__name__, block_size, self.bits, amsgrad)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         block_size=block_size, bf16_stochastic_round=bf16_stochastic_round)


def state_bytes_of(optimizer_state: dict[str, Any]) -> int:
    """Bytes an optimizer's live ``state`` holds (tensors of one dimension or more; a quantised moment counted as its
    codes, scales and lookup table): what a step allocated, to compare with :meth:`LowBitAdamW.state_bytes_per_param`."""
    total = 0
    for entry in optimizer_state.values():
        for value in entry.values():
            if isinstance(value, (OptimState8bit, OptimState4bit)):
                total += sum(t.numel() * t.element_size() for t in (value.codes, value.scale, value.qmap))
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                total += value.numel() * value.element_size()
    return total


__all__ = ["AdamW4bit", "AdamW8bit", "LowBitAdamW", "is_quantised", "low_bit_state_bytes", "state_bytes_of"]
