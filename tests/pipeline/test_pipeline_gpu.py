"""The pipeline's CUDA paths on one GPU (`make gpu-check`): NCCL with one rank, pp 1 x dp 1,
four packs on the rank (LoopedBFS hands activations between its own stages without P2P), the
frozen weights in the host store, so every pack load is a host -> page copy on the runtime's
copy stream into a CUDA pool, ordered by events, and every release frees the pool's
segments. Checked as on CPU (tests/pipeline/test_pipeline_parity.py): the loss and adapter
gradients of two steps against the pp = 1 reference on the same GPU ([Note: the reference
and the tolerance]; cuBLAS may block the GEMMs of different shapes differently: the same fp32
summation-order bound), the host -> device bytes per step equal to the packs' real bytes (each
loaded once at step residency), and nothing left in the pools after a step. A copy that is
not waited for before its page is read, or a page reused while a kernel still reads it,
changes the gradients; a pack not released leaves pool bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.needs_ext]


def _gpu_worker(init_file, queue):
    try:
        import datetime

        import torch
        import torch.distributed as dist

        from elastic_kernels.api import ElasticPolicy
        from elastic_kernels.api.pipeline import PipelinedModel, PipelineLayout, pipeline_groups
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

        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=120), device_id=dev)
        lm = tiny_model("llama", 4).to(dev)
        lora = lora_of("llama")
        ref = reference_of(lm, lora, 4096)
        groups = pipeline_groups(1, dev, timeout_s=120)
        layout = PipelineLayout.build(1, 1, 4, "looped-bfs", 2, pack_size=1, residency="step", window=1)
        pipe = PipelinedModel(lm, lora, ElasticPolicy(chunk_bytes=4096, weights_on="host"), layout, groups,
                              micro_batch_size=MBS, seq_len=SEQ, device=dev)
        randomize_lora_b(pipe.named_parameters())
        real = sum(et.nbytes for rt in pipe.runtimes.values() for et in rt.tensors)
        out = []
        for s in range(2):
            batch = global_batch(s, 1, 2).to(dev)
            loss = pipe.train_step(batch[0])
            ref_loss, grads = reference_step(ref, batch)
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (loss, ref_loss)
            worst = assert_grads_close({n: p.grad for n, p in pipe.named_parameters()}, grads, f"step {s}")
            assert pipe.last_step["h2d_bytes"] == real, (pipe.last_step["h2d_bytes"], real)
            assert pipe.residency.resident_bytes() == 0
            out.append((loss, ref_loss, worst))
            with torch.no_grad():
                for _, p in pipe.named_parameters():
                    p -= 0.1 * p.grad
                for p in ref.parameters():
                    if p.requires_grad:
                        p -= 0.1 * p.grad
        pipe.close()
        dist.destroy_process_group()
        queue.put(("ok", out))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put(("err", traceback.format_exc()))


def test_pipeline_on_one_gpu_matches_the_reference():
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="elastic_pp_gpu_") as tmp:
        queue = ctx.Queue()
        p = ctx.Process(target=_gpu_worker, args=(os.path.join(tmp, "rdzv"), queue), daemon=True)
        p.start()
        try:
            kind, payload = queue.get(timeout=600)
        finally:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert kind == "ok", payload
    for s, (loss, ref_loss, worst) in enumerate(payload):
        print(f"step {s}: loss {loss:.7f} (reference {ref_loss:.7f}), worst gradient difference {worst:.2e} of scale")
