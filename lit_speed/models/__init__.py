from lit_speed.models.gpt import GPT, Block, GPTModule
from lit_speed.models.mlp import MLPClassifier

__all__ = ["GPT", "Block", "GPTModule", "MLPClassifier"]
