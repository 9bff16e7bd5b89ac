"""Fine-tune what you already have: start from weights, train adapters (``peft``), export the merged model."""
from lit_speed.finetune.adapters import add_adapters, module_names_matching, parameter_counts
from lit_speed.finetune.export import export_merged, merge_adapters
from lit_speed.finetune.init_weights import InitWeights
from lit_speed.finetune.peft_adapters import PEFTAdapters
from lit_speed.finetune.weights import load_weights, read_state_dict

__all__ = ["InitWeights", "PEFTAdapters", "add_adapters", "export_merged", "load_weights", "merge_adapters",
           "module_names_matching", "parameter_counts", "read_state_dict"]
