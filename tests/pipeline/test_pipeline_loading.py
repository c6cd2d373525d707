"""A pipeline built from a model directory: every stage on the meta device, each rank reading
only its own packs' tensors from the safetensors files ([Note: loading from files] in
python_api/loading/), for an HF Llama and a GPT-2 (whose lm_head is tied to wte: the last
pack keeps the tie and reads the one stored tensor).

Checked on 2 gloo ranks (pp 2): the layers of the other rank are never materialised (still on
the meta device after the build, and their weights never read: the reads are counted through
SafetensorsSource); the rank's elastic weights are its packs' (and hold its shard: the whole
pack at dp = 1); two steps equal the pp = 1 reference built from the same files
([Note: the reference and the tolerance]).
"""

from __future__ import annotations

import os
import tempfile

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


def _worker(rank, world_size, folder):
    import torch.distributed as dist

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.loading import SafetensorsSource, empty_model
    from elastic_kernels.api.pipeline import PipelinedModel, PipelineLayout, pipeline_groups

    torch.set_num_threads(1)
    out = []
    for kind in ("llama", "gpt2"):
        path = os.path.join(folder, kind)
        if rank == 0:
            tiny_model(kind, 4).save_pretrained(path)
        dist.barrier()
        lora = lora_of(kind)
        ref = reference_of(tiny_model(kind, 4), lora, 4096)
        source = SafetensorsSource(path)
        read = []
        rows, tensor = source.rows, source.tensor
        source.rows = lambda name, *a, **k: (read.append(name), rows(name, *a, **k))[1]
        source.tensor = lambda key, *a, **k: (read.append(key), tensor(key, *a, **k))[1]
        lm = empty_model(path).train()
        groups = pipeline_groups(2, "cpu", timeout_s=120)
        layout = PipelineLayout.build(world_size, 2, 4, "1f1b", 2)
        pipe = PipelinedModel(lm, lora, ElasticPolicy(chunk_bytes=4096), layout, groups, micro_batch_size=MBS,
                              seq_len=SEQ, source=source)
        randomize_lora_b(pipe.named_parameters())
        prefix = "model.layers." if kind == "llama" else "transformer.h."
        mine = {str(i) for k in pipe.local for i in layout.layers_of_pack(k)}
        others = [n for n, p in lm.named_parameters() if n.startswith(prefix) and n[len(prefix):].split(".")[0] not in mine]
        assert others and all(p.is_meta for n, p in lm.named_parameters() if n in others), (kind, rank)
        foreign = [n for n in read if n.startswith(prefix) and n[len(prefix):].split(".")[0] not in mine]
        assert not foreign, f"{kind} rank {rank} read tensors of the other stage: {foreign[:3]}"
        for s in range(2):
            batch = global_batch(s, 1, 2)
            loss = pipe.train_step(batch[0])
            ref_loss, grads = reference_step(ref, batch)
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (kind, s, loss, ref_loss)
            worst = assert_grads_close({n: p.grad for n, p in pipe.named_parameters()}, grads, f"{kind} step {s}")
            out.append((kind, s, loss, worst, len(read)))
            with torch.no_grad():
                for _, p in pipe.named_parameters():
                    p -= 0.1 * p.grad
                for p in ref.parameters():
                    if p.requires_grad:
                        p -= 0.1 * p.grad
        pipe.close()
    return out


def test_stages_load_only_their_layers_from_files():
    with tempfile.TemporaryDirectory(prefix="elastic_pp_load_") as folder:
        reports = run_distributed(_worker, 2, folder, timeout=900)
    for rank, rows in enumerate(reports):
        for kind, s, loss, worst, reads in rows:
            print(f"rank {rank} {kind} step {s}: loss {loss:.7f}, worst gradient difference {worst:.2e}, {reads} reads")
