"""Quantize on load (`load_elastic` with a weight_format): each rank quantizes its shard from
the rows it reads of the fp32/bf16 safetensors files, bit for bit what quantizing after an
in-memory conversion gives."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.quant._models import TARGETS, quant_llama

FORMATS = [("nf4", None, False), ("nf4", None, True), ("int8", 64, False)]


def _save(path, file_dtype):
    model = quant_llama().to(file_dtype)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="60KB")  # several files


def _worker(rank, world_size, path, fmt, block, nested, load_dtype):
    from transformers import LlamaForCausalLM

    from elastic_kernels.api import ElasticPolicy, load_elastic
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    lora = LoRAConfig(r=4, alpha=8, target_modules=TARGETS)
    policy = ElasticPolicy(chunk_bytes=64 * 4 * 7, weight_format=fmt, quant_block_size=block, quant_nested=nested,
                           replicate_below_bytes=0, quant_skip_modules=())  # lm_head quantized too
    loaded = load_elastic(path, lora, policy, dtype=load_dtype)
    in_memory = convert_to_elastic(LlamaForCausalLM.from_pretrained(path, dtype=load_dtype).eval(), lora, policy)
    a, b = loaded._elastic_runtime, in_memory._elastic_runtime
    assert [et.name for et in a.tensors] == [et.name for et in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert x.qlayout == y.qlayout and x.qlayout is not None, x.name
        assert x.shard.dtype == torch.uint8 and torch.equal(x.shard, y.shard), f"rank {rank}: {x.name} shard differs"
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    la = loaded(input_ids=ids, labels=ids).loss
    lb = in_memory(input_ids=ids, labels=ids).loss
    assert torch.equal(la, lb)
    return len(a.tensors)


@pytest.mark.parametrize("fmt,block,nested", FORMATS, ids=["nf4", "nf4-nested", "int8-64"])
@pytest.mark.parametrize("file_dtype,load_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16-as-fp32", "bf16"])
def test_quantize_on_load_equals_quantize_after_convert(tmp_path, file_dtype, load_dtype, fmt, block, nested):
    _save(str(tmp_path), file_dtype)
    counts = run_distributed(_worker, 2, str(tmp_path), fmt, block, nested, load_dtype, timeout=300)
    assert counts[0] == counts[1] == 2 * 7 + 1  # 7 linears per layer and lm_head, all quantized


# ---------------------------------------------------------------------------------------------
# A checkpoint saved by transformers with bitsandbytes 4-bit ([Note: loading a bitsandbytes
# 4-bit checkpoint] in python_api/loading/bnb.py): written here by transformers itself
# (from_pretrained(quantization_config=BitsAndBytesConfig(...)) on the CPU, then
# save_pretrained), loaded by load_elastic on 2 ranks, and compared with
# - the checkpoint's own values: the model whose packed weights are replaced by bitsandbytes'
#   dequantize_4bit of them (QuantState.from_dict of the file's tensors), converted without a
#   format under the same chunking on one process: same values, same chunked op order, so the
#   losses and adapter gradients of two SGD steps must be equal bit for bit;
# - the file's bytes: each chunk blob's codes are the file's codes, its scales the file's
#   (or, for double quantization with chunks that straddle bitsandbytes' blocks of 256 scales,
#   the scales bitsandbytes' dequantize_blockwise computes), so nothing was requantized;
# - what each rank read: the codes of its own slices, nothing else.

# hidden 64, intermediate 512: gate/up [512, 64] and down [64, 512] hold 512 blocks (2 of
# bitsandbytes' blocks of 256 scales), q/o [64, 64] 64 blocks.
BNB_TARGETS = ("q_proj", "v_proj", "down_proj")
BNB_REPLICATE = 20_000  # gate/up/down (128 KB fp32) elastic; k/o (8/16 KB) replicated, dequantized on load
# chunk_bytes per case: ALIGNED makes every chunk start on a block of 256 scales (gate/up 256
# rows of 64, down 32 rows of 512: 256 blocks), RAGGED (40 rows of 64, 5 rows of 512: 40
# blocks) straddles them.
BNB_CASES = [
    # (checkpoint, chunk_bytes, nested chunks expected for the multi-chunk packed weights)
    ("llama-nf4", 65536, False),
    ("llama-nf4-dq", 65536, True),
    ("llama-nf4-dq", 10240, False),
    ("llama-bf16-dq-bf16storage", 32768, True),
    ("llama-bf16-dq-bf16storage", 5120, False),
    ("gpt2-nf4-dq", 12288, False),
    # issue 28: hidden 66, intermediate 688: no row (66, 688) is whole blocks of 64 and every
    # weight ends in a partial block (45408 = 709.5 x 64); down [66, 688] in chunks of 6 rows
    # rounded to 4 (43 blocks: not aligned to 256, fp32 scales), q [66, 66] in chunks of 32 rows.
    ("llama688-nf4", 16512, False),
    ("llama688-nf4-dq", 16512, False),
    ("llama688-nf4-dq", 200_000, True),  # one chunk per weight: nested scales copied as they are
]
BNB_CHECKPOINTS = {
    # name: (model kind, double quantization, dtype, bnb_4bit_quant_storage)
    "llama-nf4": ("llama", False, torch.float32, torch.uint8),
    "llama-nf4-dq": ("llama", True, torch.float32, torch.uint8),
    "llama-bf16-dq-bf16storage": ("llama", True, torch.bfloat16, torch.bfloat16),
    "gpt2-nf4-dq": ("gpt2", True, torch.float32, torch.uint8),
    "llama688-nf4": ("llama688", False, torch.float32, torch.uint8),
    "llama688-nf4-dq": ("llama688", True, torch.float32, torch.uint8),
}


def _bnb_base_model(kind: str):
    torch.manual_seed(0)
    if kind in ("llama", "llama688"):
        from transformers import LlamaConfig, LlamaForCausalLM

        hidden, inter, heads = (64, 512, 4) if kind == "llama" else (66, 688, 3)
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=inter,
                                            num_hidden_layers=2, num_attention_heads=heads,
                                            num_key_value_heads=2 if kind == "llama" else 3,
                                            max_position_embeddings=64, tie_word_embeddings=False))
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def _write_bnb_checkpoint(root, name) -> str:
    """transformers' own bitsandbytes 4-bit checkpoint of a tiny model (its CPU path)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kind, nested, dtype, storage = BNB_CHECKPOINTS[name]
    fp, out = str(root / f"{name}-fp"), str(root / name)
    _bnb_base_model(kind).float().save_pretrained(fp, safe_serialization=True)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=nested,
                           bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=storage)
    model = AutoModelForCausalLM.from_pretrained(fp, quantization_config=q, dtype=dtype, device_map="cpu")
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def bnb_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bnb")
    return {name: _write_bnb_checkpoint(root, name) for name in BNB_CHECKPOINTS}


