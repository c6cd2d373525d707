"""Meta-device loading from safetensors files (python_api/loading/): parity with the in-memory
path, peak resident memory per rank, bad input.

Parity is bit for bit in fp32: both paths shard the same bytes with the same layout and run the
same kernels, so a wrong row, a wrong transpose (Conv1D), a wrong replicated tensor or buffer,
or a lost tie changes the losses; `torch.equal`, no tolerance.
"""

from __future__ import annotations

import gc
import json
import math
import os
import struct

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

VOCAB = 64
LLAMA_TARGETS = ("q_proj", "v_proj", "down_proj")
GPT2_TARGETS = ("c_attn", "c_fc")  # attn.c_proj / mlp.c_proj stay ElasticLinear (Conv1D too)
STEPS = 3


# ---------------------------------------------------------------------- model directories


def _llama(tied: bool, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def _gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg).float()


def write_models(root: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """kind -> (directory, LoRA targets): a Llama in one file (untied lm_head: elastic under
    replicate_below_bytes=0), a Llama with tied embeddings in 4 shards with an index file, a
    GPT-2 (Conv1D weights, tied lm_head)."""
    out = {
        "llama": (_llama(False, 0), LLAMA_TARGETS, {}),
        "llama_tied_sharded": (_llama(True, 1), LLAMA_TARGETS, {"max_shard_size": "20KB"}),
        "gpt2": (_gpt2(2), GPT2_TARGETS, {}),
    }
    dirs = {}
    for kind, (model, targets, kwargs) in out.items():
        path = os.path.join(root, kind)
        model.save_pretrained(path, **kwargs)
        dirs[kind] = (path, targets)
    assert os.path.isfile(os.path.join(dirs["llama_tied_sharded"][0], "model.safetensors.index.json"))
    return dirs


# ---------------------------------------------------------------------- parity


POLICY = dict(chunk_bytes=32 * 4 * 5, keep_ratio=0.5, persist_ratio=0.0, pool_budget_bytes=0, replicate_below_bytes=0)
# The host tier: the node's host store is filled through the same row readers.
HOST_POLICIES = [dict(POLICY, weights_on="host"), dict(POLICY, host_fraction=0.5)]


def _step_both(ref, new, ids) -> list[float]:
    from elastic_kernels.api.nn import lora_layers

    losses = []
    for _ in range(STEPS):
        l_ref = ref(input_ids=ids, labels=ids).loss
        l_new = new(input_ids=ids, labels=ids).loss
        assert torch.equal(l_ref, l_new), (l_ref.item(), l_new.item())
        l_ref.backward()
        l_new.backward()
        pairs = list(zip(lora_layers(ref), lora_layers(new)))
        assert pairs
        for (name, a), (name_b, b) in pairs:
            assert name == name_b
            for x, y in ((a.lora_A.weight, b.lora_A.weight), (a.lora_B.weight, b.lora_B.weight)):
                assert x.grad is not None and torch.equal(x.grad, y.grad), name
        with torch.no_grad():  # one SGD step on both
            for (_, a), (_, b) in pairs:
                for x, y in ((a.lora_A.weight, b.lora_A.weight), (a.lora_B.weight, b.lora_B.weight)):
                    x -= 0.5 * x.grad
                    y -= 0.5 * y.grad
                    x.grad = y.grad = None
        losses.append(l_new.item())
    return losses


def _parity(dirs, rank: int, policy: dict = POLICY) -> dict[str, list[float]]:
    from transformers import AutoModelForCausalLM

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.loading import load_elastic
    from elastic_kernels.api.nn import ElasticLinear, ElasticLoRALinear, LoRAConfig, convert_to_elastic

    out = {}
    for kind, (path, targets) in sorted(dirs.items()):
        lora = LoRAConfig(r=4, alpha=8, target_modules=targets)
        ref = convert_to_elastic(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora,
                                 ElasticPolicy(**policy))
        new = load_elastic(path, lora, ElasticPolicy(**policy))
        leftovers = [n for n, t in list(new.named_parameters()) + list(new.named_buffers()) if t.is_meta]
        assert not leftovers, f"{kind}: still on meta: {leftovers}"
        assert [type(m).__name__ for m in ref.modules()] == [type(m).__name__ for m in new.modules()], kind
        assert any(isinstance(m, ElasticLoRALinear) for m in new.modules())
        if kind == "llama":
            assert isinstance(new.lm_head, ElasticLinear)  # untied and large enough: elastic
        else:  # tied: replicated, one tensor under both names
            emb = new.get_input_embeddings().weight
            assert new.lm_head.weight is emb and not emb.is_meta, kind
            assert torch.equal(emb, ref.get_input_embeddings().weight), kind
        for (n, b), (_, b_ref) in zip(new.named_buffers(), ref.named_buffers()):
            assert torch.equal(b, b_ref), f"{kind}: buffer {n}"
        torch.manual_seed(3 + rank)  # each rank its own batch: gradients are averaged
        ids = torch.randint(0, VOCAB, (2, 9))
        out[kind] = _step_both(ref, new, ids)
    return out


def _parity_worker(rank, world_size, dirs, policies):
    return [_parity(dirs, rank, p) for p in policies]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return write_models(str(tmp_path_factory.mktemp("models")))


def test_matches_in_memory_one_process(model_dirs):
    """World size 1, no process group: load_elastic trains as convert_to_elastic of the same
    directory loaded by from_pretrained."""
    losses = _parity(model_dirs, 0)
    assert set(losses) == set(model_dirs) and all(math.isfinite(v) for ls in losses.values() for v in ls)


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_in_memory(model_dirs, world_size):
    policies = [POLICY] + (HOST_POLICIES if world_size == 2 else [])
    results = run_distributed(_parity_worker, world_size, model_dirs, policies, timeout=400)
    assert all(len(r) == len(policies) and all(set(x) == set(model_dirs) for x in r) for r in results)


# ---------------------------------------------------------------------- peak resident memory


def _write_safetensors_streaming(path: str, names_shapes, dtype=torch.float32, seed=0) -> int:
    """A safetensors file of random tensors written one tensor at a time (the writer never holds
    more than one); returns its bytes of tensor data."""
    assert dtype == torch.float32
    header, offset = {}, 0
    for name, shape in names_shapes:
        n = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    gen = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, shape in names_shapes:
            t = torch.randn(shape, generator=gen).mul_(0.02)
            f.write(t.numpy().tobytes())
            del t
    return offset


def write_wide_llama(path: str, hidden=1024, intermediate=8192, layers=2) -> int:
    """A 2-layer Llama whose frozen projections hold ~235 MB (fp32), written without building
    it: config.json, then the tensors' names and shapes from a meta model, streamed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from elastic_kernels.api.loading import params_on_meta

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64, tie_word_embeddings=False,
    )
    cfg.save_pretrained(path)
    with params_on_meta():
        model = LlamaForCausalLM(cfg)
    names_shapes = [(n, tuple(p.shape)) for n, p in model.state_dict().items()]
    return _write_safetensors_streaming(os.path.join(path, "model.safetensors"), names_shapes)


CHUNK = 1 << 20
MARGIN = 24 << 20  # the module objects of the empty model (~7 MiB measured), allocator slack


def _rss_worker(rank, world_size, path):
    import transformers.models.llama.modeling_llama  # noqa: F401 - code, not data: import it before measuring
    from transformers import AutoModelForCausalLM

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.finetune.measure import fix_mmap_threshold, reset_rss_peak, rss_peak_bytes
    from elastic_kernels.api.loading import load_elastic
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, runtime_of

    # Freed reads go back to the OS ([Note: a fixed mmap threshold]). Under glibc's dynamic
    # threshold the meta-loading growth wandered (132.8-137.4 MiB here, 139.65 in a CI run of
    # e77be89: 32 KiB over the bound); fixed, it read 132.5-133.2 MiB in 6 readings.
    fix_mmap_threshold()
    lora = LoRAConfig(r=4, alpha=8, target_modules="all-linear")
    policy = ElasticPolicy(chunk_bytes=CHUNK)
    out = {}
    base = reset_rss_peak()
    model = load_elastic(path, lora, policy)
    out["meta"] = rss_peak_bytes() - base
    rt = runtime_of(model)
    out["frozen"] = sum(et.nbytes for et in rt.tensors)
    out["shard"] = sum(et.shard.numel() * et.shard.element_size() for et in rt.tensors)
    out["replicated"] = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    with torch.no_grad():  # it runs
        assert torch.isfinite(model(input_ids=torch.randint(0, 256, (1, 4))).logits).all()
    del model, rt
    gc.collect()
    # Quantize on load (issue 20): each rank reads the rows its slices need, a chunk at a time,
    # and keeps only its shard of the nf4 image.
    base = reset_rss_peak()
    model = load_elastic(path, lora, ElasticPolicy(chunk_bytes=CHUNK, weight_format="nf4"))
    out["nf4"] = rss_peak_bytes() - base
    rt = runtime_of(model)
    out["nf4_shard"] = sum(et.shard.numel() * et.shard.element_size() for et in rt.tensors)
    del model, rt
    gc.collect()
    base = reset_rss_peak()
    ref = convert_to_elastic(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora, policy)
    out["in_memory"] = rss_peak_bytes() - base
    del ref
    gc.collect()
    # The CLI's FSDP2 baseline of the same directory ([Note: FSDP2 from the files]): meta build,
    # fully_shard, each rank's shard read from the files.
    # Code, not data: peft and FSDP2 are imported before measuring (~50 MiB of modules together).
    import peft  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from torch.distributed.tensor import DTensor

    from elastic_kernels.api.finetune import parse_args, prepare
    from elastic_kernels.api.finetune.engines import FSDP2Engine
    from elastic_kernels.api.finetune.models import resolved_targets

    job = prepare(parse_args(["--model", path, "--seq-len", "8", "--lora-targets", "all-linear", "--save-dir",
                              os.path.join(os.path.dirname(path), "out")]), rank, world_size, 0)
    _, shapes = resolved_targets(job.spec, job.cfg.lora, job.cfg.training.seed)
    job.initial_adapters = {k: torch.full(v, 0.01) for k, v in shapes.items()}
    base = reset_rss_peak()
    engine = FSDP2Engine(job, None)
    out["fsdp2"] = rss_peak_bytes() - base
    local = [p.to_local() if isinstance(p, DTensor) else p for p in engine.model.parameters()]
    out["fsdp2_shard"] = sum(t.numel() * t.element_size() for t in local)
    out["fsdp2_largest"] = max(t.numel() * t.element_size() for t in local)
    with torch.no_grad():  # it runs
        assert torch.isfinite(engine.model(input_ids=torch.randint(0, 256, (1, 4))).logits).all()
    return out


def test_meta_loading_peak_rss(tmp_path):
    """Two ranks load a ~235 MB model: each rank's resident set grows by about its half of the
    frozen weights (+ the small replicated tensors + one chunk read at a time), by its half of
    the nf4 image when quantizing on load (weight_format="nf4"), where building
    the model in memory first costs each rank a whole copy or more. The CLI's FSDP2 baseline
    of the same directory ([Note: FSDP2 from the files]) stays below the model's size too (it
    built the whole model in memory on every rank)."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("peak RSS needs Linux /proc/self/clear_refs")
    path = str(tmp_path / "wide")
    file_bytes = write_wide_llama(path)
    results = run_distributed(_rss_worker, 2, path, timeout=300)
    frozen = results[0]["frozen"]
    mib = 2**20
    for rank, r in enumerate(results):
        # Expected ([Note: loading from files]): this rank's shard (1/2 of the frozen bytes) + the
        # replicated tensors + one read at a time (a chunk's rows), + MARGIN.
        r["expected"] = r["shard"] + r["replicated"] + CHUNK
        print(f"rank {rank}: frozen weights {frozen / mib:.1f} MiB (file {file_bytes / mib:.1f} MiB); peak RSS growth: "
              f"meta loading {r['meta'] / mib:.1f} MiB ({r['meta'] / frozen:.2f}x; expected {r['expected'] / mib:.1f} "
              f"+ {MARGIN / mib:.0f} MiB margin), in-memory path {r['in_memory'] / mib:.1f} MiB "
              f"({r['in_memory'] / frozen:.2f}x)")
        # FSDP2 shards every parameter (embeddings too): this rank's shard + one read (a whole shard).
        r["fsdp2_expected"] = r["fsdp2_shard"] + r["fsdp2_largest"]
        print(f"rank {rank}: --baseline fsdp2 of the directory: peak RSS growth {r['fsdp2'] / mib:.1f} MiB "
              f"({r['fsdp2'] / file_bytes:.2f}x the model's {file_bytes / mib:.1f} MiB; expected "
              f"{r['fsdp2_expected'] / mib:.1f} + {MARGIN / mib:.0f} MiB margin)")
        # nf4 on load: this rank's shard of the image (~1/8 of its fp32 shard) + the replicated
        # tensors + one chunk's rows read and quantized at a time.
        r["nf4_expected"] = r["nf4_shard"] + r["replicated"] + CHUNK
        print(f"rank {rank}: nf4 on load: peak RSS growth {r['nf4'] / mib:.1f} MiB ({r['nf4'] / frozen:.3f}x the "
              f"fp32 frozen weights; expected {r['nf4_expected'] / mib:.1f} + {MARGIN / mib:.0f} MiB margin)")
    for rank, r in enumerate(results):
        # Below half of this rank's own fp32 share: no rank holds a full-precision copy of its
        # weights, let alone of the others' (measured 2026-12-02: 25.7 / 42.8 MiB on ranks 0 / 1
        # of 56 MiB; rank 1 quantizes the chunks whose scales its slices hold, reading all their
        # rows, which may be why it peaks higher: not separated).
        assert r["nf4"] < 0.25 * frozen, (rank, r)
        assert r["meta"] < r["expected"] + MARGIN, (rank, r)
        assert r["meta"] < 0.7 * frozen, (rank, r)
        assert r["fsdp2"] < r["fsdp2_expected"] + MARGIN, (rank, r)
        assert r["fsdp2"] < 0.7 * file_bytes, (rank, r)  # below the model's size (each rank built it whole before)
        # The measurement sees a whole copy where there is one (else the bound above proves nothing).
        assert r["in_memory"] > 0.9 * frozen, (rank, r)


