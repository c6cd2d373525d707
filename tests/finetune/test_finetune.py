"""The fine-tuning CLI (python -m elastic_kernels.api.finetune) end to end, on 2 gloo ranks under torchrun.

Every run uses a tiny embedded Llama (hidden 32, 2 layers, vocabulary 257) on the embedded
corpus, 8 sequences of 24 tokens per step; each launch takes ~15-25 s on the 2-core machine.

[Note: the elastic-vs-FSDP2 tolerance]
Both runs train the same base weights from the same adapter values on the same batches with
the same AdamW; they differ only in fp32 summation order (chunked GEMMs, all-reduce vs
reduce-scatter, where PEFT adds the LoRA term). One fp32 ulp of a loss near 5.5 is 4.8e-7.
Measured max |loss difference| (2026-11-29, this machine): 1.2e-7 over 8 steps (this file's
config) and 2.4e-7 over 40 steps (the `make demo` config, 4 ranks). The test allows 1e-5: about
20 ulps, 40x the largest measured difference. Mistakes it must catch move the curves by far
more (measured by planting each in this file's config): a baseline that starts from trained
instead of initial adapters, 0.24 from step 1; ranks that skip the gradient all-reduce, 1.2e-3
at step 2 and 1.9e-2 at most; a LoRA scaling of alpha instead of alpha/r, 1e-3 at step 2 and
6.8e-2 at most.

Exact comparisons (resume, two-node launch): the same ranks issue the same collectives over
the same gloo algorithms in the same order, so on CPU the losses are bit-identical; a resumed
run must reproduce every loss and every adapter bit (its pool budget also differs, which the
correctness invariant says cannot change a bit).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIMS = dict(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
TINY = [
    "--model", "tiny", "--hidden-size", "32", "--intermediate-size", "48", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2",
    "--seq-len", "24", "--micro-batch", "2", "--grad-accum", "2", "--chunk-kib", "1",
    "--lora-r", "4", "--lora-alpha", "8", "--lr", "1e-2", "--no-progress", "--save-probe", "--sample-tokens", "0",
]
STEPS = 8
LOSS_TOL = 1e-5  # see [Note: the elastic-vs-FSDP2 tolerance]
LAUNCH_TIMEOUT_S = 240


# ------------------------------------------------------------------------------- launching


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _start(launcher_args: list[str], job_args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher_args, "-m", "elastic_kernels.api.finetune", *job_args]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, what: str, timeout: float = LAUNCH_TIMEOUT_S):
    """(returncode, stdout, stderr); a launch that outlives `timeout` is killed with its
    whole process group and fails the test."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what} did not finish within {timeout:.0f} s (hang?)\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}")
    return proc.returncode, out, err


def torchrun(job_args: list[str], nproc: int = 2, what: str = "torchrun", expect_ok: bool = True):
    rc, out, err = _finish(_start(["--standalone", f"--nproc-per-node={nproc}"], job_args), what)
    if expect_ok and rc != 0:
        pytest.fail(f"{what} exited with {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-6000:]}")
    return rc, out, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summary_of(save_dir) -> dict:
    with open(os.path.join(save_dir, "summary.json")) as f:
        return json.load(f)


