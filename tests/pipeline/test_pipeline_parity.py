"""Pipelined runs against the pp = 1 reference, and their exact traffic.

Per configuration (a product covering every schedule that runs on gloo, pack sizes 1 and > 1,
pp 2 and 4, dp 1 and 2, every pack residency, weights on the device and in the host store,
HF Llama and GPT-2), two steps, each checked against the reference of the same global batch
([Note: the reference and the tolerance] in tests/pipeline/_common.py):
- the loss and every adapter gradient of this rank's packs;
- the bytes its packs all-gathered and copied host -> device in the step, equal to the
  analytic value computed here from the weights' shapes (independently of the runtime's
  layout code): each load of pack k moves its forward weights (or, for the backward load of
  a "phase" pack, the weights with a backward use) once, (dp - 1) x slice bytes per chunk
  from peers or the chunks' real bytes from the host store, as often per step as
  `PipelineLayout.loads_per_step` says (once at full residency);
- P2P bytes sent and received: m micro-batches of [micro_batch, seq, hidden] fp32 per pack
  boundary and direction;
- the order the schedule ran equals the planner's model of it (`schedule_order`), and the
  pool bytes held after every action equal the residency model's (`residency_trace`);
- the frozen bytes the rank holds are its packs' shards: 1/dp of each chunk.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.pipeline._common import (
    MBS,
    SEQ,
    assert_grads_close,
    global_batch,
    lora_of,
    randomize_lora_b,
    reference_of,
    reference_step,
    tiny_model,
)

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

CHUNK = 4096  # 16 rows of 64 fp32: 2-3 chunks per weight, a ragged last chunk for c_attn (192 rows)
FP32 = 4

# (model, layers, pp, schedule, micro-batches, pack size, residency, window, weights_on)
CONFIGS_2 = [
    ("llama", 4, 2, "gpipe", 2, None, "step", 1, "device"),
    ("llama", 4, 2, "1f1b", 4, None, "step", 1, "host"),
    ("llama", 4, 2, "looped-bfs", 2, 1, "phase", 1, "host"),
    ("llama", 4, 2, "interleaved-1f1b", 4, 1, "step", 2, "host"),
    ("gpt2", 4, 2, "1f1b", 2, None, "persistent", 1, "host"),
    ("gpt2", 4, 2, "looped-bfs", 2, 1, "transient", 1, "host"),
]
CONFIGS_4 = [
    ("llama", 8, 2, "interleaved-1f1b", 4, 2, "step", 1, "device"),
    ("llama", 8, 2, "looped-bfs", 2, 1, "phase", 2, "device"),
    ("gpt2", 4, 2, "gpipe", 2, None, "step", 1, "host"),
    ("gpt2", 8, 2, "looped-bfs", 3, 2, "transient", 0, "device"),
    ("llama", 8, 4, "1f1b", 4, None, "step", 1, "host"),
    ("llama", 8, 4, "interleaved-1f1b", 4, 1, "phase", 1, "host"),
    ("gpt2", 8, 4, "gpipe", 1, None, "persistent", 1, "host"),
]

# Weights whose input needs no gradient (the first layer reads the frozen embeddings): no
# backward use, so no backward load.
NO_BACKWARD = {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
               "transformer.h.0.attn.c_attn"}


def _weights(lm, targets) -> dict[str, tuple[int, int]]:
    """[out, in] of each elastic weight (a Conv1D stores [in, out])."""
    out = {}
    for name in targets:
        w = lm.get_submodule(name).weight
        out[name] = (w.shape[1], w.shape[0]) if type(lm.get_submodule(name)).__name__ == "Conv1D" else tuple(w.shape)
    return out


def _layout_of(rows: int, cols: int, dp: int):
    rpc = min(rows, CHUNK // (cols * FP32))
    chunks = -(-rows // rpc)
    slice_bytes = -(-(rpc * cols) // dp) * FP32
    return rpc, chunks, slice_bytes


def _expected(layout, dp, weights, pack_of, on, step_index):
    """Per local pack: (all-gather bytes, h2d bytes) in a step, and the forward / backward
    page bytes (for the residency trace)."""
    gather, h2d, fwd_pages, bwd_pages = {}, {}, {}, {}
    for k in range(layout.n_packs):
        names = [n for n in weights if pack_of(n) == k]
        page = max(-(-(_layout_of(*weights[n], dp)[0] * weights[n][1] * FP32) // 512) * 512 for n in names)
        per = {}
        for n in names:
            rows, cols = weights[n]
            rpc, chunks, slice_bytes = _layout_of(rows, cols, dp)
            per[n] = ((dp - 1) * slice_bytes * chunks, rows * cols * FP32, chunks)
        f_g = sum(v[0] for v in per.values())
        f_h = sum(v[1] for v in per.values())
        b_g = sum(v[0] for n, v in per.items() if n not in NO_BACKWARD)
        b_h = sum(v[1] for n, v in per.items() if n not in NO_BACKWARD)
        nf, nb = layout.loads_per_step(k)
        if step_index == 0 and layout.residency[k] == "persistent":
            nf, nb = 1, 0
        g, h = nf * f_g + nb * b_g, nf * f_h + nb * b_h
        local_only = dp == 1 and on == "device"
        gather[k] = 0 if on == "host" else g
        h2d[k] = h if on == "host" else 0
        if local_only:
            fwd_pages[k] = bwd_pages[k] = 0
        else:
            fwd_pages[k] = page * sum(v[2] for v in per.values())
            bwd_pages[k] = page * sum(v[2] for n, v in per.items() if n not in NO_BACKWARD)
    return gather, h2d, fwd_pages, bwd_pages


def _worker(rank, world_size, configs):
    import torch.distributed as dist

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.pipeline import PipelinedModel, PipelineLayout, pipeline_groups
    from elastic_kernels.api.planner.pipeline import residency_trace

    torch.set_num_threads(1)
    report = []
    for kind, L, pp, schedule, m, pack_size, residency, window, on in configs:
        what = f"{kind} {L} layers pp={pp} {schedule} m={m} pack={pack_size} {residency} w={window} {on}"
        groups = pipeline_groups(pp, "cpu", timeout_s=120)
        dp = groups.dp
        lm = tiny_model(kind, L)
        lora = lora_of(kind)
        ref = reference_of(lm, lora, CHUNK)
        layout = PipelineLayout.build(world_size, pp, L, schedule, m, pack_size=pack_size, residency=residency,
                                      window=window)
        pipe = PipelinedModel(lm, lora, ElasticPolicy(chunk_bytes=CHUNK, weights_on=on), layout, groups,
                              micro_batch_size=MBS, seq_len=SEQ, trace=True)
        randomize_lora_b(pipe.named_parameters())
        weights = _weights(tiny_model(kind, L), pipe.targets)
        registered = sorted(et.name for rt in pipe.runtimes.values() for et in rt.tensors)
        assert registered == sorted(n for n in weights if pipe._pack_of(n) in pipe.local), what
        # What the rank holds: 1/dp of each chunk of its packs' weights (weights on the device).
        held = sum(_layout_of(*weights[n], dp)[1] * _layout_of(*weights[n], dp)[2] for n in registered)
        assert pipe.frozen_bytes_held() == (held if on == "device" else 0), what
        n_packs = layout.n_packs
        act = MBS * SEQ * pipe.hidden_size * FP32
        for s in range(2):
            batch = global_batch(s, dp, m)
            loss = pipe.train_step(batch[groups.dp_rank])
            ref_loss, ref_grads = reference_step(ref, batch)
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), f"{what} step {s}: loss {loss} vs {ref_loss}"
            worst = assert_grads_close({n: p.grad for n, p in pipe.named_parameters()}, ref_grads, f"{what} step {s}")
            gather, h2d, fwd_pages, bwd_pages = _expected(layout, dp, weights, pipe._pack_of, on, s)
            st = pipe.last_step
            want_g = sum(gather[k] for k in pipe.local)
            want_h = sum(h2d[k] for k in pipe.local)
            assert st["allgather_bytes"] == want_g, f"{what} step {s}: all-gathered {st['allgather_bytes']}, expected {want_g}"
            assert st["h2d_bytes"] == want_h, f"{what} step {s}: host->device {st['h2d_bytes']}, expected {want_h}"
            sends = sum(m * act * ((k < n_packs - 1) + (k > 0)) for k in pipe.local)
            assert st["p2p_send_bytes"] == sends and st["p2p_recv_bytes"] == sends, \
                f"{what} step {s}: P2P sent {st['p2p_send_bytes']} received {st['p2p_recv_bytes']}, expected {sends}"
            assert pipe.residency.order == layout.order(groups.pp_rank), f"{what}: the schedule ran another order"
            _, after = residency_trace(layout, groups.pp_rank, fwd_pages, bwd_pages, first_step=s == 0)
            measured = [b for _, b in pipe.residency.trace.points]
            assert measured == after, f"{what} step {s}: pool bytes after each action {measured}, modelled {after}"
            total = torch.tensor([st["p2p_send_bytes"]], dtype=torch.int64)
            dist.all_reduce(total)
            assert int(total) == 2 * (n_packs - 1) * m * act * dp, what
            report.append((what, s, loss, ref_loss, worst, st["allgather_bytes"], st["h2d_bytes"], st["idle_fraction"]))
            with torch.no_grad():
                for _, p in pipe.named_parameters():
                    p -= 0.1 * p.grad
                for p in ref.parameters():
                    if p.requires_grad:
                        p -= 0.1 * p.grad
        pipe.close()
    return report


def _print(reports):
    for rank, rows in enumerate(reports):
        for what, s, loss, ref_loss, worst, g, h, idle in rows:
            print(f"rank {rank} {what} step {s}: loss {loss:.7f} (ref {ref_loss:.7f}), worst grad diff "
                  f"{worst:.2e} of scale, all-gather {g} B, h2d {h} B, idle {idle:.0%}")


def test_pipeline_matches_pp1_two_ranks():
    _print(run_distributed(_worker, 2, CONFIGS_2, timeout=900))


def test_pipeline_matches_pp1_four_ranks():
    _print(run_distributed(_worker, 4, CONFIGS_4, timeout=1200))
