"""Choices whose best value depends on the machine, measured where the run happens and cached per machine."""
from lit_speed.tuning.measured_choice import Decision, choose_fastest, measured_choice, on_rank_zero, time_interleaved

__all__ = ["Decision", "choose_fastest", "measured_choice", "on_rank_zero", "time_interleaved"]
