"""Policy and user API of elastic-kernels (config, elastic runtime, LoRA layers, CLI).

Imports flow one way: ``python_api`` -> ``elastic_kernels`` -> ``_C``.
"""