def _bnb_lora(path):
    from elastic_kernels.api.nn import LoRAConfig

    targets = ("c_attn", "c_fc") if "gpt2" in path else BNB_TARGETS
    return LoRAConfig(r=4, alpha=8, target_modules=targets)


def _bnb_policy(path, chunk_bytes):
    from elastic_kernels.api import ElasticPolicy

    nested = "-dq" in path
    return ElasticPolicy(chunk_bytes=chunk_bytes, weight_format="nf4", quant_nested=nested,
                         replicate_below_bytes=BNB_REPLICATE)


def _two_steps(model):
    """Adapters B set from a fixed generator, two SGD steps on one batch: losses and grads."""
    from elastic_kernels.api.nn import lora_layers

    gen = torch.Generator().manual_seed(7)
    for _, layer in lora_layers(model):
        with torch.no_grad():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen).to(layer.lora_B.weight.dtype)
                                      * 0.1)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    losses, grads = [], []
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().clone())
        step = {}
        with torch.no_grad():
            for name, layer in lora_layers(model):
                for p, which in ((layer.lora_A.weight, "A"), (layer.lora_B.weight, "B")):
                    step[f"{name}.{which}"] = p.grad.clone()
                    p -= 0.5 * p.grad
                    p.grad = None
        grads.append(step)
    return losses, grads


