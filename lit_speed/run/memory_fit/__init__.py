"""Will the run fit in memory? Answered from the config before anything heavy starts.

- :mod:`~lit_speed.run.memory_fit.fit_gate`: :func:`~lit_speed.run.memory_fit.fit_gate.check_fits_memory`, the one
  call the runner makes: refuses a Hugging Face run that will not fit, naming the cheapest lever set that would.
- :mod:`~lit_speed.run.memory_fit.fit_check`: the predicted peak RSS of a Hugging Face fine-tune (meta-device
  parameter counts and a scaled probe of one step).
- :mod:`~lit_speed.run.memory_fit.fit_check_gpu`: a GPU run's host side and its step on one GPU.
- :mod:`~lit_speed.run.memory_fit.fit_levers`: the memory levers a config has on and the sets tried.
- :mod:`~lit_speed.run.memory_fit.memory_plan`: ``scripts/plan.py``'s table of configurations for any model.
"""
