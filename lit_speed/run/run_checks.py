"""Refuse a composed config that cannot train, before anything is built: each refusal names the setting and the fix.

:func:`check_config` reads only the config (cheap: it runs before the model, the data or the Trainer exist).
:func:`check_tokens_fit_model` runs once the DataModule is built, before the model (and its weights) is.
:func:`check_activation_memory` and :func:`check_checkpoint_matches` need the built model and run before
``fit``; :class:`~lit_speed.run.run_plan_check.RunPlanCheck` checks what only the Trainer knows (batches per epoch).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_speed.run.config_error import ConfigError


def _short(target: Any) -> str:
    return str(target).rsplit(".", 1)[-1]


def _data_target(data: DictConfig) -> Any:
    """The DataModule ``data`` builds; a wrapper (a curriculum's ``datamodule``) yields what it wraps."""
    inner = data.get("datamodule")
    if isinstance(inner, DictConfig) and "_target_" in inner:
        return inner._target_
    return data.get("_target_")


def _declared(target: Any, attribute: str) -> Any:
    """``target``'s class attribute ``attribute`` (``batch_kind``, ``accepted_batch_kinds``), imported; ``None``
    when it does not import or declares nothing (the pre-flight reports a target that does not import)."""
    from lit_speed.run.config_targets import import_target

    if not isinstance(target, str):
        return None
    try:
        return getattr(import_target(target, ""), attribute, None)
    except ConfigError:
        return None


def _pair_fixes(kind: str, accepted: tuple[str, ...], folders: Sequence[Path]) -> list[str]:
    """Options that fit: models that take ``kind``, data options that yield one of ``accepted``, and experiments
    that set a fitting data and model pair (``override /data`` and ``override /model`` in their defaults)."""
    from lit_speed.run.config_targets import option_targets

    models = option_targets("model", folders)
    datas = option_targets("data", folders)
    fixes = [f"model={o}" for o, cls in models.items() if kind in (getattr(cls, "accepted_batch_kinds", None) or ())]
    fixes += [f"data={o}" for o, cls in datas.items() if getattr(cls, "batch_kind", None) in accepted]
    for folder in folders:
        for path in sorted((folder / "experiment").glob("*.yaml")):
            chosen = {}
            for entry in OmegaConf.load(path).get("defaults") or []:
                if isinstance(entry, DictConfig):
                    chosen.update({str(k).split("/")[-1]: str(v) for k, v in entry.items()
                                   if str(k).startswith("override /")})
            data_cls, model_cls = datas.get(chosen.get("data", "")), models.get(chosen.get("model", ""))
            pair_kind = getattr(data_cls, "batch_kind", None)
            # a preset pair that keeps one side of the refused pair: the data's kind, or a model that takes it all
            keeps_one = pair_kind == kind or tuple(getattr(model_cls, "accepted_batch_kinds", None) or ()) == accepted
            if data_cls is not None and model_cls is not None and keeps_one and \
                    pair_kind in (getattr(model_cls, "accepted_batch_kinds", None) or ()):
                fixes.append(f"experiment={path.stem} (data={chosen['data']} model={chosen['model']})")
    return fixes


def check_data_model(cfg: DictConfig, folders: Sequence[Path] = ()) -> None:
    """Refuse a DataModule and a model that cannot work together (token ids into the MLP, digits into GPT), from
    what their classes declare (:class:`~lit_speed.run_contract.BatchSource`,
    :class:`~lit_speed.run_contract.BatchConsumer`); a class that declares nothing is not checked.

    Args:
        cfg: The composed config.
        folders: The config search path's folders, searched for options that fit (lit_speed's ``conf/`` if empty).

    Raises:
        ConfigError: Naming both classes, the batch kinds, and the options that fit.
    """
    data, model = cfg.get("data"), cfg.get("model")
    if not isinstance(data, DictConfig) or not isinstance(model, DictConfig):
        return
    data_target, model_target = _data_target(data), model.get("_target_")
    kind, accepted = _declared(data_target, "batch_kind"), _declared(model_target, "accepted_batch_kinds")
    if kind is None or accepted is None or kind in accepted:
        return
    from lit_speed.run.config_targets import CONFIG_DIR

    fixes = _pair_fixes(kind, tuple(accepted), list(folders) or [CONFIG_DIR])
    model_cls = _short(model_target)
    raise ConfigError(f"data ({_short(data_target)}) does not fit model ({model_cls}): it yields {kind!r} batches, "
                      f"{model_cls} takes {' or '.join(map(repr, accepted))}. "
                      f"Fix: {', or '.join(fixes) if fixes else 'a data= and model= pair that fit'}")


def _number(node: DictConfig, key: str, where: str) -> float | None:
    if key not in node or node[key] is None:
        return None
    value = node[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}.{key}={value!r}: expected a number, got {type(value).__name__}. "
                          f"Fix: {where}.{key}=<a number>")
    if not math.isfinite(value):
        raise ConfigError(f"{where}.{key}={value}: must be finite. Fix: {where}.{key}=<a finite number>")
    return float(value)