def _bnb_worker(rank, world_size, cases):
    from elastic_kernels.api import load_elastic
    from elastic_kernels.api.loading import SafetensorsSource

    made = []
    real_packed = SafetensorsSource._packed

    def keep(self, key):  # the packed readers the runtime is given, to see what they read
        w = real_packed(self, key)
        made.append(w)
        return w

    SafetensorsSource._packed = keep
    out = []
    try:
        for path, chunk_bytes in cases:
            made.clear()
            model = load_elastic(path, _bnb_lora(path), _bnb_policy(path, chunk_bytes))
            assert not hasattr(model.config, "quantization_config")
            rt = model._elastic_runtime
            weights = {et.name: (et.layout.rows, et.layout.cols, et.qlayout.rows_per_chunk, et.qlayout.nested,
                                 et.dtype, et.shard.clone()) for et in rt.tensors}
            reads = {}
            for w in made:
                reads.setdefault(w.base, []).extend(w.codes_read)
            out.append((weights, reads, *_two_steps(model)))
    finally:
        SafetensorsSource._packed = real_packed
    return out


def _bnb_file(path):
    """The checkpoint's tensors, and {weight key: (packed codes, QuantState)} of its packed ones."""
    from bitsandbytes.functional import QuantState
    from safetensors.torch import load_file

    sd = load_file(f"{path}/model.safetensors")
    packed = {}
    for k in [k for k in sd if ".quant_state.bitsandbytes__" in k]:
        base = k[: k.index(".quant_state.")]
        parts = {kk[len(base) + 1:]: v for kk, v in sd.items() if kk.startswith(base + ".")}
        packed[base] = (sd[base], QuantState.from_dict(parts, device=torch.device("cpu")))
    return sd, packed


def _bnb_dequantize(codes, qs):
    """bitsandbytes' dequantize_4bit of a packed weight, given its shape flattened: bitsandbytes
    blocks the flattened weight, but 0.50.2's CPU kernel of a 2-D shape indexes the scales per
    row, wrong once 64 does not divide the row (tests/kernels/test_quant.py
    test_bnb_cpu_2d_dequant_blocks_per_row); the same values otherwise."""
    from bitsandbytes.functional import dequantize_4bit

    shape = qs.shape
    qs.shape = torch.Size([shape.numel()])
    try:
        return dequantize_4bit(codes, qs).reshape(shape)
    finally:
        qs.shape = shape


