"""The CLI with a pipeline (`--pp`, `--compare-pp`) end to end on 4 gloo ranks (pp 2 x dp 2).

Three launches of a tiny embedded Llama (4 layers, hidden 32):
1. the pp = 1 elastic run with `--compare-pp 2`: the same job pipelined beside it, one table;
2. the pipelined run alone for half the steps (its checkpoint);
3. that checkpoint resumed to the end.
Checked: the pipelined losses equal the pp = 1 run's within 1e-5 (fp32 summation order, as
for FSDP2 in tests/finetune/test_finetune.py: [Note: the elastic-vs-FSDP2 tolerance]; the
measured difference is printed); the resumed run reproduces the uninterrupted pipelined run's
losses bit for bit (same ranks, same collectives, same order on CPU); its adapter, one PEFT
adapter of every stage, has the pp = 1 adapter's keys, shapes and config and its values within
1e-3 of the largest change the steps can make (lr x steps; the reason at the check), loads in PeftModel.from_pretrained and reproduces the pipelined model's
logits on the held-out batch; the summary's pipelined entry has kind "pipelined", its per-step
all-gather, H2D and P2P bytes (P2P exactly the analytic activation bytes) and the bubble per rank.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIMS = dict(hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2)
SEQ, MB, ACCUM = 24, 2, 2
LR = 1e-2
TINY = [
    "--model", "tiny", "--hidden-size", "32", "--intermediate-size", "48", "--num-layers", "4", "--num-heads", "4", "--num-kv-heads", "2",
    "--seq-len", str(SEQ), "--micro-batch", str(MB), "--grad-accum", str(ACCUM), "--chunk-kib", "1",
    "--lora-r", "4", "--lora-alpha", "8", "--lr", str(LR), "--no-progress", "--save-probe", "--sample-tokens", "0",
]
PIPE = ["--schedule", "1f1b", "--pack-residency", "step"]
STEPS = 4
LOSS_TOL = 1e-5


def _torchrun(job_args, what, nproc=4, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "elastic_kernels.api.finetune", *job_args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what} did not finish within {timeout} s\n{out[-2000:]}\n{err[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what} exited with {proc.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-6000:]}")
    return out


def _summary(d):
    with open(os.path.join(d, "summary.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("pipelined")
    both, half, resumed = str(base / "both"), str(base / "half"), str(base / "resumed")
    _torchrun(TINY + PIPE + ["--steps", str(STEPS), "--compare-pp", "2", "--save-dir", both], "pp 1 + compare-pp 2")
    _torchrun(TINY + PIPE + ["--pp", "2", "--steps", str(STEPS // 2), "--save-dir", half], "pp 2, half the steps")
    shutil.copytree(half, resumed)
    _torchrun(TINY + PIPE + ["--pp", "2", "--steps", str(STEPS), "--resume", resumed], "pp 2, resumed")
    return both, half, resumed


def test_pipelined_run_matches_pp1_and_reports_its_figures(runs):
    both, _, _ = runs
    plain, piped = _summary(both)["runs"]
    assert plain["kind"] == "elastic" and piped["kind"] == "pipelined", (plain["kind"], piped["kind"])
    assert plain["tokens_per_step"] == piped["tokens_per_step"] == 4 * MB * ACCUM * SEQ
    diff = max(abs(a - b) for a, b in zip(plain["losses"], piped["losses"]))
    print(f"max |pp 1 loss - pp 2 loss| over {STEPS} steps: {diff:.3g}")
    assert len(piped["losses"]) == STEPS and diff <= LOSS_TOL, (plain["losses"], piped["losses"])
    # Rank 0 holds pack 0 of 2: it sends m micro-batches of [MB, SEQ, hidden] fp32 activations
    # forward and receives as many gradients; m = --grad-accum x pp.
    m = ACCUM * 2
    assert piped["pipeline"]["micro_batches"] == m and piped["pipeline"]["pp"] == 2
    assert piped["p2p_bytes_per_step"] == [m * MB * SEQ * 32 * 4] * STEPS
    # Step residency: each step gathers rank 0's pack once, the same bytes every step.
    g = piped["allgather_bytes_per_step"]
    assert g[0] > 0 and g == [g[0]] * STEPS and piped["allgather_bytes_counted_per_step"] == g
    assert piped["h2d_bytes_per_step"] == [0] * STEPS
    bubble = piped["bubble_per_rank"]
    assert len(bubble) == 4 and all(0.0 <= b < 1.0 for b in bubble), bubble
    assert piped["frozen_bytes_held"] * 2 <= piped["frozen_bytes"] + 4096  # 1/dp of its packs
    with open(os.path.join(both, "results.md")) as f:
        assert piped["name"] in f.read()


def test_resume_is_bit_exact_and_the_adapter_is_the_pp1_adapter(runs):
    from peft import PeftModel
    from safetensors.torch import load_file

    from elastic_kernels.api.finetune import embedded_config, embedded_model

    both, half, resumed = runs
    uninterrupted = _summary(both)["runs"][1]["losses"]
    got = _summary(resumed)["runs"][0]
    assert got["first_step"] == STEPS // 2 + 1 and got["steps_run"] == STEPS - STEPS // 2
    assert got["losses"] == uninterrupted, f"resumed {got['losses']}\nuninterrupted {uninterrupted}"
    # One adapter of every stage, in the pp = 1 format, the pp = 1 run's values.
    a = load_file(os.path.join(both, "adapter", "adapter_model.safetensors"))
    b = load_file(os.path.join(resumed, "adapter", "adapter_model.safetensors"))
    assert sorted(a) == sorted(b) and len(a) == 2 * 7 * 4
    # AdamW divides each gradient by its own running RMS, so an adapter value carries its
    # gradient's *relative* rounding error times lr: for a gradient summed from terms that nearly
    # cancel, reduced over dp 4 (pp 1) or dp 2 (pp 2) in another fp32 order, that is far above
    # fp32's 6e-8 (measured 2026-12-03: 2.2e-6 = lr x 2.2e-4, on one value). The bound, 1e-3 of
    # the largest change the steps can make (lr x STEPS = 4e-2), is 18x that; a wrong gradient
    # moves a value by up to lr per step, 250x the bound.
    atol = 1e-3 * LR * STEPS
    for k in a:
        assert a[k].shape == b[k].shape, k
        torch.testing.assert_close(b[k], a[k], atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")
    with open(os.path.join(both, "adapter", "adapter_config.json")) as f1, \
            open(os.path.join(resumed, "adapter", "adapter_config.json")) as f2:
        assert json.load(f1) == json.load(f2)
    probe = load_file(os.path.join(resumed, "probe.safetensors"))
    base = embedded_model(embedded_config(**DIMS), seed=0).eval()
    model = PeftModel.from_pretrained(base, os.path.join(resumed, "adapter")).eval()
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)
    # The checkpoint holds every stage's optimizer state under the pp = 1 names.
    opt = torch.load(os.path.join(resumed, "checkpoint", "optimizer.pt"), weights_only=True)
    assert len(opt["param_names"]) == len(a) and len(opt["state_dict"]["state"]) == len(a)
