"""The by-name entry points over the typed configuration (configuration.config_of and the modules
that call it): what callers not yet converted pass (parse_args' namespace, an OptionView) gives
exactly what the typed functions give for the same command line, and anything else is refused by
name."""

from __future__ import annotations

import pytest

from elastic_kernels.api.finetune.configuration import config_of
from elastic_kernels.api.finetune.models import lora_config, lora_config_of, target_list, targets_of
from elastic_kernels.api.finetune.options import parse_args, parse_config
from elastic_kernels.api.finetune.pipeline_layout import compare_pp_is_main, compare_pp_repeats_main
from elastic_kernels.api.finetune.policy import elastic_policy, format_fields, policy_of, quant_fields

ARGVS = [
    ["--model", "tiny"],
    ["--model", "tiny", "--keep-ratio", "0.5", "--persist-ratio", "0.25", "--chunk-kib", "64",
     "--weight-format", "nf4", "--quant-nested", "--lora-targets", "q_proj,v_proj", "--seed", "7"],
    ["--model", "tiny", "--weight-format", "int8", "--quant-block", "64", "--host-fraction", "0.5",
     "--lora-targets", "all-linear"],
    ["--model", "tiny", "--pp", "2", "--compare-pp", "2"],
]


def test_config_of_each_kind():
    cfg = parse_config(["--model", "tiny", "--lora-r", "4"])
    assert config_of(cfg) is cfg
    assert config_of(cfg.options()) is cfg
    ns = parse_args(["--model", "tiny", "--lora-r", "4"])
    assert config_of(ns).lora == cfg.lora and config_of(ns).training == cfg.training
    with pytest.raises(TypeError, match=r"not dict$"):
        config_of({"lora_r": 4})


@pytest.mark.parametrize("argv", ARGVS, ids=[" ".join(a[2:]) or "defaults" for a in ARGVS])
def test_by_name_equals_typed(argv):
    cfg, ns = parse_config(argv), parse_args(argv)
    for world_size in (None, 1, 2):
        typed = elastic_policy(cfg, None, world_size=world_size)
        assert policy_of(ns, None, world_size=world_size) == typed
        assert policy_of(cfg.options(), None, world_size=world_size) == typed
    assert policy_of(ns, 1 << 20, "host", 2) == elastic_policy(cfg, 1 << 20, "host", 2)
    assert quant_fields(ns) == format_fields(cfg.weights)
    assert lora_config_of(ns) == lora_config(cfg.lora, cfg.training.seed)
    assert target_list(ns) == target_list(cfg.lora) == targets_of(cfg.lora)
    assert compare_pp_is_main(ns) == compare_pp_repeats_main(cfg.pipeline, cfg.planner)


def test_the_typed_policy_reads_the_options():
    """An independent reading of the second command line: the fields the options set."""
    cfg = parse_config(ARGVS[1])
    p = elastic_policy(cfg, None)
    assert (p.chunk_bytes, p.keep_ratio, p.persist_ratio) == (64 << 10, 0.5, 0.25)
    assert (p.weight_format, p.quant_nested) == ("nf4", True)
    lc = lora_config(cfg.lora, cfg.training.seed)
    assert lc.target_modules == ("q_proj", "v_proj") and lc.seed == 7
    assert compare_pp_repeats_main(parse_config(ARGVS[3]).pipeline, parse_config(ARGVS[3]).planner)
