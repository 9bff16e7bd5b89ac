"""Checks against the built DataModule and model config, before the weights load: the tokenizer's ids and the
window against the model's embedding and positions (:func:`check_tokens_fit_model`), and a token model's
activations at the configured window against free memory (:func:`check_activation_memory`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lit_speed.run.config_error import ConfigError


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
        from lit_speed.memory.host_memory import host_memory

        available_bytes = host_memory().available
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
    key = block.partition("=")[0]  # data.block_size, or data.max_length (data=sft)
    where = _with_path(limits.positions_source, "model") or model_source
    if limits.kind == "learned":
        raise ConfigError(f"{block}: longer than the {n} positions of {limits.name} ({where}): its position "
                          f"embeddings are a learned table of {n} rows, so positions {n} and later do not exist (an "
                          f"IndexError at the first batch). Fix: {key}={n} (or less)")
    what = ("rotary positions run past it, at positions the model never saw in training, so quality drops"
            if limits.kind == "rotary" else "past it the model runs at positions it was not built for")
    config_json = Path(limits.source.partition("=")[2]) / "config.json"  # a local folder: its limit can be raised
    raise_it = f"; to train past it on purpose, raise max_position_embeddings in {config_json}" * config_json.is_file()
    raise ConfigError(f"{block}: longer than the {n} positions {limits.name} was made for (max_position_embeddings, "
                      f"{where}): its {what}. Fix: {key}={n} (or less){raise_it}")
