"""Memory toolkit: activation checkpointing/offload, in-place torch.compile, the chunked LM loss, live-tensor
accounting, fit planner.

The chunked loss: the function ``chunked_lm_loss`` in ``chunked_lm_loss.py`` (also ``lit_speed.chunked_lm_loss``),
its callback ``ChunkedLMLoss`` in ``chunked_lm_loss_callback.py``."""
from lit_speed.memory.activation_checkpointing import ActivationCheckpointing, checkpoint_modules, restore_modules
from lit_speed.memory.chunked_lm_loss import chunked_loss_bytes
from lit_speed.memory.chunked_lm_loss_callback import ChunkedLMLoss
from lit_speed.memory.compile_model import CompileModel, compile_modules, uncompile_modules
from lit_speed.memory.hf_chunked_loss import chunk_hf_loss, hf_lm_head, unchunk_hf_loss
from lit_speed.memory.memory_tracker import LiveTensorTracker
from lit_speed.memory.model_state import model_state_bytes, state_bytes
from lit_speed.memory.planner import plan

__all__ = ["ActivationCheckpointing", "ChunkedLMLoss", "CompileModel", "LiveTensorTracker", "checkpoint_modules",
           "chunk_hf_loss", "chunked_loss_bytes", "compile_modules", "hf_lm_head", "model_state_bytes",
           "plan", "restore_modules", "state_bytes", "uncompile_modules", "unchunk_hf_loss"]
