"""The pipeline layouts the CLI's options describe: pure functions of the options, the world
size and the model's configuration, which prepare() checks before any process group exists and
the pipelined engine (pipelined.py) builds from. Nothing here imports the engines or the job."""

from __future__ import annotations

from ..pipeline import PipelineError, PipelineLayout
from ..pipeline.hf_packs import ARCHITECTURES
from .configuration import FinetuneConfig, PipelineConfig, PlannerConfig, TrainingConfig, config_of
from .errors import FinetuneError


def layer_costs(config, seq_len: int) -> tuple[list[float], float, float]:
    """FLOPs per token of each decoder layer, of the embeddings and of the head (norm, lm_head,
    loss), from the model's configuration: the balance of the stage boundaries ([Note: packs,
    stages and placement] in python_api/planner/pipeline.py). A decoder layer is its GEMMs (2
    x its linear weights) plus causal attention (2 x seq x hidden); the head 2 x vocab x hidden;
    an embedding lookup moves bytes, it does not multiply (0)."""
    h = int(getattr(config, "hidden_size", None) or config.n_embd)
    kind = config.model_type
    if kind == "llama":
        heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
        kv_dim = h // heads * kv
        weights = 2 * h * h + 2 * h * kv_dim + 3 * h * config.intermediate_size
        n_layers = config.num_hidden_layers
    elif kind == "gpt2":
        inner = getattr(config, "n_inner", None) or 4 * h
        weights = 4 * h * h + 2 * h * inner
        n_layers = config.n_layer
    else:
        raise FinetuneError(f"--pp: pipelines support the causal LMs of {', '.join(sorted(ARCHITECTURES))} "
                            f"(model_type), not model_type {kind!r}")
    per_layer = 2.0 * weights + 2.0 * seq_len * h
    return [per_layer] * n_layers, 0.0, 2.0 * config.vocab_size * h


def layout_of(training: TrainingConfig, pipeline: PipelineConfig, world_size: int, pp: int, config,
              option: str = "--pp") -> tuple[PipelineLayout, int]:
    """The pipeline layout the training and pipeline options describe, and the micro-batch size
    ([Note: the pipelined run and the global batch]). Raises FinetuneError naming the option
    (`option`: --pp, or --compare-pp for the comparison)."""
    t, p = training, pipeline
    share = t.micro_batch * t.grad_accum * pp
    m = p.micro_batches or t.grad_accum * pp
    if share % m:
        raise FinetuneError(f"--micro-batches {m} does not divide the {share} sequences of each dp group's share of "
                            f"the global batch (--micro-batch {t.micro_batch} x --grad-accum {t.grad_accum} x "
                            f"{option} {pp}); divisors: {[d for d in range(1, share + 1) if share % d == 0]}")
    costs, first, last = layer_costs(config, t.seq_len)
    try:
        layout = PipelineLayout.build(world_size, pp, len(costs), p.schedule, m,
                                      pack_size=None if p.pack_size == "auto" else p.pack_size,
                                      layer_costs=costs, first_cost=first, last_cost=last,
                                      residency=p.pack_residency, window=p.pack_window)
    except PipelineError as exc:
        raise FinetuneError(f"{option} {pp}: {exc}") from exc
    return layout, share // m


# [Note: the pipelines the options describe, checked in prepare]
# The layouts of the pipelined runs of a job (--pp N without --plan auto, --compare-pp N) are
# pure functions of the options, the world size and the model's config, so prepare() builds them
# on every rank before the process group exists: a layout that cannot be built is refused there,
# naming the option that asked for it (--compare-pp 3 on 2 ranks was reported as --pp 3, issue
# 31). --pack-size is the most layers a pack holds: the layers are balanced over
# ceil(layers / --pack-size) packs, so --pack-size 3 on 4 layers runs 2 packs of 2. That is kept
# (a refusal would reject every layer count the size does not divide) but said, as a notice on
# rank 0 and in summary.json, with the packs that run.

def pipeline_notices(cfg: FinetuneConfig, world_size: int, config) -> list[str]:
    """See [Note: the pipelines the options describe, checked in prepare]: the configuration's
    pipeline, planner and training groups. Raises FinetuneError naming the option whose layout
    cannot be built."""
    p = cfg.pipeline
    runs = []
    if p.pp != "auto" and p.pp > 1 and cfg.planner.plan != "auto":
        runs.append(("--pp", p.pp))
    if p.compare_pp is not None and not compare_pp_repeats_main(p, cfg.planner):
        runs.append(("--compare-pp", p.compare_pp))
    out = []
    for option, pp in runs:
        layout, _ = layout_of(cfg.training, p, world_size, pp, config, option)
        sizes = [layout.boundaries[k + 1] - layout.boundaries[k] for k in range(layout.n_packs)]
        if p.pack_size != "auto" and set(sizes) != {p.pack_size}:
            out.append(f"--pack-size {p.pack_size} with {option} {pp}: the {layout.boundaries[-1]} decoder layers "
                       f"run as {layout.n_packs} packs of {'/'.join(map(str, sizes))} layers (a pack holds at most "
                       f"--pack-size layers; the layers are balanced over ceil(layers / --pack-size) packs)")
    return out


def compare_pp_repeats_main(pipeline: PipelineConfig, planner: PlannerConfig) -> bool:
    """--compare-pp N with a main run of --pp N (not planned): the comparison would train the
    same run again ([Note: options a run ignores])."""
    return pipeline.compare_pp is not None and planner.plan != "auto" and pipeline.pp == pipeline.compare_pp


def compare_pp_is_main(options) -> bool:
    """compare_pp_repeats_main of options held by name (parse_args' namespace or an
    OptionView): what runner.comparison_builds still passes."""
    c = config_of(options)
    return compare_pp_repeats_main(c.pipeline, c.planner)
