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
    from python_api.nn import lora_layers

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

    from python_api import ElasticPolicy
    from python_api.loading import load_elastic
    from python_api.nn import ElasticLinear, ElasticLoRALinear, LoRAConfig, convert_to_elastic

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

    from python_api.loading import params_on_meta

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

    from python_api import ElasticPolicy
    from python_api.finetune.measure import reset_rss_peak, rss_peak_bytes
    from python_api.loading import load_elastic
    from python_api.nn import LoRAConfig, convert_to_elastic, runtime_of

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
    base = reset_rss_peak()
    ref = convert_to_elastic(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora, policy)
    out["in_memory"] = rss_peak_bytes() - base
    del ref
    return out


def test_meta_loading_peak_rss(tmp_path):
    """Two ranks load a ~235 MB model: each rank's resident set grows by about its half of the
    frozen weights (+ the small replicated tensors + one chunk read at a time), where building
    the model in memory first costs each rank a whole copy or more."""
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
    for rank, r in enumerate(results):
        assert r["meta"] < r["expected"] + MARGIN, (rank, r)
        assert r["meta"] < 0.7 * frozen, (rank, r)
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
    from python_api import ElasticPolicy
    from python_api.loading import LoadError, SafetensorsSource, load_elastic
    from python_api.nn import LoRAConfig

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
            with pytest.raises(LoadError, match=rf"on rank\(s\) \[{world_size - 1}\]"):
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
    from python_api import ElasticPolicy
    from python_api.loading import load_elastic
    from python_api.nn import LoRAConfig

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
    from python_api.finetune import parse_args, prepare
    from python_api.finetune.engines import ElasticEngine
    from python_api.loading import SafetensorsSource
    from tests.finetune.test_finetune import TINY

    reads = []
    real_rows = SafetensorsSource.rows
    SafetensorsSource.rows = lambda self, *a, **k: reads.append(a[0]) or real_rows(self, *a, **k)
    try:
        job = prepare(parse_args(TINY[10:] + ["--model", mdir, "--steps", "1"]), rank, world_size, 0)
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
    common = ["--steps", "3", "--seed", "3"]
    a, b = str(tmp_path / "embedded"), str(tmp_path / "dir")
    torchrun(TINY + common + ["--save-dir", a], what="embedded run")
    torchrun(TINY[10:] + common + ["--model", mdir, "--save-dir", b], what="--model DIR run")
    la, lb = summary_of(a)["runs"][0]["losses"], summary_of(b)["runs"][0]["losses"]
    assert len(la) == 3 and la == lb, (la, lb)
