"""Loading a model larger than one rank's memory: built on the meta device, each rank reading
from the memory-mapped safetensors files only the rows of the frozen weights it keeps.

  source.py  SafetensorsSource (the files, read by rows), LoadError
  model.py   load_elastic, empty_model, params_on_meta, config_dtype
"""

from python_api.loading.model import config_dtype, empty_model, load_elastic, params_on_meta
from python_api.loading.source import LoadError, SafetensorsSource

__all__ = ["LoadError", "SafetensorsSource", "config_dtype", "empty_model", "load_elastic", "params_on_meta"]
