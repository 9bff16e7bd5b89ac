"""Memory toolkit: activation checkpointing/offload, in-place torch.compile, live-tensor accounting, fit planner."""
from lit_speed.memory.activation_checkpointing import ActivationCheckpointing, checkpoint_modules, restore_modules
from lit_speed.memory.compile_model import CompileModel, compile_modules, uncompile_modules
from lit_speed.memory.memory_tracker import LiveTensorTracker
from lit_speed.memory.model_state import model_state_bytes, state_bytes
from lit_speed.memory.planner import plan

__all__ = ["ActivationCheckpointing", "CompileModel", "LiveTensorTracker", "checkpoint_modules", "compile_modules",
           "model_state_bytes", "plan", "restore_modules", "state_bytes", "uncompile_modules"]
