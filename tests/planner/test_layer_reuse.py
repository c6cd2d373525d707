"""Profiling identical layers once ([Note: profiling identical layers once] in
python_api/planning/layer_reuse.py), on the embedded Llama with 6 identical decoder layers at
world size 1 with the frozen weights in the host store (so that residency is planned).

- What profiling costs, counted rather than timed (robust on a loaded machine): the forward
  calls of each decoder layer during `measure_profile`. With reuse only layers 0 (a class of
  its own: the first) and 1-2 (the two representatives of layers 1-5) run, each as often as
  every layer runs when all are profiled (the same steps): half the layer forwards here, 3
  of 30 layers on the real model.
- The profile is the whole model's either way: the same units and weights, byte counts equal
  to the all-layers profile's (shapes, not time), the same least memory; the plans agree at
  the least memory and with memory for everything, and elsewhere the reuse plan is no slower
  under the all-layers profile's model than (1 + d) / (1 - d) x that profile's own plan, d
  the largest relative difference of any duration between the two profiles (the argument of
  tests/planner/test_profile_bound.py: two all-layers profiles on this shared machine differ
  by as much).
- ELASTIC_PROFILE_ALL_LAYERS=1 profiles every layer; a bad value is refused naming it; a model
  whose loop does not take the cut list is profiled whole, with a warning.
About 20-60 s (three profiles of a tiny model; more on a loaded machine).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.needs_ext]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAYERS, SEQ, MB = 6, 16, 2


def _model():
    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic
    from elastic_kernels.api.finetune.models import embedded_config, embedded_model

    cfg = embedded_config(64, 128, LAYERS, 4, 2)
    model = convert_to_elastic(embedded_model(cfg, 0), LoRAConfig(r=4, alpha=8, target_modules=TARGETS),
                               ElasticPolicy(chunk_bytes=4096, weights_on="host"))
    model.train()
    return model, cfg


def _profile_counting(model, ids, **kwargs):
    """measure_profile, and the forward calls of each decoder layer it made."""
    from elastic_kernels.api.planning.measure import measure_profile

    counts = [0] * len(model.model.layers)
    handles = [layer.register_forward_pre_hook(lambda *_a, i=i: counts.__setitem__(i, counts[i] + 1))
               for i, layer in enumerate(model.model.layers)]
    report: dict = {}
    try:
        profile = measure_profile(model, [ids], capacity_bytes=1 << 30, report=report, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return profile, counts, report


@pytest.fixture(scope="module")
def profiled():
    torch.manual_seed(0)
    model, cfg = _model()
    ids = torch.randint(0, cfg.vocab_size, (MB, SEQ), generator=torch.Generator().manual_seed(1))
    reuse = _profile_counting(model, ids)
    whole = _profile_counting(model, ids, all_layers=True)
    return model, ids, reuse, whole


def test_each_class_of_identical_layers_is_profiled_once(profiled):
    model, _, (_, counts, report), (_, all_counts, all_report) = profiled
    names = [f"model.layers.{i}" for i in range(LAYERS)]
    assert report["layer_classes"] == [[[names[0]], names[1:]]]  # one list, two classes
    assert [u for u in report["profiled_units"] if u.startswith("model.layers.")] == names[:3]
    assert all_report["layer_classes"] == [] and all_report["profiled_units"][:LAYERS] == names
    n = all_counts[0]
    assert n > 0 and all_counts == [n] * LAYERS, all_counts  # every layer once per step
    assert counts == [n] * 3 + [0] * (LAYERS - 3), (counts, all_counts)  # the same steps, 3 layers
    print(f"layer forwards while profiling: reuse {sum(counts)} ({counts}), all layers {sum(all_counts)}")
    # the model is whole again, and trains
    assert list(model.model.layers._modules) == [str(i) for i in range(LAYERS)]


def test_the_reused_profile_is_the_whole_models_and_plans_like_it(profiled):
    from elastic_kernels.api.planner import plan_from_profile, step_cost
    from elastic_kernels.api.planner.search import least_memory
    from tests.planner.test_profile_bound import _durations

    _, _, (reuse, _, _), (whole, _, _) = profiled
    strip = ("fwd_s_fixed", "fwd_s_per_token", "bwd_s_fixed", "bwd_s_per_token")
    rd, wd = reuse.to_dict(), whole.to_dict()
    assert [{k: v for k, v in x.items() if k not in strip} for x in rd["layers"]] == \
        [{k: v for k, v in x.items() if k not in strip} for x in wd["layers"]]
    assert reuse.layers[0].weights[0].backward is False and reuse.layers[1].weights[0].backward is True
    for field in ("static_bytes", "adapter_grad_bytes", "page_bytes", "capacity_bytes", "seq_len"):
        assert getattr(reuse, field) == getattr(whole, field), field
    for field in ("act_bytes_per_token", "peak_bytes_per_token"):
        assert getattr(reuse.outside, field) == getattr(whole.outside, field), field
    # Layers of a class carry one set of times (the median of its representatives').
    assert len({(x.fwd_s_fixed, x.fwd_s_per_token, x.bwd_s_fixed, x.bwd_s_per_token) for x in reuse.layers[1:LAYERS]}) == 1
    G = 2 * MB
    pairs = list(zip(_durations(whole, (1, 2)), _durations(reuse, (1, 2))))
    d = max(abs(a - b) / max(a, b) for (_, a), (_, b) in pairs if max(a, b) > 0)
    lo = least_memory(whole, G, prefetch_depth=None)
    lo_reuse = least_memory(reuse, G, prefetch_depth=None)
    # The backward workspace is measured on the cut model's windows: the same windows of the
    # same layers (layers 0-2 hold what they hold in the whole model), so the same figure up to
    # the profiler's allocation events; allowed 1% of the least memory.
    assert abs(lo_reuse - lo) <= 0.01 * lo, (lo_reuse, lo, reuse.outside, whole.outside)
    keys = ("micro_batch", "prefetch_depth", "host_fraction", "offload_activations", "layers")
    ratios = []
    for mem in (max(lo, lo_reuse), lo * 11 // 10, lo * 13 // 10, 1 << 30):
        pw = plan_from_profile(whole, mem, G, prefetch_depth=None)
        pr = plan_from_profile(reuse, mem, G, prefetch_depth=None)
        if all(pw.to_dict()[k] == pr.to_dict()[k] for k in keys):
            continue
        assert mem != 1 << 30, "with memory for everything both keep everything"
        ratio = step_cost(whole, pr.choices(), pr.accumulation).step_s / pw.predicted_step_time_s
        ratios.append(round(ratio, 3))
        if d < 1:  # otherwise this machine's timing noise leaves nothing to check
            assert ratio <= (1 + d) / (1 - d), (mem, ratio, d)
    print(f"d = {d:.3f}; plans that differ: step time under the all-layers profile / its own plan's {ratios}")


def test_the_env_profiles_every_layer_and_a_bad_value_is_refused(monkeypatch):
    from elastic_kernels.api.planning.layer_reuse import ALL_LAYERS_ENV, all_layers_requested

    monkeypatch.setenv(ALL_LAYERS_ENV, "1")
    assert all_layers_requested(None) is True and all_layers_requested(False) is False
    monkeypatch.setenv(ALL_LAYERS_ENV, "0")
    assert all_layers_requested(None) is False
    monkeypatch.setenv(ALL_LAYERS_ENV, "sometimes")
    with pytest.raises(ValueError, match=r"ELASTIC_PROFILE_ALL_LAYERS='sometimes'"):
        all_layers_requested(None)
    with pytest.raises(ValueError, match="all_layers must be True, False or None"):
        all_layers_requested(1)


def test_classes_see_a_layer_that_differs_and_a_model_that_ignores_the_cut(profiled):
    from elastic_kernels.api import runtime_of
    from elastic_kernels.api.planning.layer_reuse import layer_classes

    model, ids, _, _ = profiled
    rt = runtime_of(model)
    names = [f"model.layers.{i}" for i in range(LAYERS)]
    # A setting that differs (layer 4's norm epsilon) makes a class of its own.
    norm = model.model.layers[4].input_layernorm
    eps = norm.variance_epsilon
    norm.variance_epsilon = eps * 2
    try:
        (lc,) = layer_classes(model, rt)
        assert lc.classes == ((names[0],), (names[1], names[2], names[3], names[5]), (names[4],))
        assert lc.profiled == (names[0], names[1], names[2], names[4])
    finally:
        norm.variance_epsilon = eps

    # A model whose loop indexes every layer by number cannot run cut: profiled whole, warned.
    layers = model.model.layers
    original = type(model.model).forward

    def by_index(self, *args, **kwargs):
        for i in range(LAYERS):
            _ = layers[i]  # IndexError on the cut list
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(model.model), "forward", by_index)
        with pytest.warns(UserWarning, match="profiling every layer: the first step of the model cut"):
            profile, counts, _ = _profile_counting(model, ids)
    assert [x.name for x in profile.layers][:LAYERS] == names and min(counts) > 0
