"""Fine-tune what you already have: start from weights, train adapters (``peft``), export the merged model.

The core: ``weights``, ``adapters``, ``frozen_base``, ``export`` (functions, no Trainer needed); the Lightning
callbacks that call them: ``init_callback.InitWeights``, ``peft_callback.PEFTAdapters``, and
``export_callback.ExportModel`` (the trained model's export when every parameter trains).
"""
from lit_speed.finetune.adapter_grad import choose_up_grad, set_up_grad
from lit_speed.finetune.adapters import add_adapters, module_names_matching
from lit_speed.finetune.export import export_merged, merge_adapters
from lit_speed.finetune.export_callback import ExportModel
from lit_speed.finetune.frozen_base import (
    choose_base_compute,
    frozen_base_bytes,
    lower_frozen_base,
    set_base_compute,
    unwrap_frozen_base,
)
from lit_speed.finetune.init_callback import InitWeights
from lit_speed.finetune.peft_callback import PEFTAdapters
from lit_speed.finetune.weights import load_weights, read_state_dict
from lit_speed.memory.model_state import parameter_counts

__all__ = ["ExportModel", "InitWeights", "PEFTAdapters", "add_adapters", "choose_base_compute", "choose_up_grad",
           "export_merged", "frozen_base_bytes", "load_weights", "lower_frozen_base", "merge_adapters",
           "module_names_matching", "parameter_counts", "read_state_dict", "set_base_compute", "set_up_grad",
           "unwrap_frozen_base"]