def check_optimizer(cfg: DictConfig) -> None:
    """lr > 0, 0 <= betas < 1 (two of them), eps > 0, weight_decay >= 0, momentum >= 0, each a finite number."""
    node = cfg.get("optimizer")
    if not isinstance(node, DictConfig):
        return
    lr = _number(node, "lr", "optimizer")
    if lr is not None and lr <= 0:
        raise ConfigError(f"optimizer.lr={node.lr}: the model would not train (lr must be > 0). "
                          "Fix: optimizer.lr=1e-3 (or another positive value)")
    for key, low in (("eps", None), ("weight_decay", 0.0), ("momentum", 0.0)):
        value = _number(node, key, "optimizer")
        if value is not None and (value < 0 if low == 0.0 else value <= 0):
            raise ConfigError(f"optimizer.{key}={node[key]}: must be {'>= 0' if low == 0.0 else '> 0'}. "
                              f"Fix: optimizer.{key}=<a {'non-negative' if low == 0.0 else 'positive'} number>")
    if "betas" in node and node.betas is not None:
        betas = OmegaConf.to_object(node.betas) if OmegaConf.is_list(node.betas) else node.betas
        if (not isinstance(betas, list) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
            raise ConfigError(f"optimizer.betas={betas!r}: needs two numbers in [0, 1). Fix: optimizer.betas=[0.9,0.99]")


def _positive(trainer: DictConfig, key: str, fix: str, allow_zero: bool = False) -> None:
    value = _number(trainer, key, "trainer")
    if value is not None and (value < 0 if allow_zero else value <= 0):
        raise ConfigError(f"trainer.{key}={trainer[key]}: {fix}")


def check_trainer(cfg: DictConfig) -> None:
    """Values the Trainer accepts but that divide by zero, clip nothing, or make no optimizer step."""
    trainer = cfg.get("trainer")
    if not isinstance(trainer, DictConfig):
        return
    _positive(trainer, "gradient_clip_val", "a negative clip value clips nothing. "
              "Fix: trainer.gradient_clip_val=1.0 (or null for no clipping)", allow_zero=True)
    _positive(trainer, "val_check_interval", "validation every 0 batches is undefined. "
              "Fix: trainer.val_check_interval=<batches >= 1, or a fraction of an epoch in (0, 1]>")
    _positive(trainer, "check_val_every_n_epoch", "must be >= 1. "
              "Fix: trainer.check_val_every_n_epoch=1 (or null to validate by trainer.val_check_interval)")
    for key in ("max_steps", "max_epochs", "limit_train_batches"):
        if trainer.get(key) == 0 and not isinstance(trainer.get(key), bool):
            fix = {"max_steps": "trainer.max_steps=-1 (no step limit) or >= 1",
                   "max_epochs": "trainer.max_epochs=1 or more",
                   "limit_train_batches": "trainer.limit_train_batches=1.0 (all batches) or >= 1"}[key]
            raise ConfigError(f"trainer.{key}=0: the run would make no optimizer step. Fix: {fix}")


def check_interpolations(cfg: DictConfig) -> None:
    """Every ``${...}`` in the config points at a key that exists (``${hydra:...}``, known only inside the job, and
    values resolved through it are left to the job).

    Raises:
        ConfigError: Naming the key, its value and what it points at.
    """
    from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError

    def walk(node: Any, path: str) -> None:
        keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
        for key in keys:
            where = f"{path}.{key}" if path else str(key)
            if where == "hydra" or where.startswith("hydra."):
                continue
            raw = OmegaConf.to_container(node, resolve=False)[key]  # type: ignore[index]
            if isinstance(raw, str) and "${hydra:" in raw:
                continue
            if raw == "???":  # a required value the option leaves to the command line (model.pretrained, init.path)
                raise ConfigError(f"{where}=???: required, and not given. Fix: {where}=<a value> on the command line "
                                  f"(see the comment of {path.split('.')[0] or where} in its conf/ file)")
            try:
                value = node[key]
            except InterpolationKeyError as error:
                missing = str(error).split("'")[1] if "'" in str(error) else str(error)
                raise ConfigError(f"{where}={raw}: the interpolation points at '{missing}', which the config does not "
                                  f"have. Fix: {where}=<a value>, or an interpolation of a key that exists") from None
            except InterpolationResolutionError:  # e.g. ${paths.output_dir} -> ${hydra:...}: resolved in the job
                continue
            if isinstance(value, (DictConfig, ListConfig)):
                walk(value, where)

    walk(cfg, "")


def configured_processes(cfg: DictConfig) -> int | None:
    """``trainer.devices x trainer.num_nodes`` as configured, or ``None`` where either is not a number (``auto``)."""
    trainer = cfg.get("trainer")
    devices = trainer.get("devices", 1) if isinstance(trainer, DictConfig) else 1
    nodes = trainer.get("num_nodes", 1) if isinstance(trainer, DictConfig) else 1
    ok = isinstance(devices, int) and isinstance(nodes, int) and devices > 0 and nodes > 0
    return devices * nodes if ok else None


def check_precision_strategy(cfg: DictConfig) -> None:
    """Refuse, before any process starts, a precision mode the configured strategy cannot run (bf16-master on
    several processes); ``GuardedPrecision`` would refuse it too, but only in every started process."""
    from lit_speed.precision.modes import TABLE

    precision, strategy = cfg.get("precision"), cfg.get("strategy")
    mode = precision.get("mode") if isinstance(precision, DictConfig) else None
    if mode not in TABLE or not TABLE[mode].one_process:
        return
    target = str(strategy.get("_target_", "")) if isinstance(strategy, DictConfig) else ""
    if target.endswith("ZeroStrategy"):
        return  # DeepSpeed's bf16 keeps the float32 masters itself
    world = configured_processes(cfg)
    multi = any(name in target for name in ("DDP", "FSDP", "ModelParallel")) or (world is not None and world > 1)
    if multi:
        name = target.rsplit(".", 1)[-1] or "the default strategy"
        raise ConfigError(f"precision={mode} with {name} on {world or 'several'} processes: {mode} runs on "
                          "one process for now (its gradient hook moves each bf16 gradient into the float32 master "
                          "before DDP could all-reduce it). Fix: precision=bf16-mixed for multi-process runs, or "
                          "strategy=zero2 (DeepSpeed keeps float32 masters itself), or trainer.devices=1")


def check_config(cfg: DictConfig, folders: Sequence[Path] = ()) -> None:
    """Every config-only check; raises :class:`ConfigError` on the first failure.

    ``folders``: the config search path's folders (``lit_speed.run.config_check.config_folders``), for the fixes.
    """
    check_data_model(cfg, folders)  # first: a model without its data also leaves ${data.*} interpolations dangling
    check_interpolations(cfg)
    check_precision_strategy(cfg)
    seed = cfg.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"seed={seed!r}: expected an integer or null. Fix: seed=42 (or seed=null for no seeding)")
    check_optimizer(cfg)
    check_trainer(cfg)
    check_checkpoint_path(cfg.get("ckpt_path"))


