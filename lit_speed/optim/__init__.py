"""Optimizers and LR schedules: Muon/AdamW (batched Newton-Schulz), Lion, DeepSpeed's CPU Adam made safe under
Lightning, warm-up + cosine / warm-up-stable-decay, and the state each optimizer declares (``state_cost``).

Each works alone (``MuonAdamW(model.named_parameters())``) and as an ``optimizer=`` option (``conf/optimizer/``);
see ``lit_speed/optim/README.md``. Modules are imported on use (``cpu_adam`` loads DeepSpeed).
"""