def _bnb_reference(path, chunk_bytes):
    """The model whose packed weights are bitsandbytes' dequantize_4bit of the checkpoint, the
    rest the checkpoint's tensors, converted without a format under the same chunking (a packed
    weight's rows_per_chunk rounded to whole blocks of 64, as the loaded run's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.config import quant_rows_per_chunk
    from elastic_kernels.api.nn import convert_to_elastic
    from elastic_kernels.api.nn.lora import is_conv1d

    cfg = AutoConfig.from_pretrained(path)
    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=cfg.dtype)
    sd, packed = _bnb_file(path)
    state = {k: v for k, v in sd.items() if not any(k.startswith(b + ".") for b in packed) and k not in packed}
    for base, (codes, qs) in packed.items():
        w = _bnb_dequantize(codes, qs)
        state[base] = w.t() if is_conv1d(model.get_submodule(base.rpartition(".")[0])) else w
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()  # GPT-2's head is its embeddings
    assert not unexpected and all(".attn.bias" in k or k in tied for k in missing), (missing, unexpected)
    model.eval()
    policy = ElasticPolicy(chunk_bytes=chunk_bytes, replicate_below_bytes=BNB_REPLICATE)
    plain = ElasticPolicy.weight_rows_per_chunk

    def rounded(self, name, shape, row_bytes):
        rpc = plain(self, name, shape, row_bytes)
        return quant_rows_per_chunk(rpc, int(shape[0]), int(shape[1]), 64) if f"{name}.weight" in packed else rpc

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run one intra-op thread: the same GEMM reduction order
    ElasticPolicy.weight_rows_per_chunk = rounded
    try:
        return _two_steps(convert_to_elastic(model, _bnb_lora(path), policy)), packed, sd
    finally:
        ElasticPolicy.weight_rows_per_chunk = plain
        torch.set_num_threads(threads)


def _merged(ranges):
    out = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def test_bitsandbytes_4bit_checkpoint_loads_and_equals_it(bnb_checkpoints):
    from bitsandbytes.functional import dequantize_blockwise

    from elastic_kernels import dequantize
    from elastic_kernels.quant import QuantizedLayout

    world = 2
    cases = [(bnb_checkpoints[name], cb) for name, cb, _ in BNB_CASES]
    results = run_distributed(_bnb_worker, world, cases, timeout=600)
    for i, (name, chunk_bytes, nested_chunks) in enumerate(BNB_CASES):
        path = bnb_checkpoints[name]
        (ref_losses, ref_grads), packed, sd = _bnb_reference(path, chunk_bytes)
        what = f"{name} chunk_bytes={chunk_bytes}"
        per_rank = [r[i] for r in results]
        for rank, (_, _, losses, grads) in enumerate(per_rank):
            for s, (ours, theirs) in enumerate(zip(losses, ref_losses)):
                assert torch.equal(ours, theirs), f"{what} rank {rank} step {s}: loss {ours.item()!r} != {theirs.item()!r}"
            for s, (ours, theirs) in enumerate(zip(grads, ref_grads)):
                assert ours.keys() == theirs.keys()
                for k in ours:
                    assert torch.equal(ours[k], theirs[k]), f"{what} rank {rank} step {s}: grad of {k} differs"
        weights0 = per_rank[0][0]
        elastic_packed = [n for n in weights0 if f"{n}.weight" in packed]
        assert len(elastic_packed) >= 4, (what, sorted(weights0))  # the targets and the large others
        for n in elastic_packed:
            rows, cols, rpc, nested, dtype, _ = weights0[n]
            codes, qs = packed[f"{n}.weight"]
            ql = QuantizedLayout(rows, cols, rpc, "nf4", 64, nested)
            image = ql.image_layout(world).assemble([r[0][n][5] for r in per_rank]).reshape(-1)
            # The loaded weight is the checkpoint's dequantize_4bit, bit for bit.
            assert torch.equal(dequantize(ql.blobs(image), ql.formats[0], rows, dtype=dtype), _bnb_dequantize(codes, qs)), \
                f"{what}: {n}"
            if ql.num_chunks > 1:
                assert nested == nested_chunks, f"{what}: {n} stored with nested scales {nested}"
            # Each chunk's bytes are the file's: codes and scales copied, never requantized.
            file_codes = codes.contiguous().view(torch.uint8).reshape(-1)
            if qs.nested:
                fp32_absmax = dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
            for c, (fmt, blob) in enumerate(zip(ql.formats, ql.blobs(image))):
                parts = fmt.split(blob)
                el0, b0 = c * rpc * cols, c * rpc * cols // 64
                nb = fmt.num_blocks
                assert torch.equal(parts["codes"], file_codes[el0 // 2: el0 // 2 + fmt.codes_bytes]), (what, n, c)
                if fmt.nested:
                    assert torch.equal(parts["scales"], qs.absmax[b0: b0 + nb]), (what, n, c)
                    assert torch.equal(parts["nested_scales"], qs.state2.absmax[b0 // 256: b0 // 256 + fmt.nested_blocks])
                    assert torch.equal(parts["offset"], qs.offset.float().reshape(())), (what, n, c)
                elif qs.nested:
                    assert torch.equal(parts["scales"], fp32_absmax[b0: b0 + nb]), (what, n, c)
                else:
                    assert torch.equal(parts["scales"], qs.absmax[b0: b0 + nb]), (what, n, c)
            # What each rank read of the codes: exactly those of its slices of the chunks' blobs.
            slice_bytes = -(-ql.full_blob_bytes // world)
            for rank in range(world):
                want = []
                for c, fmt in enumerate(ql.formats):
                    lo, hi = rank * slice_bytes, min((rank + 1) * slice_bytes, fmt.codes_bytes)
                    if lo < hi:
                        want.append((c * rpc * cols // 2 + lo, c * rpc * cols // 2 + hi))
                got = per_rank[rank][1].get(f"{n}.weight", [])
                assert _merged(got) == _merged(want), f"{what} rank {rank}: {n} read codes {got}, its slices {want}"


def _no_reads(monkeypatch, records_too: bool):
    """Make any read of a weight (or, with records_too, of any tensor at all) fail the test."""
    from elastic_kernels.api.loading.source import SafetensorsSource

    def no_reads(*a, **k):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(SafetensorsSource, "rows", no_reads)
    monkeypatch.setattr(SafetensorsSource, "tensor", no_reads)
    monkeypatch.setattr("elastic_kernels.api.loading.source.read_slices", no_reads)
    if records_too:
        monkeypatch.setattr(SafetensorsSource, "_small", no_reads)


def _edited_copy(src, dst, config=None, tensors=None) -> str:
    """A copy of checkpoint `src` with config.json fields replaced (`config`: {field: value},
    a dict value merged into the field) and tensors replaced (`tensors(sd)` edits the dict)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        for k, v in config.items():
            cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        sd = load_file(str(dst / "model.safetensors"))
        tensors(sd)
        save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def _record_with_block(sd, key, block):
    import json

    rec = json.loads(bytes(sd[key].tolist()).decode())
    rec["blocksize"] = block
    sd[key] = torch.tensor(list(json.dumps(rec).encode()), dtype=torch.uint8)


