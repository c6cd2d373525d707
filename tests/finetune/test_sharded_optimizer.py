"""The CLI's elastic engine below a full cache shards the adapters' AdamW state (ZeRO stage 1,
[Note: sharded optimizer state] in python_api/distributed/zero.py): against the same engine
with the replicated AdamW, in one gloo process group, the losses and adapters are the same
bits, each rank holds only its share of the moments, and the step's gathered bytes (the
frozen weights' and the updated adapters') equal the independent all-gather counter's."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

TINY = [
    "--model", "tiny", "--hidden-size", "32", "--intermediate-size", "48", "--num-layers", "2", "--num-heads", "4",
    "--num-kv-heads", "2", "--seq-len", "24", "--micro-batch", "2", "--grad-accum", "2", "--chunk-kib", "1",
    "--lora-r", "4", "--lora-alpha", "8", "--lr", "1e-2", "--no-progress", "--sample-tokens", "0",
]
STEPS = 3


def _worker(rank, world_size, save_dir):
    from elastic_kernels.api.distributed.zero import ShardedOptimizer
    from elastic_kernels.api.finetune.engines import ElasticEngine
    from elastic_kernels.api.finetune.job import prepare
    from elastic_kernels.api.finetune.loop import train
    from elastic_kernels.api.finetune.measure import AllGatherCounter, PeakMemory
    from elastic_kernels.api.finetune.options import parse_args
    from elastic_kernels.api.nn import adapter_state_dict

    args = parse_args(TINY + ["--steps", str(STEPS), "--pool-budget", "0", "--save-dir", save_dir, "--overwrite"])
    job = prepare(args, rank, world_size, rank)
    job.memory = PeakMemory(job.device)
    out = {}
    with AllGatherCounter() as counter:
        for name in ("sharded", "replicated", "full cache"):
            engine = ElasticEngine(job, None) if name == "full cache" else ElasticEngine(job, 0)
            sharded = isinstance(engine.optimizer, ShardedOptimizer)
            if name == "replicated":
                engine.optimizer = None  # the loop's AdamW over every adapter
            result = train(job, engine, counter, primary=False)
            adapters = adapter_state_dict(engine.model)
            moments = 2 * sum(p.numel() * p.element_size() for _, p in engine.params())
            out[name] = dict(sharded=sharded, losses=result["losses"], adapters={k: v.clone() for k, v in adapters.items()},
                             gathered=result["allgather_bytes_per_step"], counted=result["allgather_bytes_counted_per_step"],
                             optimizer=result.get("optimizer_allgather_bytes_per_step"),
                             state=result.get("optimizer_state_bytes"), moments=moments,
                             params=[n for n, _ in engine.params()],
                             owned=[n for n, p in engine.params() if engine.optimizer is not None and any(p is q for q in engine.optimizer.owned)])
            engine.close()
            del engine
    return out


def test_the_engine_shards_adamw_below_a_full_cache(tmp_path):
    W = 2
    runs = run_distributed(_worker, W, str(tmp_path / "out"), timeout=300)
    owned = []
    for r in runs:
        s, rep, full = r["sharded"], r["replicated"], r["full cache"]
        assert s["sharded"] and rep["sharded"] and not full["sharded"]
        # The same bits as the replicated AdamW at the same budget.
        assert s["losses"] == rep["losses"]
        assert s["adapters"].keys() == rep["adapters"].keys()
        for k in s["adapters"]:
            assert torch.equal(s["adapters"][k], rep["adapters"][k]), k
        # Its share of the moments only (less the per-parameter fp32 step counters), and the
        # ranks' shares are disjoint and cover every adapter.
        state = s["state"] - 4 * len(s["owned"])
        assert 0 < state < s["moments"], (state, s["moments"])
        owned += s["owned"]
        # Every step all-gathers the updated adapters, counted by the independent counter too.
        assert s["gathered"] == s["counted"]
        assert len(s["optimizer"]) == STEPS and min(s["optimizer"]) > 0 and len(set(s["optimizer"])) == 1
        assert [a - b for a, b in zip(s["gathered"], s["optimizer"])] == rep["gathered"] == rep["counted"]
        # A full cache keeps DDP's shape: the replicated AdamW, nothing gathered after step 1.
        assert full["optimizer"] is None and full["gathered"][1:] == [0] * (STEPS - 1)
    assert sum(r["sharded"]["state"] - 4 * len(r["sharded"]["owned"]) for r in runs) == runs[0]["sharded"]["moments"]
    assert sorted(owned) == sorted(runs[0]["sharded"]["params"])  # each adapter on one rank