def is_deepspeed_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a folder DeepSpeed wrote (Lightning's ZeRO checkpoints): a ``latest`` tag file or a
    ``checkpoint/`` folder of ``*model_states.pt`` files, not merely a folder holding some ``.pt`` file."""
    return path.is_dir() and ((path / "latest").is_file() or (path / "checkpoint").is_dir()
                              or any(path.glob("*model_states.pt")))


def check_checkpoint_path(ckpt_path: Any) -> None:
    """A folder is a checkpoint only when DeepSpeed wrote it (``latest``, a ``checkpoint`` folder, ``*model_states.pt``)."""
    if ckpt_path is None or not isinstance(ckpt_path, str) or "://" in ckpt_path:
        return
    path = Path(ckpt_path)
    if path.is_dir() and not is_deepspeed_checkpoint(path):
        inside = sorted(p.name for p in path.glob("*.ckpt")) + sorted(p.name for p in path.glob("*.pt"))
        found = f" (it holds {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''})" if inside else ""
        example = path / inside[0] if inside else path / "checkpoints" / "last.ckpt"
        raise ConfigError(f"ckpt_path={ckpt_path}: is a folder, not a checkpoint{found}. Fix: pass a checkpoint file "
                          f"(e.g. ckpt_path={example}), or ckpt_path=last")


def _param_group_keys(optimizer_factory: Any) -> set[str] | None:
    """The param-group keys ``optimizer_factory`` gives every group, or ``None`` when it cannot be probed.

    The probe is a tiny ``Linear``'s parameters; an optimizer that needs parameter names (``wants_param_names``, e.g.
    ``MuonAdamW``) gets them as the bundled models pass them (``lit_speed.models.configure_optimizers.param_groups``).
    """
    probe = torch.nn.Linear(4, 4, bias=True)
    wants_names = bool(getattr(getattr(optimizer_factory, "func", optimizer_factory), "wants_param_names", False))
    named = list(probe.named_parameters())
    groups = [{"params": [p for _, p in named], "param_names": [f"probe.{n}" for n, _ in named]}] if wants_names \
        else [p for _, p in named]
    try:
        optimizer = optimizer_factory(groups)
    except Exception:  # noqa: BLE001 - a factory this probe cannot build: the check is skipped, never the run
        return None
    return set().union(*(set(g) for g in optimizer.param_groups)) - {"params", "param_names"}


def check_checkpoint_matches(ckpt_path: Any, model: torch.nn.Module, optimizer_factory: Any = None) -> None:
    """Refuse resuming a checkpoint written by another model or optimizer, naming what does not match.

    DeepSpeed's sharded folders are left to DeepSpeed; only single-file Lightning checkpoints are read.
    """
    if ckpt_path is None or not Path(str(ckpt_path)).is_file():
        return
    checkpoint = torch.load(str(ckpt_path), map_location="cpu", weights_only=False, mmap=True)
    saved = checkpoint.get("state_dict", {})
    mine = model.state_dict()
    if checkpoint.get("adapters_only"):  # PEFTAdapters: the trainable tensors only (it checks the frozen base)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        if trainable == {n for n, _ in model.named_parameters()}:
            raise ConfigError(f"ckpt_path={ckpt_path}: holds adapters only (written with peft=...), and this run trains "
                              "every parameter. Fix: the peft=/peft.* and init= options of the run that wrote it")
        mine = {k: v for k, v in mine.items() if k in trainable}
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    reshaped = [k for k in set(mine) & set(saved) if tuple(mine[k].shape) != tuple(saved[k].shape)]
    if missing or unexpected or reshaped:
        what = (f"{len(missing)} of this model's tensors are missing (e.g. {missing[0]})" if missing else
                f"it holds {len(unexpected)} tensors this model lacks (e.g. {unexpected[0]})" if unexpected else
                f"{reshaped[0]} is {tuple(saved[reshaped[0]].shape)} there, {tuple(mine[reshaped[0]].shape)} here")
        raise ConfigError(f"ckpt_path={ckpt_path}: written by another model ({what}); {type(model).__name__} "
                          "cannot resume it. Fix: the model=/data=/model.* options of the run that wrote it, "
                          "or ckpt_path=null")
    states = checkpoint.get("optimizer_states") or []
    if optimizer_factory is None or not states or not states[0].get("param_groups"):
        return
    keys = _param_group_keys(optimizer_factory)
    if keys is None:
        return
    optional = {"initial_lr", "foreach", "fused", "differentiable", "capturable", "maximize", "decoupled_weight_decay"}
    needed = keys - optional
    saved_keys = set().union(*(set(g) for g in states[0]["param_groups"]))
    fix = "Fix: the optimizer= of the run that wrote it, or ckpt_path=null to start fresh"
    if needed - saved_keys:
        raise ConfigError(f"ckpt_path={ckpt_path}: written with another optimizer (its state lacks "
                          f"{', '.join(sorted(needed - saved_keys))}). {fix}")
    # a key that marks whose state it is (the low-bit AdamWs' state_bits): another optimizer would misread the state
    marks = {"state_bits"} & (saved_keys - keys)
    if marks:
        raise ConfigError(f"ckpt_path={ckpt_path}: written with another optimizer (its state carries "
                          f"{', '.join(sorted(marks))}, which this optimizer does not keep). {fix}")


def check_activation_memory(cfg: DictConfig, available_bytes: int | None = None,
                            probe_lengths: tuple[int, int] = (128, 256)) -> None:
    """Refuse a token model whose activations at ``data.block_size`` x ``data.batch_size`` exceed free memory.

    Runs before the real model is built: a copy of the model config with a short context is probed by the
    planner (forward+backward bytes at micro-batches 1 and 2, two lengths); the largest per-token cost is
    scaled to the configured length (linear: attention's quadratic term is left out, so it errs towards running).
    """
    import hydra.utils

    from lit_speed.memory.planner import probe

    data, model_cfg = cfg.get("data"), cfg.get("model")
    if not isinstance(data, DictConfig) or not isinstance(model_cfg, DictConfig) or "block_size" not in model_cfg:
        return
    block, batch = data.get("block_size"), data.get("batch_size")
    if not isinstance(block, int) or not isinstance(batch, int) or block <= max(probe_lengths):
        return
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    small = hydra.utils.instantiate(model_cfg, block_size=max(probe_lengths), optimizer=None, scheduler=None)
    per_token = []
    for length in probe_lengths:
        tokens = torch.zeros(1, length, dtype=torch.long)
        fit = probe(small, (tokens, tokens), micro_batches=(1, 2), repeats=1)
        per_token.append(fit.bytes_fit[1] / length)
    estimate = int(max(per_token) * batch * block)
    if estimate > available_bytes:
        raise ConfigError(f"data.block_size={block} x data.batch_size={batch}: activations need about "
                          f"{estimate / 2**30:,.1f} GiB (planner estimate), {available_bytes / 2**30:,.1f} GiB is "
                          "free. Fix: a smaller data.block_size or data.batch_size (see lit_speed.memory.planner)")


def _with_path(source: str, where: str) -> str:
    """``"a=1"`` -> ``"data.a=1"`` (``""`` stays ``""``)."""
    return f"{where}.{source}" if source else ""


def check_tokens_fit_model(datamodule: Any, model_cfg: DictConfig) -> None:
    """Refuse token ids the model's embedding lacks and windows longer than its positions, before its weights load.

    The DataModule says its vocabulary and window (:class:`~lit_speed.run_contract.TokenSource`, which loads and
    checks its tokenizer now), the model's class its embedding rows and positions from its config alone
    (:class:`~lit_speed.run_contract.TokenModel`: ``config.json`` for a Hugging Face folder). Either side that says
    nothing is not checked.

    Raises:
        ConfigError: Naming both settings, both sizes and the fix.
    """
    from lit_speed.run.config_targets import import_target
    from lit_speed.run_contract import TokenSource

    target = model_cfg.get("_target_") if isinstance(model_cfg, DictConfig) else None
    if not isinstance(datamodule, TokenSource) or not isinstance(target, str):
        return
    input_limits = getattr(import_target(target, "model"), "input_limits", None)  # a TokenModel's classmethod
    if not callable(input_limits):
        return
    limits = input_limits(OmegaConf.to_container(model_cfg, resolve=True))
    if limits is None:
        return
    data, model_source = datamodule.token_limits(), _with_path(limits.source, "model")
    if data.vocab_size > limits.vocab_size:
        data_source = _with_path(data.source, "data")
        outside = (f"the embedding of {limits.name} has {limits.vocab_size:,} rows ({model_source}): ids "
                   f"{limits.vocab_size:,} to {data.vocab_size - 1:,} would index outside it (an IndexError at the "
                   "first batch)")
        if data_source:  # a tokenizer the user chose: the model's own is the fix
            raise ConfigError(f"{data_source}: its vocabulary has {data.vocab_size:,} token ids, {outside}. Fix: the "
                              "tokenizer the model was trained with (data.tokenizer=<the model's own folder or hub "
                              "id>), or a model whose vocabulary holds it")
        raise ConfigError(f"{model_source}: the data's ids come from {data.name or 'its vocabulary'} "
                          f"({data.vocab_size:,} ids), {outside}. Fix: {model_source.partition('=')[0]}="
                          f"{data.vocab_size}")
    if limits.positions is None or data.positions is None or data.positions <= limits.positions:
        return
    n, block = limits.positions, _with_path(data.positions_source or f"block_size={data.positions}", "data")
    where = _with_path(limits.positions_source, "model") or model_source
    if limits.kind == "learned":
        raise ConfigError(f"{block}: longer than the {n} positions of {limits.name} ({where}): its position "
                          f"embeddings are a learned table of {n} rows, so positions {n} and later do not exist (an "
                          f"IndexError at the first batch). Fix: data.block_size={n} (or less)")
    what = ("rotary positions run past it, at positions the model never saw in training, so quality drops"
            if limits.kind == "rotary" else "past it the model runs at positions it was not built for")
    config_json = Path(limits.source.partition("=")[2]) / "config.json"  # a local folder: its limit can be raised
    raise_it = f"; to train past it on purpose, raise max_position_embeddings in {config_json}" * config_json.is_file()
    raise ConfigError(f"{block}: longer than the {n} positions {limits.name} was made for (max_position_embeddings, "
                      f"{where}): its {what}. Fix: data.block_size={n} (or less){raise_it}")