QC = "quantization_config"
DQ = "llama-nf4-dq"
Q_STATE = "model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4"
REFUSED = [
    # (id, checkpoint, config edits, tensor edits, policy kwargs, nothing read at all, error pattern)
    ("format-none", DQ, None, None, {}, True,
     r"saved quantized \(bitsandbytes 4-bit nf4, blocksize 64, double quantization True\).*pass "
     r"ElasticPolicy\(weight_format='nf4', quant_nested=True\), not weight_format=None"),
    ("format-int8", DQ, None, None, dict(weight_format="int8"), True, r"not weight_format='int8'"),
    ("nested-differs", DQ, None, None, dict(weight_format="nf4"), True,
     r"the policy has quant_nested=False: pass ElasticPolicy\(weight_format='nf4', quant_nested=True\)"),
    ("block-differs", DQ, None, None, dict(weight_format="nf4", quant_nested=True, quant_block_size=128), True,
     r"the policy's quant_block_size is 128"),
    ("fp4", DQ, {QC: {"bnb_4bit_quant_type": "fp4"}}, None, dict(weight_format="nf4", quant_nested=True), True,
     r"quantized by bitsandbytes 4-bit 'fp4' \(quantization_config: quant_method='bitsandbytes'"),
    ("8bit", DQ, {QC: {"load_in_4bit": False, "load_in_8bit": True}}, None, dict(weight_format="nf4"), True,
     r"quantized by bitsandbytes in 8 bits \(quantization_config: .*load_in_8bit=True"),
    ("gptq", DQ, {QC: {"quant_method": "gptq", "bits": 4, "group_size": 128}}, None, dict(weight_format="nf4"),
     True, r"saved quantized by 'gptq' \(quantization_config: quant_method='gptq'.*bits=4, group_size=128\)"),
    ("awq", DQ, {QC: {"quant_method": "awq"}}, None, dict(weight_format="nf4"), True, r"quantized by 'awq'"),
    ("record-block-128", DQ, None, lambda sd: _record_with_block(sd, Q_STATE, 128),
     dict(weight_format="nf4", quant_nested=True), False,
     r"'model.layers.0.self_attn.q_proj.weight' is packed in blocks of 128; only blocksize 64 is read"),
    ("codebook", DQ, None, lambda sd: sd["model.layers.1.mlp.up_proj.weight.quant_map"].mul_(0.5),
     dict(weight_format="nf4", quant_nested=True), False,
     r"'model.layers.1.mlp.up_proj.weight.quant_map' is not bitsandbytes' NF4 codebook"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_quantized_checkpoint_refused_before_reading(bnb_checkpoints, tmp_path, monkeypatch, case):
    """A quantized checkpoint in a format that is not read, or a policy that disagrees with
    its quantization_config, is a LoadError naming what was found, before any weight is read
    (before any tensor at all when the config says it; a packed weight's record and codebooks
    are read by the check, never a weight)."""
    from elastic_kernels.api import ElasticPolicy, load_elastic
    from elastic_kernels.api.loading import LoadError

    _, name, config, tensors, policy, nothing, pattern = case
    path = bnb_checkpoints[name]
    if config or tensors:
        path = _edited_copy(path, tmp_path / "edited", config, tensors)
    _no_reads(monkeypatch, records_too=nothing)
    with pytest.raises(LoadError, match=pattern):
        load_elastic(path, _bnb_lora(path), ElasticPolicy(chunk_bytes=65536, **policy))


def test_quantization_config_over_full_precision_files_is_refused(tmp_path, monkeypatch):
    """A config that says bitsandbytes 4-bit over files that hold full-precision weights (no
    packed weight at all) is refused before any tensor is read, not quantized on load."""
    import json

    from elastic_kernels.api import ElasticPolicy, load_elastic
    from elastic_kernels.api.loading import LoadError
    from elastic_kernels.api.nn import LoRAConfig

    _save(str(tmp_path), torch.float32)
    cfg_file = tmp_path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg[QC] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
               "bnb_4bit_use_double_quant": False}
    cfg_file.write_text(json.dumps(cfg))
    _no_reads(monkeypatch, records_too=True)
    with pytest.raises(LoadError, match=r"the config says the checkpoint is saved quantized \(bitsandbytes 4-bit nf4, "
                                        r"blocksize 64, double quantization False\), but no tensor of its files is packed"):
        load_elastic(str(tmp_path), LoRAConfig(r=4, alpha=8, target_modules=TARGETS), ElasticPolicy(weight_format="nf4"))


def test_packed_files_without_load_elastic_are_refused(bnb_checkpoints, monkeypatch):
    """A source that was not told the checkpoint's format (convert_to_elastic over a
    SafetensorsSource, as the CLI builds it) names the packed weights instead of comparing
    their uint8 shapes with the model's."""
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.loading import LoadError, SafetensorsSource, empty_model
    from elastic_kernels.api.nn import convert_to_elastic

    path = bnb_checkpoints[DQ]
    source = SafetensorsSource(path)
    _no_reads(monkeypatch, records_too=True)
    with pytest.raises(LoadError, match=r"do not fit the model: 14 weight\(s\) are stored packed by bitsandbytes "
                                        r"\('nf4' 4-bit\), e.g. 'model.layers.0.self_attn.q_proj.weight', and this "
                                        r"source reads full-precision tensors: load the checkpoint with "
                                        r"elastic_kernels.api.load_elastic"):
        convert_to_elastic(empty_model(path), _bnb_lora(path), ElasticPolicy(weight_format="nf4", quant_nested=True),
                           source=source)


def _full_precision_head_worker(rank, world_size, path, nested):
    from elastic_kernels.api import ElasticPolicy, load_elastic

    model = load_elastic(path, _bnb_lora(path), ElasticPolicy(chunk_bytes=65536, weight_format="nf4",
                                                              quant_nested=nested, replicate_below_bytes=0))
    formats = {et.name: (et.weight_format, et.dtype) for et in model._elastic_runtime.tensors}
    return formats, model.state_dict()["lm_head.weight"], model.model.embed_tokens.weight.dtype


def test_bitsandbytes_checkpoint_keeps_its_full_precision_head_and_compute_dtype(bnb_checkpoints, tmp_path):
    """transformers keeps lm_head in full precision in a bitsandbytes checkpoint; loaded with
    every linear elastic (replicate_below_bytes=0), it stays so, as the file holds it (not
    requantized), while the packed linears stay nf4. The model's dtype is the checkpoint's
    bnb_4bit_compute_dtype (bf16 here, over fp32 files), as transformers computes in it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cases = {"fp32": (bnb_checkpoints["llama-nf4"], False, torch.float32)}
    fp, path = str(tmp_path / "fp"), str(tmp_path / "bf16-compute")
    _bnb_base_model("llama").float().save_pretrained(fp, safe_serialization=True)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    AutoModelForCausalLM.from_pretrained(fp, quantization_config=q, dtype=torch.float32,
                                         device_map="cpu").save_pretrained(path, safe_serialization=True)
    cases["bf16 compute"] = (path, False, torch.bfloat16)
    for what, (p, nested, dtype) in cases.items():
        ((formats, head, embed_dtype),) = run_distributed(_full_precision_head_worker, 1, p, nested, timeout=300)
        sd = load_file(f"{p}/model.safetensors")
        assert sd["lm_head.weight"].dtype == torch.float32, what  # transformers kept it in full precision
        assert formats.pop("lm_head") == (None, dtype), (what, formats)
        assert set(formats.values()) == {("nf4", dtype)} and len(formats) == 2 * 7, (what, formats)
        assert embed_dtype == dtype, what
        assert torch.equal(head, sd["lm_head.weight"].to(dtype)), what  # the file's head, as it is


def _nan_before_quantizing(root) -> str:
    """transformers' bitsandbytes checkpoint of the llama whose q_proj held a NaN before it was
    quantized (its block's absmax comes out NaN)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    fp, out = str(root / "nan-fp"), str(root / "nan-nf4")
    model = _bnb_base_model("llama").float()
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[2, 7] = float("nan")
    model.save_pretrained(fp, safe_serialization=True)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(fp, quantization_config=q, dtype=torch.float32, device_map="cpu") \
        .save_pretrained(out, safe_serialization=True)
    return out


def _set(key, index, value):
    def edit(sd):
        sd[key].view(-1)[index] = value
    return edit


NONFINITE = [
    # (id, checkpoint, tensor edit, the weight named, its non-finite values: 64 per block whose scale is not finite)
    ("nan-absmax", "llama-nf4", _set("model.layers.0.mlp.up_proj.weight.absmax", 3, float("nan")),
     "model.layers.0.mlp.up_proj.weight", 64),
    # nested: one of 512 / 256 = 2 nested scales covers 256 blocks of 64 weights
    ("inf-nested-absmax", "llama-nf4-dq", _set("model.layers.1.mlp.up_proj.weight.nested_absmax", 1, float("inf")),
     "model.layers.1.mlp.up_proj.weight", 256 * 64),
    ("nan-before-quantizing", None, None, "model.layers.1.self_attn.q_proj.weight", 64),
    # issue 28: the last block of a [66, 688] weight is partial: 45408 - 709 x 64 = 32 weights
    ("nan-partial-block", "llama688-nf4", _set("model.layers.0.mlp.down_proj.weight.absmax", 709, float("nan")),
     "model.layers.0.mlp.down_proj.weight", 32),
]


@pytest.mark.parametrize("case", NONFINITE, ids=[c[0] for c in NONFINITE])
def test_nonfinite_scales_are_refused_or_warned(bnb_checkpoints, tmp_path, case):
    """load_elastic of a bitsandbytes checkpoint whose scales are not finite (issue 31 item 3):
    a LoadError naming the weight and its count of non-finite values, unless
    allow_nonfinite=True, which loads it with a NonFiniteWeightsWarning saying the same ([Note:
    non-finite weights on load]). The count is independent of the loader: 64 weights per block
    of bitsandbytes whose scale was edited (or came out NaN from bitsandbytes' own quantizer),
    fewer for the weight's partial last block."""
    import warnings

    from elastic_kernels.api import load_elastic
    from elastic_kernels.api.loading import LoadError, NonFiniteWeightsWarning, nonfinite_weights

    _, name, edit, weight, count = case
    path = _nan_before_quantizing(tmp_path) if name is None else _edited_copy(
        bnb_checkpoints[name], tmp_path / name, tensors=edit)  # the name tells _bnb_policy its nesting
    expected = rf"1 weight\(s\) hold NaN or Inf values: {weight} \({count} of \d+\) \(the checkpoint is bitsandbytes"
    with pytest.raises(LoadError, match=expected + r".*pass allow_nonfinite=True"):
        load_elastic(path, _bnb_lora(path), _bnb_policy(path, 4096))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = load_elastic(path, _bnb_lora(path), _bnb_policy(path, 4096), allow_nonfinite=True)
    msgs = [str(w.message) for w in seen if issubclass(w.category, NonFiniteWeightsWarning)]
    assert len(msgs) == 1 and __import__("re").search(expected, msgs[0]), msgs
    bad = nonfinite_weights(model)
    assert list(bad) == [weight] and bad[weight][0] == count


def test_finite_checkpoint_loads_without_the_warning(bnb_checkpoints):
    import warnings

    from elastic_kernels.api import load_elastic
    from elastic_kernels.api.loading import NonFiniteWeightsWarning, nonfinite_weights

    path = bnb_checkpoints["llama-nf4-dq"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWeightsWarning)
        model = load_elastic(path, _bnb_lora(path), _bnb_policy(path, 4096))
    assert nonfinite_weights(model) == {}


def _nonfinite_worker(rank, world_size, path):
    from elastic_kernels.api import ElasticPolicy, load_elastic
    from elastic_kernels.api.loading import LoadError
    from elastic_kernels.api.nn import LoRAConfig

    out = []
    for kw in (dict(), dict(weights_on="host"), dict(weight_format="nf4"), dict(weight_format="nf4", weights_on="host")):
        try:
            load_elastic(path, LoRAConfig(r=4, alpha=8, target_modules=TARGETS),
                         ElasticPolicy(chunk_bytes=64 * 4 * 7, replicate_below_bytes=0, **kw))
            out.append(None)
        except LoadError as exc:
            out.append(str(exc).split(": ", 1)[1])
    return out


def test_nonfinite_weights_counted_once_over_ranks(tmp_path):
    """On 2 ranks, weights on the device (each rank its shard) or on host (each rank its share of
    the node's store), full precision or quantized on load: every rank refuses with the same
    counts, each non-finite value counted once (2 NaN in the first row, one Inf in the last:
    different ranks' shares)."""
    model = quant_llama()
    with torch.no_grad():
        w = model.get_submodule("model.layers.1.mlp.down_proj").weight
        w[0, 5] = w[0, 7] = float("nan")
        w[-1, 3] = float("inf")
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    per_rank = run_distributed(_nonfinite_worker, 2, str(tmp_path), timeout=300)
    assert per_rank[0] == per_rank[1]
    for msg in per_rank[0]:
        assert msg is not None and msg.startswith(
            f"1 weight(s) hold NaN or Inf values: model.layers.1.mlp.down_proj.weight (3 of {w.numel()})"), msg
