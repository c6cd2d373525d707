"""Bad input stops every rank before step 1 with an error naming the problem; a stage that
fails mid-step ends every rank within the timeout ([Note: a stage that fails mid-step])."""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import tempfile
import time

import pytest
import torch

from tests._dist import run_distributed
from tests.pipeline._common import MBS, SEQ, global_batch, lora_of, tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]


def _error_of(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return None


def _bad_input_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.pipeline import PipelinedModel, PipelineLayout, pipeline_groups

    torch.set_num_threads(1)
    out = {}
    out["pp does not divide"] = _error_of(lambda: pipeline_groups(3, "cpu", timeout_s=60))
    groups = pipeline_groups(2, "cpu", timeout_s=60)
    layout = PipelineLayout.build(world_size, 2, 4, "1f1b", 2)
    policy = ElasticPolicy(chunk_bytes=4096)

    def build(lm, mbs=MBS, lay=layout):
        return PipelinedModel(lm, lora_of("llama"), policy, lay, groups, micro_batch_size=mbs, seq_len=SEQ)

    from transformers import OPTConfig, OPTForCausalLM

    opt = OPTForCausalLM(OPTConfig(vocab_size=257, hidden_size=32, num_hidden_layers=4, ffn_dim=64,
                                   num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32))
    out["unsupported architecture"] = _error_of(lambda: build(opt))
    lm = tiny_model("llama", 4)
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    out["reentrant checkpointing"] = _error_of(lambda: build(lm))
    out["ranks differ"] = _error_of(lambda: build(tiny_model("llama", 4), mbs=MBS + rank))
    out["layout of another model"] = _error_of(lambda: build(tiny_model("llama", 6)))
    four = PipelineLayout.build(world_size, 1, 4, "gpipe", 2) if world_size == 2 else None
    out["layout of another mesh"] = _error_of(lambda: build(tiny_model("llama", 4), lay=four))
    # A good build and step, then a batch of the wrong shape.
    pipe = build(tiny_model("llama", 4))
    out["loss before"] = pipe.train_step(global_batch(0, 1, 2)[0])
    out["bad batch"] = _error_of(lambda: pipe.train_step(global_batch(1, 1, 2)[0][:, :-1]))
    pipe.close()
    return out


def test_bad_input_fails_every_rank_naming_it():
    reports = run_distributed(_bad_input_worker, 2, timeout=600)
    expect = {
        "pp does not divide": "does not divide the world size 2",
        "unsupported architecture": "pipelines support the causal LMs of gpt2, llama",
        "reentrant checkpointing": "reentrant activation checkpointing",
        "ranks differ": "micro_batch_size differ between ranks",
        "layout of another model": "the layout cuts 4 decoder layers, the model has 6",
        "layout of another mesh": "the layout is for world 2 = pp 1 x dp 2; the mesh is pp 2 x dp 1",
        "bad batch": "expected input_ids of shape (4, 16)",
    }
    for rank, report in enumerate(reports):
        for case, text in expect.items():
            assert report[case] is not None and text in report[case], f"rank {rank} {case}: {report[case]}"


# ---------------------------------------------------------------- a stage failing mid-step

INJECT_STEP, INJECT_MB = 1, 1


def _failing_worker(rank, world_size, init_file, out_dir, pp, fail_rank, fail_fast, timeout_s, linger_s):
    import torch.distributed as dist

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.pipeline import PipelinedModel, PipelineLayout, pipeline_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    result = {"rank": rank}
    try:
        groups = pipeline_groups(pp, "cpu", timeout_s=timeout_s)
        layout = PipelineLayout.build(world_size, pp, 4, "1f1b", 2)
        pipe = PipelinedModel(tiny_model("llama", 4), lora_of("llama"), ElasticPolicy(chunk_bytes=4096), layout,
                              groups, micro_batch_size=MBS, seq_len=SEQ, fail_fast=fail_fast)
        step = {"n": 0}
        if rank == fail_rank:
            pack = next(iter(pipe.packs.values()))
            forward = pack.forward
            calls = {"n": 0}

            def failing(*args, **kwargs):
                calls["n"] += 1
                if step["n"] == INJECT_STEP and calls["n"] == INJECT_MB + 1:
                    with open(os.path.join(out_dir, "inject"), "w") as f:
                        f.write(repr(time.time()))
                    raise RuntimeError("injected failure in the stage's forward")
                return forward(*args, **kwargs)

            pack.forward = failing
        for s in range(3):
            step["n"] = s
            if rank == fail_rank:
                calls["n"] = 0
            pipe.train_step(global_batch(s, groups.dp, 2)[groups.dp_rank])
        result["finished"] = True
    except BaseException as exc:  # noqa: BLE001
        from elastic_kernels.api.pipeline.failure import error_text

        result["error"] = error_text(exc)
        result["t_error"] = time.time()
        if rank == fail_rank:
            # Stays alive, its sockets open, so only the timeout can end the others: until every
            # other rank has written its result, or linger_s.
            others = [os.path.join(out_dir, f"rank{r}.json") for r in range(world_size) if r != rank]
            until = time.monotonic() + linger_s
            while time.monotonic() < until and not all(os.path.exists(p) for p in others):
                time.sleep(0.1)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def _launch(world_size, pp, fail_rank, fail_fast, timeout_s, linger_s, limit_s):
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="elastic_pp_fail_") as tmp:
        procs = [ctx.Process(target=_failing_worker, args=(r, world_size, os.path.join(tmp, "rdzv"), tmp, pp, fail_rank,
                                                            fail_fast, timeout_s, linger_s), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        ended = {}
        deadline = time.monotonic() + limit_s
        while len(ended) < world_size and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in ended and p.exitcode is not None:
                    ended[r] = (time.time(), p.exitcode)
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
        inject = float(open(os.path.join(tmp, "inject")).read()) if os.path.exists(os.path.join(tmp, "inject")) else None
        results = {}
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.json")
            if os.path.exists(path):
                results[r] = json.load(open(path))
        return inject, ended, results


def test_a_stage_failing_mid_step_ends_every_rank_at_once():
    """pp 2 x dp 2: rank 3 (stage 1) raises in the forward of micro-batch 1 of step 2. Its
    stage peer and stage 0's ranks are blocked in P2P or in gathers with it: every rank must
    be gone within seconds (the failure watch), far below the 120 s group timeout."""
    inject, ended, results = _launch(4, 2, fail_rank=3, fail_fast=True, timeout_s=120, linger_s=0, limit_s=300)
    assert inject is not None, f"the failure was never injected: {results}"
    assert sorted(ended) == [0, 1, 2, 3], f"ranks still running: {sorted(set(range(4)) - set(ended))}"
    assert "injected failure" in results[3]["error"], results[3]
    for r in (0, 1, 2):
        t, code = ended[r]
        assert t - inject < 20, f"rank {r} ended {t - inject:.1f} s after the failure"
        assert code == 1 or "error" in results.get(r, {}), (r, code, results.get(r))
    print({r: round(t - inject, 2) for r, (t, _) in ended.items()})


def test_without_fail_fast_the_timeout_bounds_the_wait():
    """pp 2, no failure watch, the failing rank stays alive (its sockets open): its peer, in a
    P2P receive, raises when the 10 s group timeout expires (the mesh's dims carry it)."""
    inject, ended, results = _launch(2, 2, fail_rank=1, fail_fast=False, timeout_s=10, linger_s=18, limit_s=300)
    assert inject is not None, f"the failure was never injected: {results}"
    assert 0 in results and "error" in results[0], f"rank 0 did not fail: {results}"
    waited = results[0]["t_error"] - inject
    assert waited < 10 + 8, f"rank 0 waited {waited:.1f} s for a 10 s timeout"
    print(f"rank 0 failed {waited:.1f} s after the injection: {results[0]['error'][:200]}")
