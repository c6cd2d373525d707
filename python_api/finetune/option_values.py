"""Option values: the types argparse parses each option's value with (sizes, budgets, counts
and ratios in their ranges, lists of names), the choices, and the labels of sizes and
budgets the report and the checkpoints write."""

from __future__ import annotations

import argparse
import math

# Binary units (KiB, and K as its short form) and decimal ones (KB = 1000 bytes, as GPU memory
# is quoted: "40 GB").
_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1, "": 1}


def _budget(text: str):
    """'all' -> None (every frozen chunk), 'N%' -> fraction, else bytes ('0', '64MiB', '2G')."""
    t = text.strip()
    if t.lower() in ("all", "none", "full"):
        return None
    if t.endswith("%"):
        try:
            pct = float(t[:-1])
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a percentage: {text!r}") from None
        if not 0.0 <= pct <= 100.0:
            raise argparse.ArgumentTypeError(f"a percentage in [0, 100] is expected, got {text!r}")
        return ("fraction", pct / 100.0)
    num = t.rstrip("KMGTBikmgtb")
    unit = t[len(num):].lower()
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"unknown unit in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, N% or all)")
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 0, 64MiB, 40GB, 50%, all)") from None
    if value < 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"a size must be >= 0, got {text!r}")
    units = _UNITS
    if not value * units[unit] < _MAX_BYTES:
        raise argparse.ArgumentTypeError(f"a budget must be a finite size below 8 EiB (2**63 bytes), got {text!r}")
    return int(value * units[unit])


def _size(text: str) -> int:
    """A byte size ('0', '64MiB', '2G'): what _budget accepts, without 'all' or percentages."""
    value = _budget(text)
    if not isinstance(value, int):
        raise argparse.ArgumentTypeError(f"a size in bytes is expected (e.g. 512MiB), got {text!r}")
    return value


def _memory_cap(text: str):
    """'auto' (the device's memory; on CPU this process's share of the machine's) or a size."""
    return "auto" if text.strip().lower() == "auto" else _size(text)


def _cap_change(text: str) -> tuple[int, int]:
    """STEP:SIZE: from optimizer step STEP (1-based) on, the memory cap is SIZE."""
    step, sep, size = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected STEP:SIZE (e.g. 10:256MiB), got {text!r}")
    try:
        n = int(step)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer step before ':', got {step!r}") from None
    if not 1 <= n <= _MAX_INT:
        raise argparse.ArgumentTypeError(f"the step must be in [1, {_MAX_INT}], got {n}")
    return n, _size(size)


def _pipeline_degree(text: str):
    """'auto' or a positive pipeline degree."""
    if text.strip().lower() == "auto":
        return "auto"
    return _positive_int(text)


def _pack_size(text: str):
    """'auto' or a positive number of decoder layers."""
    if text.strip().lower() == "auto":
        return "auto"
    return _positive_int(text)


# [Note: option ranges]
# Every number an option takes ends up in a fixed-width C/C++ or torch integer, a timedelta or
# a float computation: counts and sizes are capped at 2**31 - 1 (they index tensors and step
# seeds, see data._step_seed), the seed at 2**32 - 1 (data._step_seed folds it into 32 bits:
# larger seeds would repeat smaller ones' batches), byte sizes below 2**63, the timeout at
# _MAX_TIMEOUT_S (a timedelta in milliseconds must fit the backends' int64 and stay
# meaningful), and floats must be finite. Out of range is an option error, before anything runs.
_MAX_INT = 2**31 - 1
_MAX_SEED = 2**32 - 1
_MAX_BYTES = 2**63
_MAX_TIMEOUT_S = 1e7  # ~115 days


def _int_in(low: int, high: int, what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"expected {what} (at most {high}), got {v}")
        return v

    parse.__name__ = what  # argparse names the type in some messages
    return parse


_positive_int = _int_in(1, _MAX_INT, "a positive integer")
_nonneg_int = _int_in(0, _MAX_INT, "an integer >= 0")
_seed_int = _int_in(0, _MAX_SEED, "an integer in [0, 2**32 - 1]")


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text!r}")
    return v


def _timeout(text: str) -> float:
    v = _positive_float(text)
    if v > _MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"expected at most {_MAX_TIMEOUT_S:g} seconds, got {text!r}")
    return v


def _ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return v


WEIGHT_FORMAT_CHOICES = ("none", "nf4", "int8")
LR_SCHEDULES = ("constant", "cosine", "linear")
PEERS = ("fsdp2", "deepspeed", "ddp", "fsdp2-nf4")


