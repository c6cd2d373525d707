"""Profiling within a memory bound (issue 17, defect 2) and byte counts reduced over the ranks
(defect 9), on the CLI's demo model shape (embedded Llama, hidden 256; 8 layers and 32 tokens,
so that the frozen weights dominate the memory) on 2 gloo ranks with the frozen weights in the
node's host store (weights_on="host": the pool is the only device copy of a frozen weight, so
keeping them resident is what costs).

- Under a cap below the frozen bytes (and far below what keeping every frozen weight resident
  needs), every profiling step stays below the cap: the pool's high-water mark during
  profiling, and the measured tensor peak (`measure_peak_bytes`) of a step under each
  residency profiling used (its rounds, replayed). Before the fix profiling made every chunk
  resident whatever the cap.
- The profile taken under that cap gives the plan the unbounded profile gives, at several
  memory sizes: identical choices, or a plan no slower under the unbounded profile's model
  than (1 + d) / (1 - d) x its own, d the largest relative difference of any duration between
  the two profiles (every time of the cost model is max-plus and homogeneous in the durations,
  so each plan's time under one profile is within a factor 1 +- d of the other's; checked
  when d < 1: two unbounded profiles on this shared 2-core machine differ by up to 4x in a
  unit's time). The byte counts, hence feasibility and the least memory, are identical, and
  with memory for everything both plans keep everything.
- Rank 1 saves an extra tensor in one layer: both ranks' profiles carry rank 1's (the larger)
  byte counts. Before the fix the profile was rank 0's.
About 20-40 s (two profiles and the replays on 2 ranks; more on a loaded machine).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQ, MB = 16, 2
LAYERS = 8
EXTRA_LAYER = "model.layers.0"  # its own group already (its q/k/v have no backward use)


def _worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic, runtime_of
    from elastic_kernels.api.finetune.models import embedded_config, embedded_model
    from elastic_kernels.api.planner.memory import Choices, memory_curve
    from elastic_kernels.api.planning.measure import measure_profile
    from elastic_kernels.api.planning.peaks import measure_peak_bytes

    torch.set_num_threads(1)
    cfg = embedded_config(256, 688, LAYERS, 8, 4)
    model = convert_to_elastic(embedded_model(cfg, 0), LoRAConfig(r=8, alpha=16, target_modules=TARGETS),
                               ElasticPolicy(chunk_bytes=256 << 10, weights_on="host"))
    model.train()
    rt = runtime_of(model)
    extra = 0
    if rank == 1:  # one more tensor saved for backward in one layer, on this rank only
        def save_more(_module, _args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            scaled = hidden * torch.full_like(hidden, 1.0)  # saves the full_like tensor
            return (scaled,) + tuple(output[1:]) if isinstance(output, tuple) else scaled
        model.get_submodule(EXTRA_LAYER).register_forward_hook(save_more)
        extra = MB * SEQ * cfg.hidden_size * 4
    ids = torch.randint(0, cfg.vocab_size, (MB, SEQ), generator=torch.Generator().manual_seed(rank))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        for p in model.parameters():
            p.grad = None

    unbounded_report, bounded_report = {}, {}
    # Every layer profiled: this file checks the rounds of the bound on the whole model (identical
    # layers profiled once: tests/planner/test_layer_reuse.py).
    unbounded = measure_profile(model, [ids], capacity_bytes=1 << 30, steps=3, report=unbounded_report,
                                all_layers=True)
    frozen = sum(et.nbytes for et in rt.tensors)
    keep_all = memory_curve(unbounded, Choices.uniform(unbounded, MB, 1.0, prefetch_depth=0)).peak_bytes
    # A cap with room for about two units beyond streaming every weight: below the frozen bytes.
    unit = max(sum(et.num_chunks for et in rt.tensors if et.unit == u) for u in {et.unit for et in rt.tensors})
    cap = int((unbounded_report["least_bytes"] + 2.2 * unit * rt.page_bytes()) / 0.95)
    rt.pool.reset_peak()
    bounded = measure_profile(model, [ids], capacity_bytes=cap, steps=3, report=bounded_report, all_layers=True)
    pool_peak = rt.pool.stats()["peak_in_use_bytes"]
    # A bound below what streaming every weight needs: refused with ProfileBoundError (the CLI
    # then profiles half the micro-batch), and the runtime's residency is as it was.
    from elastic_kernels.api.planning.measure import ProfileBoundError

    before = [(et.keep_chunks, et.persist_chunks) for et in rt.tensors]
    too_small = None
    too_small_bound = int(bounded_report["least_bytes"] * 0.9)
    try:
        measure_profile(model, [ids], capacity_bytes=too_small_bound, steps=1, all_layers=True)
    except ProfileBoundError as exc:
        too_small = (str(exc), exc.needed_bytes, exc.bound_bytes, too_small_bound, bounded_report["least_bytes"])
    restored = before == [(et.keep_chunks, et.persist_chunks) for et in rt.tensors]
    # Replay every residency profiling used and measure a step's tensor peak under it.
    measured = []
    names = [layer.name for layer in unbounded.layers]
    rt.set_prefetch_depth(0)
    for resident in [[]] + [r["resident"] for r in bounded_report["rounds"]]:
        for et in rt.tensors:
            n = et.num_chunks if et.unit in resident else 0
            rt.set_residency(et, n, n)
        rt.set_pool_budget(rt.page_bytes() * sum(et.num_chunks for et in rt.tensors if et.unit in resident))
        step()
        measured.append(measure_peak_bytes(model, step))
    return {"cap": cap, "keep_all": keep_all, "frozen": frozen, "pool_peak": pool_peak, "measured": measured,
            "rounds": bounded_report["rounds"], "unbounded": unbounded.to_dict(), "bounded": bounded.to_dict(),
            "extra": extra, "names": names, "local": unbounded_report["local_bytes"], "too_small": too_small,
            "restored": restored}


@pytest.fixture(scope="module")
def reports():
    return run_distributed(_worker, 2, timeout=900)


def test_profiling_stays_within_the_bound(reports):
    for rank, r in enumerate(reports):
        assert r["cap"] < r["frozen"] < r["keep_all"], "the cap must be below the frozen bytes"
        assert r["pool_peak"] <= r["cap"], (rank, r["pool_peak"], r["cap"])
        for resident, peak in zip([[]] + [x["resident"] for x in r["rounds"]], r["measured"]):
            assert peak <= r["cap"], f"rank {rank}: a step with {resident} resident peaked at {peak} > cap {r['cap']}"
        # every unit was timed resident (each group has a member that fits), in one round here
        timed = [u for x in r["rounds"] for u in x["timed"]]
        resident = [u for x in r["rounds"] for u in x["resident"]]
        assert set(timed) <= set(resident) and 0 < len(resident) < len(r["names"]), r["rounds"]
        print(f"rank {rank}: cap {r['cap'] / 2**20:.2f} MiB (keeping everything {r['keep_all'] / 2**20:.2f} MiB, "
              f"frozen {r['frozen'] / 2**20:.2f} MiB); pool peak {r['pool_peak'] / 2**20:.2f} MiB; step peaks "
              f"{[round(p / 2**20, 2) for p in r['measured']]} MiB; rounds {r['rounds']}")


def _durations(profile, micro_batches):
    """Every duration the cost model uses for plans at these micro-batches, as (name, seconds):
    each unit's forward and backward, the outside, and each link at the smallest and largest
    transfer a use makes (a link's time is affine in the bytes, so its ratio between two
    profiles is extremal at the ends of that range)."""
    out = []
    for m in micro_batches:
        T = m * profile.seq_len
        for layer in profile.layers:
            out += [(f"{layer.name}.fwd@{T}", layer.fwd_s(T)), (f"{layer.name}.bwd@{T}", layer.bwd_s(T))]
        out += [(f"outside@{T}", (profile.outside.fwd_s_per_token + profile.outside.bwd_s_per_token) * T)]
    chunk = min(w.chunk_bytes for layer in profile.layers for w in layer.weights)
    unit = max(sum(w.chunk_bytes * w.chunks for w in layer.weights) for layer in profile.layers)
    links = [("h2d", profile.h2d)] if profile.weights_on == "host" else \
        [("gather", profile.gather_link()), ("h2d", profile.h2d)]
    for name, link in links:
        if link is not None:
            out += [(f"{name}@{b}", link.time(b)) for b in (chunk, unit)]
    if profile.world_size > 1:
        out.append(("allreduce", profile.allreduce.time(profile.adapter_grad_bytes)))
    return out


def test_bounded_profile_plans_like_the_unbounded_one(reports):
    from elastic_kernels.api.planner import Profile, plan_from_profile, step_cost
    from elastic_kernels.api.planner.search import least_memory

    r = reports[0]
    unbounded, bounded = Profile.from_dict(r["unbounded"]), Profile.from_dict(r["bounded"])
    bounded = dataclasses.replace(bounded, capacity_bytes=unbounded.capacity_bytes)
    # Byte counts are measurements of shapes, not of time: equal.
    strip = ("fwd_s_fixed", "fwd_s_per_token", "bwd_s_fixed", "bwd_s_per_token")
    assert [{k: v for k, v in x.items() if k not in strip} for x in r["unbounded"]["layers"]] == \
        [{k: v for k, v in x.items() if k not in strip} for x in r["bounded"]["layers"]]
    assert unbounded.static_bytes == bounded.static_bytes
    timing = ("fwd_s_per_token", "bwd_s_per_token")
    assert {k: v for k, v in r["unbounded"]["outside"].items() if k not in timing} == \
        {k: v for k, v in r["bounded"]["outside"].items() if k not in timing}
    G = 2 * MB
    pairs = list(zip(_durations(unbounded, (1, 2)), _durations(bounded, (1, 2))))
    d = max(abs(a - b) / max(a, b) for (_, a), (_, b) in pairs if max(a, b) > 0)
    worst = max(pairs, key=lambda p: abs(p[0][1] - p[1][1]) / max(p[0][1], p[1][1], 1e-300))
    lo = least_memory(unbounded, G, prefetch_depth=None)
    # Feasibility is a function of the bytes and of the order in which the search adds
    # recomputed layers, which follows the measured times (bytes freed per second of recompute:
    # problem._recompute_order); under load two profiles' times can order layer 0 (it saves one
    # more tensor on rank 1) differently and the least memories differ by that layer's bytes
    # (13,197,207 vs 13,214,453 seen). With the unbounded profile's layer times, the bounded
    # profile's bytes give the same least memory.
    same_times = dataclasses.replace(bounded, layers=tuple(
        dataclasses.replace(b, **{k: getattr(u, k) for k in strip}) for u, b in zip(unbounded.layers, bounded.layers)))
    assert least_memory(same_times, G, prefetch_depth=None) == lo
    keys = ("micro_batch", "prefetch_depth", "host_fraction", "offload_activations", "layers")
    same, ratios = 0, []
    lo = max(lo, least_memory(bounded, G, prefetch_depth=None))  # both fit (their own times' order)
    for mem in (lo, lo * 11 // 10, lo * 13 // 10, 1 << 30):
        pu = plan_from_profile(unbounded, mem, G, prefetch_depth=None)
        pb = plan_from_profile(bounded, mem, G, prefetch_depth=None)
        if all(pu.to_dict()[k] == pb.to_dict()[k] for k in keys):
            same += 1
            continue
        assert mem != 1 << 30, "with memory for everything both keep everything"
        ratio = step_cost(unbounded, pb.choices(), pb.accumulation).step_s / pu.predicted_step_time_s
        ratios.append(round(ratio, 3))
        if d < 1:  # otherwise this machine's timing noise leaves nothing to check
            assert ratio <= (1 + d) / (1 - d), (mem, ratio, d)
    print(f"largest relative duration difference between the two profiles d = {d:.3f} ({worst[0][0]}: "
          f"{worst[0][1]:.4f} s vs {worst[1][1]:.4f} s); identical plans at {same} of 4 memory sizes; the others' "
          f"step time under the unbounded profile / its own plan's: {ratios}")


def test_byte_counts_are_the_max_over_ranks(reports):
    a, b = reports
    assert a["unbounded"] == b["unbounded"] and a["bounded"] == b["bounded"], "the ranks hold different profiles"
    i = a["names"].index(EXTRA_LAYER)
    # rank 1 saved `extra` more bytes in that layer, rank 0 not: the profile has rank 1's
    acts = {name: layer["act_bytes_per_token"] for name, layer in zip(a["names"], a["unbounded"]["layers"])}
    bounded = {name: layer["act_bytes_per_token"] for name, layer in zip(a["names"], a["bounded"]["layers"])}
    assert acts == bounded
    # each rank's own count: rank 1 saw the extra tensor, rank 0 not; the profile has the larger
    mine, theirs = a["local"]["act"][i], b["local"]["act"][i]
    assert theirs == mine + b["extra"], (mine, theirs)
    assert acts[EXTRA_LAYER] * MB * SEQ == theirs
    assert a["local"]["act"][:i] + a["local"]["act"][i + 1:] == b["local"]["act"][:i] + b["local"]["act"][i + 1:]
    for r in (a, b):
        assert r["unbounded"]["layers"][i]["act_bytes_per_token"] == acts[EXTRA_LAYER]


def test_a_bound_below_streaming_is_refused_by_name(reports):
    """measure_profile under a bound below the memory model's figure for streaming every
    weight raises ProfileBoundError (what the CLI's planned run catches to profile a smaller
    micro-batch), on every rank alike, and leaves the residency as it found it."""
    for r in reports:
        assert r["too_small"] is not None, "a bound below streaming every weight was accepted"
        message, needed, bound, asked, least = r["too_small"]
        assert "streaming every weight at this micro-batch" in message, message
        # the error carries the figures it names: the bound asked for (the MIN over ranks of
        # the same value) and what the model says streaming needs, the same figure the
        # bounded run reported as its least_bytes (the same model on the same counts)
        assert bound == asked and needed > bound and f"needs {needed} bytes" in message, (message, needed, bound)
        assert needed == pytest.approx(least, rel=0.05), (needed, least)
        assert r["restored"], "the residency changed after the refused profile"


def test_profile_bound_error_keeps_its_figures_through_pickling():
    """The error crosses process boundaries (a spawned rank's exception, multiprocessing):
    unpickled, it has the same message and figures."""
    import pickle

    from elastic_kernels.api.planning.measure import ProfileBoundError

    exc = pickle.loads(pickle.dumps(ProfileBoundError("needs 5 bytes", 5, 3)))
    assert (str(exc), exc.needed_bytes, exc.bound_bytes) == ("needs 5 bytes", 5, 3)
