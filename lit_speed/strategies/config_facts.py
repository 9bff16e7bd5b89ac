"""What a composed config will run, read once from the config: :func:`config_facts`, the config-time twin of
:func:`~lit_speed.strategies.facts.strategy_facts`.

The pre-flight checks, the fit check, the memory planner and the runner ask it instead of reading the config their
own way. Each configured class is located by importing its ``_target_`` as Hydra does and compared with lit_speed's
own classes by ``issubclass``: a renamed or subclassed component is still recognised, and a ``_target_`` string is
never matched by its spelling. A target that does not import is left unknown (``None``): the pre-flight's target
check names it with its fix.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf


def locate(path: str) -> Any:
    """The object a dotted path names (``pkg.module.Class`` or ``pkg.module.Class.attribute``), imported the way
    Hydra's ``_target_`` is: the longest importable module prefix, then attributes.

    Raises:
        ModuleNotFoundError: If no prefix imports (``name`` is the missing module), or a module imports a missing one.
        AttributeError: If the module lacks the attribute.
    """
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        try:
            found = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name is not None and (name == error.name or name.startswith(error.name + ".")):
                continue  # this prefix (or a parent of it) is not a module: try a shorter one
            raise
        for attribute in parts[end:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(f"No module named {parts[0]!r}", name=parts[0])


def locate_target(target: Any) -> Any:
    """The object a ``_target_`` names, imported as :func:`locate` imports it; ``None`` when ``target`` is not a
    string or does not import."""
    if not isinstance(target, str) or not target:
        return None
    try:
        return locate(target)
    except Exception:  # noqa: BLE001 - ImportError, AttributeError or whatever the module raises: left unknown
        return None


def is_a(cls: Any, public_name: str) -> bool:
    """Whether ``cls`` is lit_speed's public class ``public_name`` (``"HFCausalLM"``) or a subclass of it.

    The public class is imported only for a class whose hierarchy holds a class of that name (so that asking whether
    a digits model is a Hugging Face one does not import transformers); the answer is ``issubclass``'s.
    """
    if not isinstance(cls, type) or not any(base.__name__ == public_name for base in cls.__mro__):
        return False
    import lit_speed

    return issubclass(cls, getattr(lit_speed, public_name))


def _node(cfg: DictConfig, key: str) -> DictConfig | None:
    node = cfg.get(key)
    return node if isinstance(node, DictConfig) else None


def _target_class(node: DictConfig | None) -> Any:
    return locate_target(node.get("_target_")) if node is not None and "_target_" in node else None


def _default(cls: Any, argument: str) -> Any:
    """The default of ``cls``'s constructor argument ``argument`` (``None`` where it has none)."""
    try:
        parameter = inspect.signature(cls).parameters.get(argument)
    except (TypeError, ValueError):
        return None
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def configured_processes(cfg: DictConfig) -> int | None:
    """``trainer.devices x trainer.num_nodes`` as configured, or ``None`` where either is not a number (``auto``)."""
    trainer = cfg.get("trainer")
    devices = trainer.get("devices", 1) if isinstance(trainer, DictConfig) else 1
    nodes = trainer.get("num_nodes", 1) if isinstance(trainer, DictConfig) else 1
    ok = isinstance(devices, int) and isinstance(nodes, int) and devices > 0 and nodes > 0
    return devices * nodes if ok else None


@dataclass(frozen=True)
class StrategyLayout:
    """The configured strategy.

    ``built``: the config names a ``_target_`` (else ``name`` is a Lightning registry name, ``auto`` by default);
    ``classes``: the names of the located class's hierarchy (empty for a registry name or a target that does not
    import); ``zero``: lit_speed's ``ZeroStrategy``, with ``stage`` and the offload flags as configured (the class's
    defaults where the config sets none); ``deepspeed``: a DeepSpeed strategy; ``ddp``: Lightning's DDP.
    """

    built: bool = False
    name: str = "auto"
    classes: tuple[str, ...] = ()
    zero: bool = False
    deepspeed: bool = False
    ddp: bool = False
    stage: int = 0
    offload_optimizer: bool = False
    offload_parameters: bool = False


def _strategy_layout(node: Any) -> StrategyLayout:
    if not isinstance(node, DictConfig):
        return StrategyLayout(name=str(node or "auto"))
    if "_target_" not in node:
        return StrategyLayout(name=str(node.get("name", "auto")))
    cls = _target_class(node)
    if not isinstance(cls, type):
        return StrategyLayout(built=True, name=str(node.get("name", "auto")))
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    zero = is_a(cls, "ZeroStrategy")

    def setting(key: str) -> Any:
        return node.get(key, _default(cls, key))

    return StrategyLayout(built=True, name=cls.__name__, classes=tuple(c.__name__ for c in cls.__mro__), zero=zero,
                          deepspeed=issubclass(cls, DeepSpeedStrategy), ddp=issubclass(cls, DDPStrategy),
                          stage=int(setting("stage") or 0) if zero else 0,
                          offload_optimizer=bool(setting("offload_optimizer")) if zero else False,
                          offload_parameters=bool(setting("offload_parameters")) if zero else False)


