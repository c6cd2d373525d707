"""The layers of the library and putting a model under the runtime:

  embedding.py   ElasticEmbedding (a frozen embedding table held by the runtime in row
                 blocks; a lookup exchanges only its rows) and ElasticBlocksLinear (an output
                 layer on row blocks; a tied one shares the embedding's)
  linear.py      ElasticLinear (a frozen linear on an elastic tensor) and what every elastic
                 layer shares: the op dtype under autocast, per-use casts, refusing .to()
  lora.py        LoRAConfig, ElasticLoRAFunction, ElasticLoRALinear, LoRA targets; several
                 named adapters on one base (ElasticMultiLoRALinear, segmented_lora_fwd/bwd)
  units.py       which frozen weights are gathered together (decoder layers)
  convert.py     convert_to_elastic, elasticize, runtime_of, stats, set_pool_budget, no_sync, close
  adapters.py    PEFT-format adapters: save_adapter, load_adapter, merge_adapters, adapter_parameters
  state_dict.py  full state dicts (a collective) and load_state_dict into the shards
  ddp.py         running inside DistributedDataParallel
"""

from .adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    adapter_parameters,
    adapter_state_dict,
    load_adapter,
    lora_layers,
    merge_adapters,
    save_adapter,
)
from .convert import (
    close,
    convert_to_elastic,
    elasticize,
    no_sync,
    register_conversion_hook,
    reset_stats,
    runtime_of,
    set_pool_budget,
    stats,
)
from .embedding import ElasticBlocksLinear, ElasticEmbedding
from .linear import ElasticLinear, ElasticLinearFunction
from .lora import (
    ElasticLoRAFunction,
    ElasticLoRALinear,
    ElasticMultiLoRAFunction,
    ElasticMultiLoRALinear,
    LoRAConfig,
    segmented_lora_bwd,
    segmented_lora_fwd,
    target_names,
)
from .state_dict import gather_only, load_full_weight

__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_PREFIX", "ElasticBlocksLinear", "ElasticEmbedding", "ElasticLinear", "ElasticLinearFunction",
    "ElasticLoRAFunction", "ElasticLoRALinear", "ElasticMultiLoRAFunction", "ElasticMultiLoRALinear", "LoRAConfig",
    "adapter_parameters", "adapter_state_dict", "close", "convert_to_elastic",
    "elasticize", "gather_only", "load_adapter", "load_full_weight", "lora_layers", "merge_adapters",
    "no_sync", "register_conversion_hook", "reset_stats", "runtime_of", "save_adapter", "set_pool_budget",
    "segmented_lora_bwd", "segmented_lora_fwd", "stats", "target_names",
]