def _names(text: str, allowed, what: str, expected: str) -> list[str]:
    """A comma-separated list of `allowed` names, each at most once, in the order given."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {what}(s) {bad}: expected {expected}{', '.join(allowed)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{what}(s) {twice} given twice")
    return names


def _baselines(text: str) -> list[str]:
    """'none' or a comma-separated list of peers (each at most once), in the order given."""
    if [t.strip().lower() for t in text.split(",") if t.strip()] in (["none"], []):
        return []
    return _names(text, PEERS, "baseline", "none or a comma-separated list of ")


def _compare_formats(text: str, main: str) -> list[str]:
    """--compare-format: weight formats other than the main run's (--weight-format), each once."""
    names = _names(text, WEIGHT_FORMAT_CHOICES, "format", "a comma-separated list of ")
    if main in names:
        raise argparse.ArgumentTypeError(f"{main} is the main run's format (--weight-format {main})")
    return names


def _reshard(text: str):
    """FSDP2's reshard_after_forward: true, false, or N (an int > 1: reshard to groups of N)."""
    t = text.strip().lower()
    if t in ("true", "yes"):
        return True
    if t in ("false", "no"):
        return False
    try:
        n = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true, false or a number of ranks, got {text!r}") from None
    if not 1 < n <= _MAX_INT:
        raise argparse.ArgumentTypeError(f"a number of ranks > 1 is expected (1 is false), got {n}")
    return n


def _elements(text: str) -> int:
    """An element count, in DeepSpeed's notation too ('0', '100000', '1e5', '5e7')."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of elements (e.g. 0, 1e5), got {text!r}") from None
    if not (0 <= v < 2**63) or v != int(v):
        raise argparse.ArgumentTypeError(f"expected a whole number of elements >= 0, got {text!r}")
    return int(v)


# The options of the DeepSpeed peer, as elastic_kernels.api.finetune.peers.zero3.ZeRO3Setting's fields.
DS_OPTIONS = ("ds_persistence_threshold", "ds_max_live_parameters", "ds_max_reuse_distance",
              "ds_prefetch_bucket_size", "ds_quantized_weights", "ds_quantized_nontrainable_weights")


def budget_label(spec) -> str:
    if spec is None:
        return "all"
    if isinstance(spec, tuple):
        return f"{spec[1] * 100:g}%"
    return fmt_bytes(spec)


def fmt_bytes(n: int) -> str:
    if n == 0:
        return "0"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n}B"


# [Note: the sweep's keys and adapter names]
# `--sweep KEY=V1,V2 ...` trains one adapter per combination of the values (the cartesian
# product, in the order given: the last key varies fastest). Each key is an option of a solo
# run, with that option's own range: lr (AdamW's peak learning rate, > 0), lora-r (>= 1),
# lora-alpha (> 0), lora-dropout (in [0, 1)) and seed, which in a sweep is the adapter's
# initialization only (the batches, the dropout masks and --model tiny's weights follow
# --seed: every adapter trains on the same batches). An adapter's name says its swept values,
# `lr0p001_r8` for lr=0.001 lora-r=8: the short name of each key followed by the value's
# shortest round-trip text (Python's repr, so two distinct floats never share a name) with
# '.' as 'p', '-' as 'm' and '+' dropped, so that the name is an identifier as the library
# requires (normalize_adapters in python_api/nn/lora.py): it is the adapter's folder under
# `--save-dir DIR/adapters/`.
SWEEP_KEYS = {  # key -> (parse, short name in adapter names, the option it stands for)
    "lr": (_positive_float, "lr", "--lr"),
    "lora-r": (_positive_int, "r", "--lora-r"),
    "lora-alpha": (_positive_float, "alpha", "--lora-alpha"),
    "lora-dropout": (None, "dropout", "--lora-dropout"),  # _dropout, below
    "seed": (_seed_int, "seed", "--seed"),
}


def _dropout(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return v


def _sweep_item(text: str) -> tuple[str, tuple]:
    """One `KEY=V1,V2,...` of --sweep: the key and its values, parsed by the key's own option
    type, each once ([Note: the sweep's keys and adapter names])."""
    key, eq, values = text.partition("=")
    key = key.strip().lower()
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=V1,V2,... (e.g. lr=1e-4,3e-4), got {text!r}")
    if key not in SWEEP_KEYS:
        raise argparse.ArgumentTypeError(f"unknown key {key!r} in {text!r}: expected one of {', '.join(SWEEP_KEYS)}")
    words = [w.strip() for w in values.split(",")]
    if not all(words):
        raise argparse.ArgumentTypeError(f"{key}: expected comma-separated values without empty ones, got {values!r}")
    parse = SWEEP_KEYS[key][0] or _dropout
    out = []
    for w in words:
        try:
            out.append(parse(w))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{key}={w}: {exc}") from None
    twice = sorted({repr(v) for v in out if out.count(v) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{key}: value(s) {', '.join(twice)} given twice (each would train the "
                                         f"same adapter)")
    return key, tuple(out)


def sweep_label(value) -> str:
    """A swept value as it appears in an adapter's name: repr, '.' -> 'p', '-' -> 'm', '+' dropped."""
    return repr(value).replace("+", "").replace(".", "p").replace("-", "m")