# ---------------------------------------------------------------------- bad input


def _bad_dirs(root: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """kind -> (directory, substrings the error must contain)."""
    from safetensors.torch import save_file

    model = _llama(False, 0)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    cases = {
        "missing": ({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"},
                    ("model.layers.1.mlp.up_proj.weight", "is in none of the files", "(48, 32)")),
        "shape": ({**state, "model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 31)},
                  ("model.layers.0.self_attn.q_proj.weight", "model.safetensors", "has shape (32, 31)", "expects (32, 32)")),
        "dtype": ({**state, "model.layers.0.self_attn.k_proj.weight": state["model.layers.0.self_attn.k_proj.weight"].half()},
                  ("model.layers.0.self_attn.k_proj.weight", "model.safetensors", "float16", "expects float32")),
        "truncated": (state, ("model.safetensors", "not a valid safetensors file", "truncated")),
    }
    out = {}
    for kind, (tensors, expect) in cases.items():
        path = os.path.join(root, kind)
        os.makedirs(path)
        model.config.save_pretrained(path)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        if kind == "truncated":
            f = os.path.join(path, "model.safetensors")
            os.truncate(f, os.path.getsize(f) - 1000)
        out[kind] = (path, expect)
    path = os.path.join(root, "shard_missing")  # the index names a shard that is not there
    model.save_pretrained(path, max_shard_size="20KB")
    shard = sorted(f for f in os.listdir(path) if f.startswith("model-0"))[1]
    os.unlink(os.path.join(path, shard))
    out["shard_missing"] = (path, ("model.safetensors.index.json", shard, "is not a file"))
    return out


def _snapshot(path: str) -> dict:
    return {f: (os.stat(os.path.join(path, f)).st_size, os.stat(os.path.join(path, f)).st_mtime_ns)
            for f in sorted(os.listdir(path))}


def _bad_input(bad, good_path, rank: int, world_size: int) -> list[str]:
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.loading import LoadError, SafetensorsSource, load_elastic
    from elastic_kernels.api.nn import LoRAConfig

    reads = []
    real_rows, real_tensor = SafetensorsSource.rows, SafetensorsSource.tensor
    SafetensorsSource.rows = lambda self, *a, **k: reads.append(a) or real_rows(self, *a, **k)
    SafetensorsSource.tensor = lambda self, *a, **k: reads.append(a) or real_tensor(self, *a, **k)
    lora, policy = LoRAConfig(r=4, alpha=8, target_modules=LLAMA_TARGETS), ElasticPolicy()
    messages = []
    try:
        for kind, (path, expect) in sorted(bad.items()):
            before = _snapshot(path)
            with pytest.raises(LoadError) as info:
                load_elastic(path, lora, policy)
            msg = str(info.value)
            for s in expect:
                assert s in msg, (kind, s, msg)
            assert not reads, (kind, reads)  # nothing read before the check
            assert _snapshot(path) == before, kind  # nothing written
            messages.append(msg)
        if world_size > 1:
            # One rank's files differ: every rank fails (none is left waiting in a collective).
            path = bad["shape"][0] if rank == world_size - 1 else good_path
            with pytest.raises(LoadError, match=rf"\(on rank {world_size - 1}\)"):
                load_elastic(path, lora, policy)
    finally:
        SafetensorsSource.rows, SafetensorsSource.tensor = real_rows, real_tensor
    return messages


def _bad_input_worker(rank, world_size, bad, good_path):
    return _bad_input(bad, good_path, rank, world_size)


def test_bad_input(tmp_path, model_dirs):
    """A missing tensor, a wrong shape, a wrong dtype, a truncated file, a missing shard: a
    LoadError naming the tensor, the file, expected and found, on every rank, before anything is
    read or written."""
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.loading import load_elastic
    from elastic_kernels.api.nn import LoRAConfig

    bad = _bad_dirs(str(tmp_path))
    good = model_dirs["llama"][0]
    msgs = _bad_input(bad, good, 0, 1)
    for m in msgs:
        print(m)
    results = run_distributed(_bad_input_worker, 2, bad, good, timeout=240)
    assert results[0] == results[1] == msgs
    # With an explicit dtype, a floating tensor of another dtype is cast on load (from_pretrained's rule).
    model = load_elastic(bad["dtype"][0], LoRAConfig(r=4, alpha=8, target_modules=LLAMA_TARGETS), ElasticPolicy(),
                         dtype=torch.float32)
    assert model.model.layers[0].self_attn.k_proj.weight.dtype == torch.float32


# ---------------------------------------------------------------------- the CLI's --model DIR


def _cli_engine_worker(rank, world_size, mdir):
    from elastic_kernels.api.finetune import parse_args, prepare
    from elastic_kernels.api.finetune.engines import ElasticEngine
    from elastic_kernels.api.loading import SafetensorsSource
    from tests.finetune.test_finetune import TINY

    reads = []
    real_rows = SafetensorsSource.rows
    SafetensorsSource.rows = lambda self, *a, **k: reads.append(a[0]) or real_rows(self, *a, **k)
    try:
        job = prepare(parse_args(TINY[12:] + ["--model", mdir, "--steps", "1"]), rank, world_size, 0)
        engine = ElasticEngine(job, job.args.pool_budget)
    finally:
        SafetensorsSource.rows = real_rows
    assert {f"{et.name}.weight" for et in engine.runtime.tensors} <= set(reads)  # every elastic weight by rows
    assert not any(t.is_meta for t in list(engine.model.parameters()) + list(engine.model.buffers()))
    assert engine.model.training
    return True


def test_cli_model_dir_loads_by_rows(tmp_path):
    """`--model DIR`: the elastic engine builds on meta and reads each rank's rows from the
    files; a 2-rank run trains bit-identically to the embedded model with the same weights
    (the directory holds embedded_model(seed=3)), which is built in memory."""
    from tests.finetune.test_finetune import TINY, _tiny_model_dir, summary_of, torchrun

    mdir = _tiny_model_dir(str(tmp_path / "model"))
    assert run_distributed(_cli_engine_worker, 2, mdir, timeout=240) == [True, True]
    # With the FSDP2 baseline as well: built in memory for the embedded model, on meta from the
    # files for the directory ([Note: FSDP2 from the files]); the same weights, so the same losses.
    common = ["--steps", "3", "--seed", "3", "--baseline", "fsdp2"]
    a, b = str(tmp_path / "embedded"), str(tmp_path / "dir")
    torchrun(TINY + common + ["--save-dir", a], what="embedded run")
    torchrun(TINY[12:] + common + ["--model", mdir, "--save-dir", b], what="--model DIR run")
    (ea, fa), (eb, fb) = summary_of(a)["runs"], summary_of(b)["runs"]
    assert fa["kind"] == fb["kind"] == "fsdp2"
    assert len(ea["losses"]) == 3 and ea["losses"] == eb["losses"], (ea["losses"], eb["losses"])
    assert fa["losses"] == fb["losses"], (fa["losses"], fb["losses"])  # FSDP2 from the files = in memory, bit for bit
    assert eb["loss_gap_vs_fsdp2"] == "within rounding" and not summary_of(b)["warnings"]


def test_cli_tied_config_over_untied_files(tmp_path):
    """The CLI on a directory whose config ties the head to the embeddings while the files hold
    their own head: the elastic run tied them without a word and reported a 0.197 loss gap to
    FSDP2 (which loads the files' head) as a plain number. Both runs now load the files' head:
    the same losses within the FSDP2 tolerance, and the untie named once, on rank 0."""
    from tests.finetune.test_finetune import LOSS_TOL, TINY, _tiny_model_dir, summary_of, torchrun

    mdir = _tiny_model_dir(str(tmp_path / "model"))
    _retie(mdir, True)
    out = str(tmp_path / "out")
    _, _, err = torchrun(TINY[12:] + ["--model", mdir, "--steps", "3", "--baseline", "fsdp2", "--save-dir", out],
                         what="tied config over untied files")
    elastic, fsdp2 = summary_of(out)["runs"]
    diff = max(abs(x - y) for x, y in zip(elastic["losses"], fsdp2["losses"]))
    assert diff <= LOSS_TOL, (diff, elastic["losses"], fsdp2["losses"])
    untie = [ln for ln in err.splitlines() if ln.startswith("elastic-finetune: warning:") and "loaded untied" in ln]
    assert len(untie) == 1 and "lm_head.weight" in untie[0], err[-4000:]


# ---------------------------------------------------------------------- casting on load (the CLI's --dtype)


@pytest.mark.parametrize("file_dtype,load_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
])
def test_cast_on_load_matches_from_pretrained(tmp_path, file_dtype, load_dtype):
    """`load_elastic(dtype=...)` (what `--dtype` does for `--model DIR`) loads what
    `from_pretrained(dtype=...)` loads: every replicated tensor equal bit for bit, the same
    dtypes, and bit-identical losses and adapter gradients over a few steps (same bytes, same
    layout, same kernels; see the module docstring). Files in fp32 cast down to bf16 / fp16,
    files in bf16 cast up to fp32."""
    from transformers import AutoModelForCausalLM

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.loading import load_elastic
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    path = str(tmp_path / "model")
    _llama(False, 5).to(file_dtype).save_pretrained(path)
    lora = LoRAConfig(r=4, alpha=8, target_modules=LLAMA_TARGETS)
    pretrained = AutoModelForCausalLM.from_pretrained(path, dtype=load_dtype)
    want = {n: t.clone() for n, t in list(pretrained.named_parameters()) + list(pretrained.named_buffers())}
    ref = convert_to_elastic(pretrained, lora, ElasticPolicy(**POLICY))
    new = load_elastic(path, lora, ElasticPolicy(**POLICY), dtype=load_dtype)
    replicated = {n: t for n, t in list(new.named_parameters()) + list(new.named_buffers())
                  if "lora_" not in n and n in want}
    assert "model.embed_tokens.weight" in replicated and "model.norm.weight" in replicated
    for n, t in replicated.items():
        assert t.dtype == want[n].dtype and torch.equal(t, want[n]), n
    from elastic_kernels.api.nn import runtime_of

    assert {et.dtype for et in runtime_of(new).tensors} == {load_dtype}
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 9))
    losses = _step_both(ref, new, ids)
    assert all(math.isfinite(x) for x in losses)