def _callback_nodes(cfg: DictConfig) -> dict[str, DictConfig]:
    """``{key: node}`` of the callbacks the runner builds (one ``_target_`` node, or a dict of them)."""
    node = _node(cfg, "callbacks")
    if node is None:
        return {}
    if "_target_" in node:
        return {"callback": node}
    return {str(k): v for k, v in node.items() if isinstance(v, DictConfig) and "_target_" in v}


@dataclass(frozen=True)
class ConfigFacts:
    """What a composed config runs (:func:`config_facts`).

    Attributes:
        precision_mode: The configured precision mode (``GuardedPrecision``'s ``mode`` or a Lightning literal's
            ``precision``; ``auto`` included), ``None`` where the config names none.
        precision_plugin: The precision is a ``_target_`` plugin, not a Lightning literal.
        strategy: The strategy's layout (:class:`StrategyLayout`).
        processes: ``trainer.devices x trainer.num_nodes``, ``None`` where either is ``auto``.
        hf_model: The model is lit_speed's ``HFCausalLM`` (a Hugging Face causal LM).
        text_folder: The data is lit_speed's ``TextFolderDataModule`` (text files read into token windows).
        adapters: The ``peft`` node when it builds ``PEFTAdapters``, else ``None``.
        lora: Adapters train (``PEFTAdapters`` with a method other than ``freeze``).
        exporter: The ``peft`` node's exporting callback: ``"adapters"`` (``PEFTAdapters``), ``"model"``
            (``ExportModel``) or ``None``.
        callbacks: ``{key: located class}`` of the configured callbacks (``None`` for a target that does not import).
        chunked_loss: The ``ChunkedLMLoss`` callback's node, ``None`` without one.
        checkpointing: An ``ActivationCheckpointing`` callback is configured.
        optimizer: The located optimizer class (``None``: none configured, or it does not import).
        low_bit_states: 8 or 4 for lit_speed's low-bit AdamWs (their ``bits``), else 0.
        data_class: The located DataModule class (``None``: no ``data`` node, or it does not import).
    """

    precision_mode: str | None = None
    precision_plugin: bool = False
    strategy: StrategyLayout = field(default_factory=StrategyLayout)
    processes: int | None = 1
    hf_model: bool = False
    text_folder: bool = False
    adapters: DictConfig | None = None
    lora: bool = False
    exporter: str | None = None
    callbacks: Mapping[str, Any] = field(default_factory=dict)
    chunked_loss: DictConfig | None = None
    checkpointing: bool = False
    optimizer: Any = None
    low_bit_states: int = 0
    data_class: Any = None

    def callback_keys(self, public_name: str) -> list[str]:
        """Keys of the configured callbacks that are lit_speed's ``public_name`` (or a subclass)."""
        return [key for key, cls in self.callbacks.items() if is_a(cls, public_name)]


def config_facts(cfg: DictConfig) -> ConfigFacts:
    """The facts of a composed config (see :class:`ConfigFacts`), every configured class located once.

    Example::

        facts = config_facts(cfg)
        if facts.hf_model and facts.lora:
            ...
    """
    precision = _node(cfg, "precision")
    key = "mode" if precision is not None and "_target_" in precision else "precision"
    mode = precision.get(key) if precision is not None and not OmegaConf.is_missing(precision, key) else None
    peft = _node(cfg, "peft")
    peft_cls = _target_class(peft)
    adapters = peft if is_a(peft_cls, "PEFTAdapters") else None
    exporter = "adapters" if adapters is not None else "model" if is_a(peft_cls, "ExportModel") else None
    nodes = _callback_nodes(cfg)
    callbacks = {key: _target_class(node) for key, node in nodes.items()}
    chunked = next((nodes[key] for key, cls in callbacks.items() if is_a(cls, "ChunkedLMLoss")), None)
    optimizer = _target_class(_node(cfg, "optimizer"))
    data_class = _target_class(_node(cfg, "data"))
    return ConfigFacts(
        precision_mode=None if mode is None else str(mode),
        precision_plugin=precision is not None and "_target_" in precision,
        strategy=_strategy_layout(cfg.get("strategy")),
        processes=configured_processes(cfg),
        hf_model=is_a(_target_class(_node(cfg, "model")), "HFCausalLM"),
        text_folder=is_a(data_class, "TextFolderDataModule"),
        adapters=adapters,
        lora=adapters is not None and adapters.get("method", "lora") != "freeze",
        exporter=exporter,
        callbacks=callbacks,
        chunked_loss=chunked,
        checkpointing=any(is_a(cls, "ActivationCheckpointing") for cls in callbacks.values()),
        optimizer=optimizer,
        low_bit_states=int(optimizer.bits) if is_a(optimizer, "LowBitAdamW") else 0,
        data_class=data_class,
    )