def _tree_digest(folder) -> dict:
    """Every file under `folder` (hidden ones included) -> sha256 and mtime."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            p = os.path.join(root, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, folder)] = (hashlib.sha256(f.read()).hexdigest(), os.stat(p).st_mtime_ns)
    return out


# ------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """STEPS steps on 2 ranks: the elastic run at full budget and the FSDP2 baseline."""
    d = str(tmp_path_factory.mktemp("finetune") / "full")
    torchrun(TINY + ["--steps", str(STEPS), "--baseline", "fsdp2", "--save-dir", d], what="reference run")
    return d, summary_of(d)


@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory):
    """With LoRA dropout (so the RNG states matter): STEPS steps uninterrupted, and STEPS/2
    steps (checkpointed every 2) that the resume test continues. At pool budget 0: the resume
    test continues at another budget whose weights are paged too (chunk by chunk, as at budget
    0); budget all holds whole weights as resident runs, one GEMM each ([Note: resident runs]),
    which changes the fp32 summation order, not only where the bytes live."""
    base = tmp_path_factory.mktemp("dropout")
    full, half = str(base / "full"), str(base / "half")
    args = TINY + ["--lora-dropout", "0.1", "--pool-budget", "0"]
    torchrun(args + ["--steps", str(STEPS), "--save-dir", full], what="uninterrupted dropout run")
    torchrun(args + ["--steps", str(STEPS // 2), "--save-every", "2", "--save-dir", half], what="half run")
    return args, full, half


# ------------------------------------------------------------------------------- end to end


def test_loss_goes_down_and_matches_fsdp2(reference_run):
    d, summary = reference_run
    elastic, fsdp2 = summary["runs"]
    assert elastic["kind"] == "elastic" and fsdp2["kind"] == "fsdp2"
    assert len(elastic["losses"]) == len(fsdp2["losses"]) == STEPS
    losses = elastic["losses"]
    # A random model starts near the uniform loss ln(257) = 5.549; LoRA must bring it down.
    assert abs(losses[0] - math.log(257)) < 0.05, losses
    assert sum(losses[-3:]) / 3 < losses[0] - 0.1, losses
    assert elastic["heldout_loss"] < math.log(257) - 0.05, elastic["heldout_loss"]
    diff = max(abs(a - b) for a, b in zip(losses, fsdp2["losses"]))
    assert diff <= LOSS_TOL, f"elastic and FSDP2 loss curves differ by {diff:.3g} (> {LOSS_TOL}):\n{losses}\n{fsdp2['losses']}"
    assert elastic["max_abs_loss_diff_vs_fsdp2"] == diff

    # Traffic: the runtime's own count equals the independent all-gather counter, step by step;
    # at full budget everything is gathered in step 1 and nothing afterwards; FSDP2 gathers
    # the same non-zero amount every step.
    assert elastic["allgather_bytes_per_step"] == elastic["allgather_bytes_counted_per_step"]
    first, *rest = elastic["allgather_bytes_per_step"]
    assert first > 0 and rest == [0] * (STEPS - 1)
    assert elastic["runtime_stats"]["pool_misses"] > 0 and elastic["runtime_stats"]["pool_hits"] > 0
    f_steps = fsdp2["allgather_bytes_per_step"]
    assert f_steps[0] > 0 and f_steps == [f_steps[0]] * STEPS
    assert elastic["tokens_per_step"] == 2 * 2 * 2 * 24

    # The report: table (markdown, CSV), losses, picture, adapter, checkpoint.
    with open(os.path.join(d, "results.md")) as f:
        table = f.read()
    for name in (elastic["name"], fsdp2["name"], "tokens/s", "peak memory MiB", "all-gather MiB/step"):
        assert name in table
    with open(os.path.join(d, "finetune.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(d, "losses.csv")) as f:
        rows = f.read().strip().splitlines()
    assert len(rows) == STEPS + 1 and float(rows[1].split(",")[1]) == losses[0]
    for name in ("adapter/adapter_model.safetensors", "adapter/adapter_config.json", "probe.safetensors",
                 "checkpoint/optimizer.pt", "checkpoint/rng_rank0.pt", "checkpoint/rng_rank1.pt"):
        assert os.path.isfile(os.path.join(d, name)), name
    assert not os.path.exists(os.path.join(d, ".checkpoint-tmp"))


def test_adapter_loads_in_peft_and_reproduces_logits(reference_run):
    """The exported adapter on the same base model, through PEFT's own loader, gives the
    trained elastic model's logits on the held-out probe batch. Tolerance as in
    tests/nn/test_lora.py: chunked vs whole GEMMs, hidden <= 48, fp32: rtol = atol = 1e-4."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from elastic_kernels.api.finetune import embedded_config, embedded_model

    d, _ = reference_run
    probe = load_file(os.path.join(d, "probe.safetensors"))
    base = embedded_model(embedded_config(**DIMS), seed=0).eval()
    with torch.no_grad():
        base_logits = base(input_ids=probe["input_ids"]).logits
    model = PeftModel.from_pretrained(base, os.path.join(d, "adapter")).eval()
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)
    # The adapter is trained: without it the logits are elsewhere (so the check above can fail).
    assert (base_logits - probe["logits"]).abs().max() > 1e-2


