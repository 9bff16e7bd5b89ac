"""Difficulty scorers: one number per training sample, lower = easier, and the easiest-first order.

Built-ins: ``length`` (sequence length), ``centroid`` (distance of a sample's features to its class mean:
prototypical samples first), ``loss`` (one no-grad pass of a reference model) and ``none``; or pass a
per-sample score array or a function ``sample -> float``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

BUILTIN_SCORERS = ("none", "length", "centroid", "loss")


def _first(sample: Any) -> Any:
    return sample[0] if isinstance(sample, (tuple, list)) else sample


def length_scores(dataset: Dataset) -> torch.Tensor:
    """Length of each sample's first field (a sequence): shorter is easier."""
    return torch.tensor([float(len(_first(dataset[i]))) for i in range(len(dataset))])


def centroid_scores(dataset: Dataset) -> torch.Tensor:
    """Euclidean distance of each ``(features, label)`` sample to the mean of its class: typical is easier."""
    x = torch.stack([torch.as_tensor(dataset[i][0]).float().flatten() for i in range(len(dataset))])
    y = torch.tensor([int(dataset[i][1]) for i in range(len(dataset))])
    classes, inverse = torch.unique(y, return_inverse=True)
    means = torch.zeros(len(classes), x.shape[1]).index_add_(0, inverse, x)
    means /= torch.bincount(inverse, minlength=len(classes)).unsqueeze(1)
    return (x - means[inverse]).norm(dim=1)


@torch.no_grad()
def loss_scores(model: Callable[[torch.Tensor], torch.Tensor], dataset: Dataset, batch_size: int = 256) -> torch.Tensor:
    """Per-sample cross-entropy of ``(input, target)`` samples under a reference model (one pass, no grad).

    Sequence outputs ``(batch, time, classes)`` are averaged over time.
    """
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    scores = []
    for x, y in DataLoader(dataset, batch_size=batch_size, shuffle=False):
        logits = model(x).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        scores.append(loss.view(len(x), -1).mean(dim=1))
    if was_training:
        model.train()
    return torch.cat(scores)


def resolve_scores(difficulty: str | Sequence[float] | torch.Tensor | Callable[[Any], float], dataset: Dataset,
                   reference_model: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
    """Turn the ``difficulty`` setting into one score per sample (``None`` for ``"none"``).

    Raises:
        ValueError: For an unknown scorer name, ``loss`` without a reference model, or a score array
            whose length differs from the dataset's.
    """
    if isinstance(difficulty, str):
        if difficulty not in BUILTIN_SCORERS:
            raise ValueError(f"difficulty must be one of {BUILTIN_SCORERS}, a score array or a function sample -> "
                             f"float, got {difficulty!r}")
        if difficulty == "none":
            return None
        if difficulty == "loss":
            if reference_model is None:
                raise ValueError("difficulty='loss' needs reference_model= (a trained model scoring each sample); "
                                 "pass one, or use difficulty='centroid'/'length' or a score array")
            return loss_scores(reference_model, dataset)
        return length_scores(dataset) if difficulty == "length" else centroid_scores(dataset)
    if callable(difficulty):
        return torch.tensor([float(difficulty(dataset[i])) for i in range(len(dataset))])
    scores = torch.as_tensor(difficulty, dtype=torch.float64).flatten()
    if len(scores) != len(dataset):
        raise ValueError(f"difficulty has {len(scores)} scores but the training set has {len(dataset)} samples; "
                         "pass one score per training sample")
    return scores


def difficulty_order(scores: torch.Tensor | None, n: int, seed: int = 0) -> torch.Tensor:
    """Dataset indices from easiest to hardest; ties (and ``scores=None``) in a seeded random order.

    Example::

        >>> difficulty_order(torch.tensor([3.0, 1.0, 2.0]), 3).tolist()
        [1, 2, 0]
    """
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    if scores is None:
        return perm
    if not torch.isfinite(torch.as_tensor(scores, dtype=torch.float64)).all():
        raise ValueError("difficulty scores contain NaN or inf; every sample needs a finite score")
    return perm[torch.argsort(torch.as_tensor(scores)[perm], stable=True)]
