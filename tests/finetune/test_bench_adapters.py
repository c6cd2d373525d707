"""bench/bench_adapters.py (issue 29's measurement) on the tiny model on 2 gloo ranks: one row
per budget and K, the gathered bytes of the multi job equal to the 1-adapter job's, its losses
equal to the sequential runs' (the script's own check, which ends it with exit code 1 on a
mismatch), and that check refusing what it must refuse."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 4 layers (with 2, budget 0 keeps the whole model: no gather per step), K = 2, both budgets,
# one warm-up and one timed round, memory at budget 0 only, the profile of the K=2 step.
ARGS = ["--preset", "tiny", "--num-layers", "4", "--adapters", "2", "--rounds", "1", "--budgets", "0,all",
        "--memory-budgets", "0", "--profile-adapters", "2"]


@pytest.fixture(scope="module")
def adapters_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("adapters")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(REPO, "bench", "bench_adapters.py"), *ARGS, "--results", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"bench_adapters.py did not finish within 300 s\n{stdout[-3000:]}\n{stderr[-3000:]}")
    assert proc.returncode == 0, f"bench_adapters.py exited with {proc.returncode}\n{stdout[-3000:]}\n{stderr[-6000:]}"
    with open(out / "adapters.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return rows, stdout


@pytest.mark.distributed
@pytest.mark.needs_ext
def test_adapters_script_rows_ratios_and_losses(adapters_run):
    rows, stdout = adapters_run
    assert sorted((r["budget"], r["adapters"]) for r in rows) == [("0", "2"), ("all", "2")]
    for r in rows:
        assert (r["preset"], r["world_size"], r["backend"], r["rounds"]) == ("tiny", "2", "gloo", "1")
        for col in ("multi_tokens_per_s", "sequential_tokens_per_s", "fsdp2_tokens_per_s", "vs_sequential_median",
                    "vs_fsdp2_median"):
            assert float(r[col]) > 0, (col, r)
        # one timed round: the median of the per-round ratios is that round's ratio
        assert float(r["vs_sequential_min"]) == float(r["vs_sequential_median"]) == float(r["vs_sequential_max"])
        assert float(r["vs_sequential_ratio_of_medians"]) == pytest.approx(float(r["vs_sequential_median"]), rel=1e-5)
        # tokens/s of the multi job = K x 2 ranks x seq tokens over its step time
        assert float(r["multi_tokens_per_s"]) == pytest.approx(2 * 2 * 24 / float(r["multi_step_s"]), rel=1e-4)
        # the frozen weights are gathered once for all adapters: the 1-adapter job's bytes
        assert float(r["multi_allgather_mib_per_step"]) == float(r["single_allgather_mib_per_step"])
        # every adapter's loss equals its sequential run's, round by round
        assert float(r["max_abs_loss_diff_vs_sequential"]) <= 1e-5
    by = {r["budget"]: r for r in rows}
    assert float(by["0"]["multi_allgather_mib_per_step"]) > 0 and float(by["all"]["multi_allgather_mib_per_step"]) == 0
    # memory measured at budget 0 only; one more adapter costs memory
    assert float(by["0"]["tensor_peak_mib"]) > 0 and by["all"]["tensor_peak_mib"] == ""
    assert float(by["0"]["tensor_peak_mib"]) == pytest.approx(float(by["0"]["bound_mib"]))  # K=2 is the bound's own point
    assert "largest |multi adapter loss - its sequential loss|" in stdout and "LOSS MISMATCH" not in stdout
    assert "FSDP2's first loss" in stdout
    assert "profile, multi K=2, budget 0, rank 0" in stdout


def test_the_loss_check_refuses_a_mismatch_and_non_finite_losses():
    from types import SimpleNamespace

    from bench.bench_adapters import LOSS_TOL, _losses_diff, loss_failures

    def unit(*losses):
        return SimpleNamespace(steps=[{"losses": list(step)} for step in losses])

    multi = unit([2.0, 3.0], [1.9, 2.8])
    assert _losses_diff(multi, unit([2.0, 3.0], [1.9, 2.8 + 3e-7])) == pytest.approx(3e-7, abs=1e-12)
    assert _losses_diff(multi, unit([2.0, 3.0], [1.9, 2.9])) == pytest.approx(0.1)
    assert _losses_diff(multi, unit([2.0, 3.0])) == float("inf")  # a round missing
    assert _losses_diff(multi, unit([2.0, 3.0], [1.9, float("nan")])) == float("inf")
    row = {"budget": "0", "adapters": 2}
    assert loss_failures([{**row, "max_abs_loss_diff_vs_sequential": LOSS_TOL}], (1.0, 1.0)) == []
    assert len(loss_failures([{**row, "max_abs_loss_diff_vs_sequential": 2 * LOSS_TOL}], None)) == 1
    assert len(loss_failures([{**row, "max_abs_loss_diff_vs_sequential": float("nan")}], None)) == 1
    assert len(loss_failures([], (1.0, 1.0 + 2 * LOSS_TOL))) == 1


@pytest.mark.parametrize("argv,said", [
    (["--adapters", "0,2"], r"--adapters: positive, distinct"),
    (["--adapters", "2,x"], r"--adapters: a comma-separated list"),
    (["--budgets", "0,x"], r"--budgets: not a size: 'x'"),
    (["--rounds", "0"], r"--rounds must be >= 1"),
])
def test_adapters_script_refuses_bad_arguments(argv, said, capsys):
    import re

    from bench.bench_adapters import _parse

    with pytest.raises(SystemExit) as info:
        _parse(["--preset", "tiny", *argv])
    assert info.value.code == 2
    assert re.search(said, capsys.readouterr().err), argv
