"""``lit_speed.memory.model_state.parameter_counts``: the one count of a model's parameters (issue 51)."""
from __future__ import annotations

from torch import nn

from lit_speed.memory.model_state import ParameterCounts, parameter_counts


def test_trainable_and_frozen_elements_with_tied_tensors_once() -> None:
    embed, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=True)
    head.weight = embed.weight  # tied: one tensor of 40 elements
    body = nn.Linear(4, 4)
    body.requires_grad_(False)
    model = nn.ModuleDict({"embed": embed, "body": body, "head": head})
    counts = parameter_counts(model)
    assert counts == ParameterCounts(trainable=40 + 10, frozen=16 + 4)
    assert counts.total == 70 and counts.trainable == 50
