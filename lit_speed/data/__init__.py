from lit_speed.data.charlm import CharLMDataModule, build_corpus, unigram_cross_entropy
from lit_speed.data.digits import DigitsDataModule

__all__ = ["CharLMDataModule", "DigitsDataModule", "build_corpus", "unigram_cross_entropy"]