# ---------------------------------------------------------------------- the files say more than the config


def _retie(path: str, tie: bool, **config) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["tie_word_embeddings"] = tie
    cfg.update(config)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def test_tied_config_over_untied_files(tmp_path):
    """config.json says tie_word_embeddings=true, the files hold their own, different
    lm_head.weight: transformers 5.23's from_pretrained keeps the files' head (untied) and
    warns; load_elastic must do the same (it tied the head to the embeddings without a word:
    logits off by ~1.4). Same logits as from_pretrained, bit for bit; a LoadWarning naming both
    tensors. Control: the same config over files whose two tensors are equal stays tied, silently."""
    import warnings

    from transformers import AutoModelForCausalLM

    from elastic_kernels.api import ElasticPolicy, loading
    from elastic_kernels.api.loading import load_elastic
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    path = str(tmp_path / "untied")
    source_model = _llama(False, 7)
    source_model.save_pretrained(path)
    _retie(path, True)
    lora = LoRAConfig(r=4, alpha=8, target_modules=LLAMA_TARGETS)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert ref.lm_head.weight is not ref.model.embed_tokens.weight  # transformers keeps the files' head
    ref = convert_to_elastic(ref, lora, ElasticPolicy())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = load_elastic(path, lora, ElasticPolicy())
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = new(input_ids=ids).logits, ref(input_ids=ids).logits
        tied_logits = torch.nn.functional.linear(new.model(input_ids=ids).last_hidden_state,
                                                 source_model.model.embed_tokens.weight)
    assert (want - tied_logits).abs().max() > 0.1  # the tied model's logits are elsewhere: the check can fail
    assert torch.equal(got, want), f"max |logits - from_pretrained's| = {(got - want).abs().max():.3g}"
    assert new.lm_head.weight is not new.model.embed_tokens.weight
    assert torch.equal(new.lm_head.weight, source_model.lm_head.weight)
    assert torch.equal(new.model.embed_tokens.weight, source_model.model.embed_tokens.weight)
    untie = [w for w in caught if "untied" in str(w.message)]
    assert len(untie) == 1 and "lm_head.weight" in str(untie[0].message) and "embed_tokens" in str(untie[0].message), \
        [str(w.message) for w in caught]
    assert issubclass(untie[0].category, loading.LoadWarning)

    # Control: a tied model saved with both names holding the same tensor (as .bin files did).
    from safetensors.torch import load_file, save_file

    same = str(tmp_path / "same")
    _llama(True, 8).save_pretrained(same)
    state = load_file(os.path.join(same, "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, os.path.join(same, "model.safetensors"), metadata={"format": "pt"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tied = load_elastic(same, lora, ElasticPolicy())
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert not [w for w in caught if issubclass(w.category, loading.LoadWarning)], [str(w.message) for w in caught]


def test_config_with_fewer_layers_than_the_files_warns(tmp_path):
    """A config of 1 layer over files of 2: from_pretrained lists the unexpected keys; load_elastic
    trained the shorter model without a word. A LoadWarning naming the unused tensors (and the
    config's layer count); the model loads and runs."""
    import warnings

    from elastic_kernels.api import ElasticPolicy, loading
    from elastic_kernels.api.loading import load_elastic
    from elastic_kernels.api.nn import LoRAConfig

    path = str(tmp_path / "short")
    _llama(False, 9).save_pretrained(path)
    _retie(path, False, num_hidden_layers=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_elastic(path, LoRAConfig(r=4, alpha=8, target_modules=LLAMA_TARGETS), ElasticPolicy())
    assert len(model.model.layers) == 1
    found = [w for w in caught if "not used by the model" in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in caught]
    msg = str(found[0].message)
    assert "9 tensor(s)" in msg and "model.layers.1.mlp.down_proj.weight" in msg and "num_hidden_layers=1" in msg, msg
    assert issubclass(found[0].category, loading.LoadWarning)


# ---------------------------------------------------------------------- arguments and unreadable files


def test_load_elastic_checks_its_arguments(model_dirs):
    """policy=None, device="meta", a model class of another architecture: a clear error naming
    the argument, before anything is read (they raised AttributeError / RuntimeError from deep
    inside)."""
    from transformers import GPT2LMHeadModel

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.loading import LoadError, load_elastic
    from elastic_kernels.api.nn import LoRAConfig

    path = model_dirs["llama"][0]
    lora = LoRAConfig(r=4, alpha=8, target_modules=LLAMA_TARGETS)
    with pytest.raises(TypeError, match="policy must be a elastic_kernels.api.ElasticPolicy, got NoneType"):
        load_elastic(path, lora, None)
    with pytest.raises(TypeError, match="lora must be a elastic_kernels.api.LoRAConfig"):
        load_elastic(path, {"r": 4}, ElasticPolicy())
    with pytest.raises(ValueError, match="device='meta' holds no data"):
        load_elastic(path, lora, ElasticPolicy(), device="meta")
    with pytest.raises(ValueError, match="is not a torch device"):
        load_elastic(path, lora, ElasticPolicy(), device="gpu0")
    with pytest.raises(LoadError, match="model_class GPT2LMHeadModel takes a GPT2Config, but the model's config is a "
                                        "LlamaConfig"):
        load_elastic(path, lora, ElasticPolicy(), model_class=GPT2LMHeadModel)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        load_elastic(path, lora, ElasticPolicy(), dtype="bfloat16")


def _entry_cases(root: str) -> dict[str, tuple[str, str]]:
    """Directory entries that are not readable regular files, made in ways that work as root:
    kind -> (model directory, what the error must say)."""
    model = _llama(False, 0)
    cases = {}

    def fresh(kind):
        path = os.path.join(root, kind)
        model.save_pretrained(path)
        return path

    p = fresh("config_fifo")
    os.unlink(os.path.join(p, "config.json"))
    os.mkfifo(os.path.join(p, "config.json"))
    cases["config_fifo"] = (p, "config.json is a FIFO (named pipe), not a regular file")
    p = fresh("config_dir")
    os.unlink(os.path.join(p, "config.json"))
    os.mkdir(os.path.join(p, "config.json"))
    cases["config_dir"] = (p, "config.json is a directory, not a regular file")
    p = fresh("config_dangling")
    os.unlink(os.path.join(p, "config.json"))
    os.symlink(os.path.join(root, "gone.json"), os.path.join(p, "config.json"))
    cases["config_dangling"] = (p, "config.json is a symbolic link to '" + os.path.join(root, "gone.json")
                                + "', which does not exist")
    p = fresh("weights_dangling")
    os.unlink(os.path.join(p, "model.safetensors"))
    os.symlink(os.path.join(root, "gone.safetensors"), os.path.join(p, "model.safetensors"))
    cases["weights_dangling"] = (p, "model.safetensors is a symbolic link to '" + os.path.join(root, "gone.safetensors")
                                 + "', which does not exist")
    p = fresh("weights_fifo")
    os.unlink(os.path.join(p, "model.safetensors"))
    os.mkfifo(os.path.join(p, "model.safetensors"))
    cases["weights_fifo"] = (p, "model.safetensors is a FIFO (named pipe), not a regular file")
    return cases


def test_entries_that_are_not_regular_files(tmp_path):
    """config.json or the weights file as a FIFO (opening one for reading blocks: a hang), a
    directory or a dangling symbolic link: load_elastic and the CLI name what the entry is
    (they said "has no config.json", "not a valid safetensors file (truncated or corrupt?)":
    No such file or directory", or blocked)."""
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.finetune import FinetuneError
    from elastic_kernels.api.loading import LoadError, load_elastic
    from elastic_kernels.api.nn import LoRAConfig

    lora = LoRAConfig(r=4, alpha=8, target_modules=LLAMA_TARGETS)
    for kind, (path, expect) in _entry_cases(str(tmp_path)).items():
        with pytest.raises(LoadError) as info:
            load_elastic(path, lora, ElasticPolicy())
        assert expect in str(info.value), (kind, str(info.value))
        with pytest.raises(FinetuneError) as info:
            _cli_prepare(path, str(tmp_path / "out"))
        assert expect in str(info.value), (kind, str(info.value))
    assert not os.path.exists(tmp_path / "out")


def _cli_prepare(mdir: str, save_dir: str):
    from elastic_kernels.api.finetune import parse_args, prepare

    return prepare(parse_args(["--model", mdir, "--seq-len", "8", "--save-dir", save_dir]), 0, 1, 0)


def _unprivileged_checks(root: str) -> dict:
    """In the (forked, unprivileged) child: for each case, whether the permission is really
    denied, and what load_elastic and the CLI's prepare() say."""
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.finetune import FinetuneError, parse_args, prepare
    from elastic_kernels.api.loading import LoadError, load_elastic
    from elastic_kernels.api.nn import LoRAConfig

    out = {}
    for kind in ("shard", "config", "directory"):
        path = os.path.join(root, kind)
        probe = {"shard": os.path.join(path, "model.safetensors"), "config": os.path.join(path, "config.json"),
                 "directory": path}[kind]
        try:  # is the permission really denied here? (it is not to a privileged process)
            os.listdir(probe) if kind == "directory" else open(probe, "rb").close()
            out[kind] = {"denied": False}
            continue
        except PermissionError:
            pass
        res = {"denied": True}
        try:
            load_elastic(path, LoRAConfig(r=4, alpha=8, target_modules=("q_proj",)), ElasticPolicy())
            res["load"] = "loaded"
        except LoadError as exc:
            res["load"] = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            res["load"] = f"RAW {type(exc).__name__}: {exc}"
        try:
            prepare(parse_args(["--model", path, "--seq-len", "8", "--save-dir", os.path.join(root, "out-" + kind)]),
                    0, 1, 0)
            res["cli"] = "prepared"
        except FinetuneError as exc:
            res["cli"] = str(exc)
        except Exception as exc:  # noqa: BLE001
            res["cli"] = f"RAW {type(exc).__name__}: {exc}"
        out[kind] = res
    return out


def _run_forked_as(uid: int | None, fn, *args, timeout: float = 120.0):
    """fn(*args) in a forked child (as `uid` when given: root may drop to any user, and a forked
    child needs no interpreter binary that user may execute); its JSON result, or an
    AssertionError with the child's traceback. The child is killed past `timeout`."""
    import time
    import traceback

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            payload = json.dumps({"ok": fn(*args)})
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            payload, code = json.dumps({"error": traceback.format_exc()}), 1
        try:
            os.write(w, payload.encode())
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise AssertionError(f"the child did not finish within {timeout:.0f} s")
            time.sleep(0.1)
        while True:
            data = os.read(r, 1 << 16)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(r)
    result = json.loads(b"".join(chunks).decode() or '{"error": "the child wrote nothing"}')
    if "error" in result:
        raise AssertionError(f"the child failed:\n{result['error']}")
    return result["ok"]


def test_unreadable_files_are_named(tmp_path):
    """A shard, config.json or the model directory without read permission: the error says
    "Permission denied" and names the file (it said "No such file or directory" for the shard,
    raised a raw PermissionError from the CLI for config.json, and "has no config.json" for the
    directory). Root reads everything, so as root the checks run in a forked child that drops
    to the unprivileged user 65534 (nobody); the child first checks that the permission is
    really denied to it."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="elastic-perm-", dir="/tmp")  # tmp_path's parents are 0700 (root only)
    try:
        os.chmod(root, 0o755)
        model = _llama(False, 0)
        for kind in ("shard", "config", "directory"):
            path = os.path.join(root, kind)
            model.save_pretrained(path)
            for f in os.listdir(path):
                os.chmod(os.path.join(path, f), 0o644)
            os.chmod(path, 0o755)
        os.chmod(os.path.join(root, "shard", "model.safetensors"), 0)
        os.chmod(os.path.join(root, "config", "config.json"), 0)
        os.chmod(os.path.join(root, "directory"), 0)
        out = _run_forked_as(65534 if os.geteuid() == 0 else None, _unprivileged_checks, root)
    finally:
        for dirpath, dirs, _ in os.walk(root):
            for d in dirs:
                os.chmod(os.path.join(dirpath, d), 0o755)
        shutil.rmtree(root, ignore_errors=True)
    if not any(r["denied"] for r in out.values()):
        pytest.skip("the permission is not denied even to an unprivileged user here (a file system without "
                    "permission checks)")
    expect = {
        "shard": "cannot read the weights file " + os.path.join(root, "shard", "model.safetensors") + ": Permission denied",
        "config": "cannot read the model's config " + os.path.join(root, "config", "config.json") + ": Permission denied",
        "directory": "cannot read model directory " + os.path.join(root, "directory") + ": Permission denied",
    }
    for kind, res in out.items():
        assert res["denied"], kind
        for where in ("load", "cli"):
            assert expect[kind] in res[where], (kind, where, res[where])
