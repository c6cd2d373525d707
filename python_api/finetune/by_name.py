"""The typed configuration behind options held by name: what the by-name entry points that
callers not yet converted still use (policy_of, quant_fields, lora_config_of, target_list,
compare_pp_is_main) turn their argument into, so each rule is written once, on the typed
groups ([Note: configuration as types] in configuration.py)."""

from __future__ import annotations

import argparse

from .configuration import FinetuneConfig, OptionView


def config_of(options) -> FinetuneConfig:
    """The configuration of `options`: a FinetuneConfig as it is, an OptionView's own, or
    parse_args' namespace converted (FinetuneConfig.from_args: every destination in its
    group). Anything else is a TypeError naming what was passed."""
    if isinstance(options, FinetuneConfig):
        return options
    if isinstance(options, OptionView):
        return object.__getattribute__(options, "_config")
    if isinstance(options, argparse.Namespace):
        return FinetuneConfig.from_args(options)
    raise TypeError(f"expected a FinetuneConfig, an OptionView or parse_args' namespace, not {type(options).__name__}")
