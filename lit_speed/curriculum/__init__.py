"""Curriculum learning (easiest samples first, sequence-length warm-up) and curriculum-aware early stopping."""
from lit_speed.curriculum.curriculum_data_module import CurriculumDataModule
from lit_speed.curriculum.curriculum_early_stopping import CurriculumEarlyStopping
from lit_speed.curriculum.sampler import CurriculumSampler

__all__ = ["CurriculumDataModule", "CurriculumEarlyStopping", "CurriculumSampler"]