def test_resume_reproduces_the_uninterrupted_run(dropout_runs, tmp_path):
    args, full, half = dropout_runs
    # Continue a copy of the half run in its folder (the bad-input tests use the original),
    # with another pool budget (residency only: one 1 KiB chunk kept beyond its use; below the
    # smallest weight's bytes, k/v's 16 x 32 x 4 = 2 KiB, so every weight stays paged: a budget
    # holding a weight whole computes it in one GEMM, [Note: resident runs]).
    resumed = str(tmp_path / "resumed")
    shutil.copytree(half, resumed)
    torchrun(args + ["--steps", str(STEPS), "--resume", resumed, "--pool-budget", "1KiB"], what="resumed run")
    want, got = summary_of(full)["runs"][0], summary_of(resumed)["runs"][0]
    assert summary_of(resumed)["resumed_from"] == os.path.join(resumed, "checkpoint")
    assert got["first_step"] == STEPS // 2 + 1 and got["steps_run"] == STEPS - STEPS // 2
    assert got["losses"] == want["losses"], f"resumed {got['losses']}\nuninterrupted {want['losses']}"
    from safetensors.torch import load_file

    a = load_file(os.path.join(full, "adapter", "adapter_model.safetensors"))
    b = load_file(os.path.join(resumed, "adapter", "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # Dropout is on and the losses differ from the dropout-free reference: the RNG mattered.
    with open(os.path.join(full, "checkpoint", "trainer_state.json")) as f:
        assert json.load(f)["step"] == STEPS


def test_two_node_launch_matches_single_node(reference_run, tmp_path):
    d, summary = reference_run
    port = _free_port()
    out = str(tmp_path / "two-node")
    job = TINY + ["--steps", str(STEPS), "--save-dir", out]
    procs = [
        _start(["--nnodes=2", "--nproc-per-node=1", f"--node-rank={n}", "--master-addr=127.0.0.1",
                f"--master-port={port}"], job)
        for n in (0, 1)
    ]
    results = [_finish(p, f"node {n}") for n, p in enumerate(procs)]
    for n, (rc, o, e) in enumerate(results):
        assert rc == 0, f"node {n} exited with {rc}\n{o[-2000:]}\n{e[-4000:]}"
    two = summary_of(out)
    assert two["world_size"] == 2
    assert two["runs"][0]["losses"] == summary["runs"][0]["losses"]


# ------------------------------------------------------------------------------- bad input


def _prepare(argv, world_size=2, rank=0):
    from elastic_kernels.api.finetune import parse_args, prepare

    return prepare(parse_args(argv), rank, world_size, 0)


def _tiny_model_dir(path, vocab=None, tokenizer=False):
    """save_pretrained of the tiny embedded model (vocabulary changed if asked)."""
    from elastic_kernels.api.finetune import embedded_config, embedded_model

    cfg = embedded_config(**DIMS)
    if vocab is not None:
        cfg.vocab_size = vocab
    embedded_model(cfg, seed=3).save_pretrained(path)
    return path


def test_local_model_and_data_files(tmp_path):
    """A save_pretrained directory and .txt/.jsonl data are accepted; the model loads the
    very weights that were saved; documents are joined by the end-of-document id."""
    from elastic_kernels.api.finetune import embedded_config, embedded_model

    mdir = _tiny_model_dir(str(tmp_path / "model"))
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": "x" * 150 + str(i)}) for i in range(3)) + "\n\n")
    job = _prepare(["--model", mdir, "--data", str(data), "--seq-len", "16", "--save-dir", str(tmp_path / "o")])
    assert job.data_info["documents"] == 3
    toks = job.windows.tokens
    assert toks.numel() == 3 * 151 + 2 and (toks == 256).sum() == 2 and toks[151] == 256
    loaded = job.spec.build().state_dict()
    saved = embedded_model(embedded_config(**DIMS), seed=3).state_dict()
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    txt = tmp_path / "d.txt"
    txt.write_text("é" * 200)
    job = _prepare(["--data", str(txt), "--seq-len", "16", "--save-dir", str(tmp_path / "o")] + TINY[:12])
    assert job.windows.tokens.numel() == 400  # two UTF-8 bytes per é


def _bad_cases(tmp_path, ckpt_dir):
    t = tmp_path
    (t / "empty").mkdir()
    (t / "badjson").mkdir()
    (t / "badjson" / "config.json").write_text("{not json")
    noweights = _tiny_model_dir(str(t / "noweights"))
    for f in os.listdir(noweights):
        if f.endswith(".safetensors"):
            os.unlink(os.path.join(noweights, f))
    corrupt = _tiny_model_dir(str(t / "corrupt"))
    for f in os.listdir(corrupt):
        if f.endswith(".safetensors"):
            with open(os.path.join(corrupt, f), "wb") as fh:
                fh.write(b"\x07\x00\x00\x00\x00\x00\x00\x00garbage")
    small_vocab = _tiny_model_dir(str(t / "smallvocab"), vocab=100)
    (t / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n')
    (t / "notext.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (t / "short.txt").write_text("too short")
    (t / "d.csv").write_text("a,b\n")
    (t / "nonempty").mkdir()
    (t / "nonempty" / "results.md").write_text("an earlier run\n")
    broken = str(t / "broken_ckpt")
    shutil.copytree(ckpt_dir, broken)
    with open(os.path.join(broken, "checkpoint", "optimizer.pt"), "r+b") as f:
        f.truncate(100)
    out = ["--save-dir", str(t / "out")]
    return [
        (["--model", str(t / "missing")] + out, "--model .*missing: no such directory or file, and not a hub id"),
        (["--model", str(t / "empty")] + out, "has no config.json"),
        (["--model", str(t / "badjson")] + out, "config.json is not valid JSON"),
        (["--model", noweights] + out, r"has no \*\.safetensors weights"),
        (["--model", corrupt] + out, "is not a valid safetensors file"),
        (["--model", small_vocab] + out, "has no tokenizer files .* and a vocabulary of 100 ids.*--tokenizer DIR.*--tokenizer bytes"),
        (["--model", corrupt, "--hidden-size", "64"] + out, "--hidden-size size the tiny model only"),
        (TINY + ["--data", str(t / "nope.txt")] + out, "data file .*nope.txt does not exist"),
        (TINY + ["--data", str(t / "d.csv")] + out, "unknown type '.csv'"),
        (TINY + ["--data", str(t / "bad.jsonl")] + out, "bad.jsonl, line 3: not valid JSON"),
        (TINY + ["--data", str(t / "notext.jsonl")] + out, 'notext.jsonl, line 2: expected exactly one of "messages", "prompt"'),
        (TINY + ["--data", str(t / "short.txt")] + out, "has 9 tokens; --seq-len 24 needs at least 120"),
        (TINY + ["--lora-targets", "qkv_proj"] + out, "matches no nn.Linear"),
        (TINY + ["--save-dir", str(t / "nonempty")], "is not empty"),
        (TINY + ["--resume", str(t / "nowhere")], "no such directory"),
        (TINY + ["--resume", str(t / "empty")], "no checkpoint there"),
        (TINY + ["--resume", ckpt_dir, "--baseline", "fsdp2"], "continues the elastic run only"),
        (TINY + ["--lora-dropout", "0.1", "--steps", "8", "--resume", broken],
         r"optimizer\.pt does not match the sha256 in its manifest\.json"),
        (TINY + ["--lora-dropout", "0.1", "--steps", "2", "--resume", ckpt_dir], "at step 4, past --steps 2"),
        (TINY + ["--lora-dropout", "0.1", "--steps", "8", "--lora-r", "8", "--resume", ckpt_dir],
         "different configuration .*lora.r: checkpoint has 4, this run 8"),
        (TINY + ["--lora-dropout", "0.1", "--steps", "8", "--chunk-kib", "2", "--resume", ckpt_dir],
         "policy.chunk_bytes: checkpoint has 1024, this run 2048"),
        (TINY + ["--steps", "8", "--resume", ckpt_dir], "lora.dropout: checkpoint has 0.1, this run 0.0"),
    ]


def test_bad_input_is_refused_before_training(dropout_runs, tmp_path):
    """Each bad input: a FinetuneError naming the problem from the checks that run before the
    first collective, and nothing written anywhere."""
    from elastic_kernels.api.finetune import FinetuneError

    _, _, half = dropout_runs
    before = _tree_digest(half)
    cases = _bad_cases(tmp_path, half)
    listing = sorted(os.listdir(tmp_path))
    for argv, pattern in cases:
        with pytest.raises(FinetuneError, match=pattern):
            _prepare(argv)
    # A checkpoint of 2 ranks resumed by 4.
    with pytest.raises(FinetuneError, match="world_size: checkpoint has 2, this run 4"):
        _prepare(TINY + ["--lora-dropout", "0.1", "--steps", "8", "--resume", half], world_size=4)
    assert sorted(os.listdir(tmp_path)) == listing  # no --save-dir was created
    assert _tree_digest(half) == before
    # Option errors stop in argparse (exit status 2) before anything else.
    from elastic_kernels.api.finetune import parse_args

    for argv in (["--pool-budget", "lots"], ["--keep-ratio", "0.2", "--persist-ratio", "0.5"], ["--steps", "0"],
                 ["--lora-targets", "q_proj,,v_proj"], ["--compare-budgets", "0,x"]):
        with pytest.raises(SystemExit) as info:
            parse_args(argv)
        assert info.value.code == 2, argv


def test_error_on_one_rank_stops_every_rank(dropout_runs, tmp_path):
    """Rank 1's RNG file is missing: rank 1 fails its checks, rank 0 passes them; both must
    exit with the error (rank 0 must not go on alone into a collective), nothing overwritten."""
    args, _, half = dropout_runs
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(half, ckpt)
    os.unlink(os.path.join(ckpt, "checkpoint", "rng_rank1.pt"))
    before = _tree_digest(ckpt)
    rc, out, err = torchrun(args + ["--steps", str(STEPS), "--resume", ckpt], what="bad resume", expect_ok=False)
    assert rc != 0
    assert err.count("elastic-finetune: error:") == 2, err[-4000:]  # one per rank
    assert err.count("rng_rank1.pt is missing (on rank 1)") == 2, err[-4000:]
    assert not re.search(r"\[rank\d\]: Traceback", err), err[-4000:]  # a clean error, no crash
    assert _tree_digest(ckpt) == before


# ------------------------------------------------------------------------------- no_sync


def _no_sync_worker(rank, world_size):
    import torch.distributed as dist

    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic, no_sync
    from elastic_kernels.api.finetune import embedded_config, embedded_model

    def make(reduce):
        m = convert_to_elastic(embedded_model(embedded_config(**DIMS), seed=0),
                               LoRAConfig(r=4, alpha=8, seed=1), ElasticPolicy(chunk_bytes=1024, all_reduce_grads=reduce))
        with torch.no_grad():  # B = 0 would make every A gradient zero
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
        return m

    gen = torch.Generator().manual_seed(10 + rank)  # different data on each rank
    batches = [torch.randint(0, 257, (2, 12), generator=gen) for _ in range(2)]
    calls = []
    real = dist.all_reduce

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    dist.all_reduce = counted
    try:
        model = make(reduce=True)
        with no_sync(model):
            model(input_ids=batches[0], labels=batches[0]).loss.backward()
        after_first = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        calls_inside = len(calls)
        model(input_ids=batches[1], labels=batches[1]).loss.backward()
        calls_total = len(calls)
    finally:
        dist.all_reduce = real
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    # Reference: local sums of both micro-batches without any reduction, averaged by hand.
    ref = make(reduce=False)
    for b in batches:
        ref(input_ids=b, labels=b).loss.backward()
    want = {}
    for n, p in ref.named_parameters():
        if p.requires_grad:
            g = p.grad.clone()
            dist.all_reduce(g)
            want[n] = g / world_size
    others = [None] * world_size
    dist.all_gather_object(others, after_first)
    return calls_inside, calls_total, all(torch.equal(got[n], want[n]) for n in want), \
        any(not torch.equal(others[0][n], others[1][n]) for n in after_first)


def test_no_sync_reduces_once_per_accumulation():
    for calls_inside, calls_total, equal, differed in run_distributed(_no_sync_worker, 2, timeout=180):
        assert calls_inside == 0  # nothing reduced inside no_sync
        assert calls_total == 1  # one all-reduce (one dtype) for the whole accumulation
        assert equal  # = the average of the local sums, bit for bit (same reduction)
        assert differed  # inside no_sync the ranks' gradients were their own


def test_pool_budget_option():
    from elastic_kernels.api.finetune.option_values import _budget, budget_label

    assert _budget("all") is None and _budget("0") == 0 and _budget("64MiB") == 64 << 20
    assert _budget("1.5GiB") == 3 << 29 and _budget("2k") == 2048 and _budget("50%") == ("fraction", 0.5)
    assert [budget_label(_budget(t)) for t in ("all", "0", "64MiB", "50%")] == ["all", "0", "64MiB", "50%"]
