"""Plan for a synthetic profile of a named shape (no model is built):

    python -m elastic_kernels.api.planner --shape llama2-70b --ranks 8 --memory 40GB [--seq-len 4096]
        [--global-batch G] [--device-spec a100-40g-pcie|h100-sxm] [--host-tier] [--weights-on device|host]
        [--weight-format none|nf4|int8 [--quant-block-size B] [--quant-nested]] [--json]

prints the plan table (or the plan as JSON) and `planning_seconds`.
"""

from __future__ import annotations

import argparse
import re
import sys

from .profile import ProfileError
from .search import PlanningError, plan_from_profile
from .shapes import DEVICES, SHAPES, synthetic_profile

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_bytes(text: str) -> int:
    """'40GB' (10^9), '40GiB' (2^30), '1.5GiB', '42949672960' -> bytes (an int > 0)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes as an int or with a unit (KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    value = int(float(m.group(1)) * _UNITS[unit]) if "." in m.group(1) else int(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_kernels.api.planner",
                                     description="Plan residency, recompute and micro-batches for a synthetic "
                                                 "profile of a Llama-2 shape (no model is built).")
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--ranks", required=True, type=_positive_int, help="world size")
    parser.add_argument("--memory", required=True, type=parse_bytes,
                        help="device memory per rank the plan may use: 40GB, 40GiB or bytes")
    parser.add_argument("--seq-len", type=_positive_int, default=4096)
    parser.add_argument("--global-batch", type=_positive_int, default=None,
                        help="sequences per optimizer step over all ranks (default: 8 per rank)")
    parser.add_argument("--device-spec", choices=sorted(DEVICES), default="a100-40g-pcie")
    parser.add_argument("--margin", type=float, default=0.05, help="fraction of --memory left unplanned")
    parser.add_argument("--prefetch-depth", type=int, default=1)
    parser.add_argument("--granularity", choices=("chunks", "eighths"), default="chunks")
    parser.add_argument("--host-tier", action="store_true",
                        help="the profile has the host tier (PCIe host link, a host store, offloadable activations): "
                             "the planner also chooses the host fraction and activation offload")
    parser.add_argument("--weights-on", choices=("device", "host"), default="device",
                        help="where the frozen weights' source of truth lives (host implies --host-tier)")
    parser.add_argument("--weight-format", choices=("none", "nf4", "int8"), default="none",
                        help="the frozen weights stored quantized (the plan keeps this format: the planner never "
                             "chooses it)")
    parser.add_argument("--quant-block-size", type=_positive_int, default=None,
                        help="weights per quantization block (default: 64 for nf4, 256 for int8)")
    parser.add_argument("--quant-nested", action="store_true", help="nf4: double quantization of the scales")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    global_batch = args.global_batch if args.global_batch is not None else 8 * args.ranks
    try:
        profile = synthetic_profile(args.shape, args.ranks, args.seq_len, args.device_spec, host_tier=args.host_tier,
                                    weights_on=args.weights_on,
                                    weight_format=None if args.weight_format == "none" else args.weight_format,
                                    quant_block_size=args.quant_block_size, quant_nested=args.quant_nested)
        plan = plan_from_profile(profile, args.memory, global_batch, margin=args.margin,
                                 prefetch_depth=args.prefetch_depth, granularity=args.granularity)
    except (PlanningError, ProfileError, ValueError) as exc:
        parser.error(str(exc))
    if args.json:
        print(plan.to_json())
    else:
        print(plan.table())
    print(f"planning_seconds {plan.planning_seconds:.4f}", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
