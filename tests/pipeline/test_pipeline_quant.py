"""Pipelines over quantized frozen weights (ElasticPolicy(weight_format=...)): each pack's
runtime quantizes its weights on build, each chunk as the pp = 1 runtime would (the chunking
depends only on chunk_bytes and the weight's rows), so a pipelined step computes the same
losses and adapter gradients as the pp = 1 run with the same format, to fp32 summation-order
rounding ([Note: the reference and the tolerance] in tests/pipeline/_common.py: the same
tolerance as the unquantized pipelines). Checked on 4 gloo ranks, pp 2 x dp 2, two steps per
configuration, in one process group:
- the loss and every adapter gradient of this rank's packs against the pp = 1 reference with
  the same format, and the loss differs from the unquantized model's (the format is in force);
- the bytes all-gathered in each step equal the analytic quantized size computed here from the
  weights' shapes and the format's definition (not the runtime's layout code): per load of a
  pack, (dp - 1) x ceil(blob / dp) per chunk of its weights, a blob being a chunk's codes and
  scales (elastic_kernels/quant/blob.py), as often per step as `loads_per_step` says;
- the pool bytes held after every action equal the residency model's with pages of the
  quantized chunk's size, and the frozen bytes a rank holds are its 1/dp of each blob.
One more configuration builds the pipeline from a checkpoint that transformers saved with
bitsandbytes 4-bit nf4 (double quantization): each stage reads its packed weights as they are
(`read_checkpoint_format`, [Note: loading a bitsandbytes 4-bit checkpoint]) and equals the
pp = 1 model `load_elastic` loads from the same files.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

from tests._dist import run_distributed
from tests.pipeline._common import (
    MBS,
    SEQ,
    _solo_group,
    assert_grads_close,
    global_batch,
    lora_of,
    randomize_lora_b,
    reference_step,
    tiny_model,
)
from tests.pipeline.test_pipeline_parity import NO_BACKWARD, _weights

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

CHUNK = 4096  # 16 fp32 rows of 64: 2-3 chunks per weight, ragged for GPT-2's c_attn (192 rows)
FP32 = 4

# (model, layers, schedule, micro-batches, pack size, residency, (format, block, nested), from a
# bitsandbytes checkpoint)
CONFIGS = [
    ("llama", 4, "1f1b", 2, None, "step", ("nf4", None, True), False),
    ("gpt2", 4, "looped-bfs", 2, 1, "transient", ("int8", 64, False), False),
    ("llama", 4, "gpipe", 2, None, "step", ("nf4", None, True), True),
]


def _blob(rows: int, cols: int, fmt: str, block: int | None, nested: bool) -> int:
    """Bytes of the blob of a chunk of rows x cols weights (the format's definition)."""
    n = rows * cols
    block = block or (64 if fmt == "nf4" else 256)
    nb = n // block
    if fmt == "int8":
        return n + 4 * nb
    return n // 2 + (nb + 4 * -(-nb // 256) + 4 if nested else 4 * nb)


def _layout_of(rows: int, cols: int, dp: int, quant) -> tuple[int, int, int, int]:
    """(rows per chunk, chunks, slice bytes, full blob bytes) of a weight [rows, cols] of fp32."""
    rpc = min(rows, CHUNK // (cols * FP32))
    blob = _blob(rpc, cols, *quant)
    return rpc, -(-rows // rpc), -(-blob // dp), blob


def _expected(layout, dp, weights, pack_of, quant, step_index):
    """Per pack: all-gathered bytes in a step, and the forward / backward page bytes."""
    gather, fwd_pages, bwd_pages = {}, {}, {}
    for k in range(layout.n_packs):
        names = [n for n in weights if pack_of(n) == k]
        page = max(-(-_layout_of(*weights[n], dp, quant)[3] // 512) * 512 for n in names)
        per = {}
        for n in names:
            _, chunks, slice_bytes, _ = _layout_of(*weights[n], dp, quant)
            per[n] = ((dp - 1) * slice_bytes * chunks, chunks)
        nf, nb = layout.loads_per_step(k)
        if step_index == 0 and layout.residency[k] == "persistent":
            nf, nb = 1, 0
        gather[k] = nf * sum(v[0] for v in per.values()) + nb * sum(v[0] for n, v in per.items() if n not in NO_BACKWARD)
        fwd_pages[k] = page * sum(v[1] for v in per.values())
        bwd_pages[k] = page * sum(v[1] for n, v in per.items() if n not in NO_BACKWARD)
    return gather, fwd_pages, bwd_pages


def _policy(quant, **kw):
    from elastic_kernels.api import ElasticPolicy

    fmt, block, nested = quant
    return ElasticPolicy(chunk_bytes=CHUNK, weight_format=fmt, quant_block_size=block, quant_nested=nested, **kw)


def _reference(lm, lora, quant):
    """The pp = 1 model with the same format, on this rank alone ([Note: the reference and the
    tolerance])."""
    from elastic_kernels.api import convert_to_elastic

    ref = copy.deepcopy(lm)
    convert_to_elastic(ref, lora, _policy(quant, all_reduce_grads=False), group=_solo_group())
    randomize_lora_b(ref.named_parameters())
    return ref


def _bnb_checkpoint(folder: str, kind: str, L: int) -> str:
    """transformers' bitsandbytes 4-bit nf4 checkpoint (double quantization) of the tiny model."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    fp, out = os.path.join(folder, "fp"), os.path.join(folder, "bnb")
    tiny_model(kind, L).save_pretrained(fp)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(fp, quantization_config=q, dtype=torch.float32, device_map="cpu") \
        .save_pretrained(out)
    return out


def _worker(rank, world_size, configs, folder):
    import torch.distributed as dist

    from elastic_kernels.api import convert_to_elastic, load_elastic
    from elastic_kernels.api.loading import SafetensorsSource, empty_model, read_checkpoint_format, read_config
    from elastic_kernels.api.pipeline import PipelinedModel, PipelineLayout, pipeline_groups
    from elastic_kernels.api.planner.pipeline import residency_trace

    torch.set_num_threads(1)
    report = []
    for kind, L, schedule, m, pack_size, residency, quant, bnb in configs:
        what = f"{kind} pp=2 {schedule} pack={pack_size} {residency} {quant}{' bnb' if bnb else ''}"
        groups = pipeline_groups(2, "cpu", timeout_s=120)
        dp = groups.dp
        lora = lora_of(kind)
        source, full, stored = None, None, quant
        if bnb:
            path = os.path.join(folder, "bnb")
            if rank == 0:
                _bnb_checkpoint(folder, kind, L)
            dist.barrier()
            ref = load_elastic(path, lora, _policy(quant, all_reduce_grads=False), group=_solo_group()).train()
            randomize_lora_b(ref.named_parameters())
            source, config = SafetensorsSource(path), read_config(path)
            read_checkpoint_format(source, config, _policy(quant))
            lm = empty_model(config).train()
            # Every weight is cut into chunks of 16 blocks of 64, which straddle bitsandbytes'
            # blocks of 256 scales: stored without nested scales, fp32 scales from the file's.
            stored = ("nf4", None, False)
        else:
            lm = tiny_model(kind, L)
            ref = _reference(lm, lora, quant)
            full = copy.deepcopy(lm)  # unquantized, to show the format is in force
            convert_to_elastic(full, lora, _policy((None, None, False), all_reduce_grads=False), group=_solo_group())
            randomize_lora_b(full.named_parameters())
        layout = PipelineLayout.build(world_size, 2, L, schedule, m, pack_size=pack_size, residency=residency)
        pipe = PipelinedModel(lm, lora, _policy(quant), layout, groups, micro_batch_size=MBS, seq_len=SEQ, trace=True,
                              source=source)
        randomize_lora_b(pipe.named_parameters())
        quant = stored
        weights = _weights(tiny_model(kind, L), pipe.targets)
        tensors = [et for rt in pipe.runtimes.values() for et in rt.tensors]
        assert sorted(et.name for et in tensors) == sorted(n for n in weights if pipe._pack_of(n) in pipe.local), what
        assert all(et.weight_format == quant[0] and et.shard.dtype == torch.uint8 for et in tensors), what
        held = sum(_layout_of(*weights[et.name], dp, quant)[1] * _layout_of(*weights[et.name], dp, quant)[2]
                   for et in tensors)
        assert pipe.frozen_bytes_held() == held, f"{what}: holds {pipe.frozen_bytes_held()}, expected {held}"
        whole = sum(_quantized_bytes(*weights[et.name], quant) for et in tensors)
        assert pipe.frozen_bytes_of_packs() == whole, f"{what}: packs' frozen bytes {pipe.frozen_bytes_of_packs()}"
        for s in range(2):
            batch = global_batch(s, dp, m)
            loss = pipe.train_step(batch[groups.dp_rank])
            ref_loss, ref_grads = reference_step(ref, batch)
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), f"{what} step {s}: loss {loss} vs {ref_loss}"
            worst = assert_grads_close({n: p.grad for n, p in pipe.named_parameters()}, ref_grads, f"{what} step {s}")
            fp_loss = reference_step(full, batch)[0] if full is not None else float("nan")
            assert fp_loss != ref_loss, f"{what}: the format changed nothing"
            gather, fwd_pages, bwd_pages = _expected(layout, dp, weights, pipe._pack_of, quant, s)
            st = pipe.last_step
            want = sum(gather[k] for k in pipe.local)
            assert st["allgather_bytes"] == want, f"{what} step {s}: all-gathered {st['allgather_bytes']}, expected {want}"
            _, after = residency_trace(layout, groups.pp_rank, fwd_pages, bwd_pages, first_step=s == 0)
            measured = [b for _, b in pipe.residency.trace.points]
            assert measured == after, f"{what} step {s}: pool bytes after each action {measured}, modelled {after}"
            report.append((what, s, loss, ref_loss, fp_loss, worst, st["allgather_bytes"]))
            with torch.no_grad():
                for model in (ref, full) if full is not None else (ref,):
                    for p in model.parameters():
                        if p.requires_grad:
                            p -= 0.1 * p.grad
                for _, p in pipe.named_parameters():
                    p -= 0.1 * p.grad
        pipe.close()
    return report


def _quantized_bytes(rows: int, cols: int, quant) -> int:
    """Bytes of a whole quantized weight: its chunks' blobs (the last one ragged)."""
    rpc = min(rows, CHUNK // (cols * FP32))
    full, last = divmod(rows, rpc)
    return full * _blob(rpc, cols, *quant) + (_blob(last, cols, *quant) if last else 0)


def test_quantized_pipeline_matches_pp1():
    with tempfile.TemporaryDirectory(prefix="elastic_pp_quant_") as folder:
        reports = run_distributed(_worker, 4, CONFIGS, folder, timeout=900)
    for rank, rows in enumerate(reports):
        for what, s, loss, ref_loss, fp_loss, worst, gathered in rows:
            print(f"rank {rank} {what} step {s}: loss {loss:.7f} (pp 1 {ref_loss:.7f}, unquantized {fp_loss:.7f}: {abs(fp_loss - ref_loss) / ref_loss:.1e} apart), "
                  f"worst grad diff {worst:.2e} of scale, all-gathered {gathered} B")
