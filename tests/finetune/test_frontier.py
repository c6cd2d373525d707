"""The frontier's arithmetic (python_api/finetune/peers/frontier.py) on hand-made points: the
Pareto set of (memory, tokens/s) and the fastest peer at less or equal memory, each against
the answer worked out by hand below; and bench/bench_frontier.py itself, run on a tiny model on
2 gloo ranks, its rows and picture checked against a recomputation from its own columns."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys

import pytest

from elastic_kernels.api.finetune.peers.frontier import best_peer_at_or_below, pareto, system_of


def test_pareto_keeps_exactly_the_undominated_points_by_increasing_memory():
    pts = [(40.0, 1000.0),   # 0: on the front (least memory)
           (50.0, 900.0),    # 1: dominated by 0 (more memory, slower)
           (60.0, 1500.0),   # 2: on the front
           (60.0, 1400.0),   # 3: dominated by 2 (same memory, slower)
           (70.0, 1500.0),   # 4: dominated by 2 (more memory, equal speed)
           (80.0, 2000.0),   # 5: on the front
           (None, 9e9),      # 6: unknown memory: left out
           (40.0, 1000.0)]   # 7: equal to 0: the first is kept
    assert pareto(pts) == [0, 2, 5]
    assert pareto([]) == []


def test_best_peer_is_the_fastest_that_fits_and_ties_go_to_less_memory():
    peers = [{"memory": 30.0, "tokens_per_s": 800.0}, {"memory": 45.0, "tokens_per_s": 1200.0},
             {"memory": 44.0, "tokens_per_s": 1200.0}, {"memory": 90.0, "tokens_per_s": 5000.0},
             {"memory": None, "tokens_per_s": 9000.0}]
    assert best_peer_at_or_below(29.9, peers) is None  # nothing fits
    assert best_peer_at_or_below(30.0, peers) is peers[0]  # at equal memory it counts
    assert best_peer_at_or_below(50.0, peers) is peers[2]  # fastest; of the tie, the lesser memory
    assert best_peer_at_or_below(1e9, peers) is peers[3]  # a point of unknown memory never answers
    assert best_peer_at_or_below(None, peers) is None


def test_every_elastic_variant_is_one_system():
    assert {system_of(k) for k in ("elastic", "planned")} == {"elastic"}
    assert [system_of(k) for k in ("fsdp2", "deepspeed", "ddp")] == ["fsdp2", "deepspeed", "ddp"]


# ------------------------------------------------------------------ the benchmark script itself

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Two points per system that has two settings (DDP has one), on the tiny preset with 4 layers
# (with 2, the working set of two decoder layers is the whole model and budget 0 keeps it all);
# 2 steps per pass (the first is warm-up), 2 passes: memory each alone, then 1 + 2 interleaved
# rounds. 140 s on this 2-core VM (2026-12-02).
FRONTIER_ARGS = ["--preset", "tiny", "--num-layers", "4", "--steps", "2", "--passes", "2", "--budgets", "0,all", "--host-budgets", "",
                 "--planned-caps", "0", "--peers", "fsdp2,deepspeed,ddp", "--fsdp2-reshard", "true,false",
                 "--ds-grid", "defaults,per-use"]
EXPECTED = {("elastic", "budget 0"), ("elastic", "budget all"), ("fsdp2", "reshard"), ("fsdp2", "no reshard"),
            ("deepspeed", "defaults"), ("deepspeed", "per-use"), ("ddp", "replicated")}


def _dominated(i, pts):
    """Brute force: point i is off the front if another point needs no more memory and is no
    slower, and is better in one of the two (or is an earlier equal point)."""
    mi, ti = pts[i]
    return any(mj <= mi and tj >= ti and (mj < mi or tj > ti or j < i)
               for j, (mj, tj) in enumerate(pts) if j != i)


@pytest.fixture(scope="module")
def frontier_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("frontier")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(REPO, "bench", "bench_frontier.py"), *FRONTIER_ARGS, "--results", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"bench_frontier.py did not finish within 600 s\n{stdout[-3000:]}\n{stderr[-3000:]}")
    assert proc.returncode == 0, f"bench_frontier.py exited with {proc.returncode}\n{stdout[-3000:]}\n{stderr[-6000:]}"
    with open(out / "frontier.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return out, rows, stdout


@pytest.mark.distributed
@pytest.mark.needs_ext
def test_frontier_script_writes_one_row_per_configuration_and_its_picture(frontier_run):
    out, rows, stdout = frontier_run
    assert {(r["system"], r["config"].split(" (")[0]) for r in rows} == EXPECTED
    assert len(rows) == len(EXPECTED)
    for r in rows:
        assert (r["preset"], r["world_size"], r["backend"], r["passes"], r["steps"]) == ("tiny", "2", "gloo", "2", "2")
        assert float(r["tokens_per_s"]) > 0 and float(r["step_time_s"]) > 0
        assert float(r["peak_memory_mib"]) > 0 and float(r["peak_memory_mib"]) == float(r["peak_tensor_mib"])
        assert float(r["peak_rss_mib"]) >= 0  # resident-set growth at a fixed mmap threshold
        assert r["mmap_threshold_fixed"] == "True" and r["memory_measure"] == "tensor peak (CPU)"
        assert int(r["rounds"]) == 2  # passes x (steps - 1) timed rounds after the warm-up
        # the same base weights, initial adapters, batches and AdamW: the losses agree to fp32
        # rounding ([Note: the peers' tolerances] in test_peers.py)
        assert float(r["max_abs_loss_diff"]) <= 1e-5, r
    png = out / "frontier_tiny.png"
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    h, w = matplotlib.image.imread(png).shape[:2]
    assert (h, w) == (720, 1200)  # figsize 10 x 6 at 120 dpi
    assert "largest |loss - elastic loss| of any run" in stdout
    assert "more than fp32 rounding" not in stdout


@pytest.mark.distributed
@pytest.mark.needs_ext
def test_frontier_script_counts_the_gathers_each_system_must_make(frontier_run):
    _, rows, _ = frontier_run
    by = {(r["system"], r["config"].split(" (")[0]): r for r in rows}
    mib = {k: float(r["allgather_mib_per_step"]) for k, r in by.items()}
    # no weight communication once everything is cached, and none at all for DDP
    assert mib[("elastic", "budget all")] == 0.0 and mib[("ddp", "replicated")] == 0.0
    assert float(by[("elastic", "budget all")]["allgather_mib_first_step"]) > 0  # it filled the pool once
    # budget 0 regathers every step; FSDP2 resharding gathers for the backward again
    assert mib[("elastic", "budget 0")] > 0
    assert mib[("fsdp2", "reshard")] > mib[("fsdp2", "no reshard")] > 0
    # DeepSpeed per use (no persistence, no reuse, no prefetch) gathers every parameter at each
    # use, one collective each: more collectives than FSDP2's one per module and pass (the exact
    # bytes of such a setting are checked by hand in test_peers.py)
    assert mib[("deepspeed", "per-use")] > 0
    assert float(by[("deepspeed", "per-use")]["allgather_calls_per_step"]) > float(
        by[("fsdp2", "reshard")]["allgather_calls_per_step"])


@pytest.mark.distributed
@pytest.mark.needs_ext
def test_frontier_script_marks_the_front_and_the_best_peer_below(frontier_run):
    """The script's on_frontier and vs_best_peer columns against a brute-force recomputation
    from its own tokens/s and memory columns."""
    _, rows, _ = frontier_run
    for system in {r["system"] for r in rows}:
        mine = [r for r in rows if r["system"] == system]
        pts = [(float(r["peak_memory_mib"]), float(r["tokens_per_s"])) for r in mine]
        for i, r in enumerate(mine):
            assert (r["on_frontier"] == "True") == (not _dominated(i, pts)), (system, r["config"])
    peers = [r for r in rows if r["system"] != "elastic"]
    for r in (r for r in rows if r["system"] == "elastic"):
        fits = [p for p in peers if float(p["peak_memory_mib"]) <= float(r["peak_memory_mib"])]
        if not fits:
            assert r["best_peer_at_or_below"] == "" and r["vs_best_peer"] == ""
            continue
        best = max(float(p["tokens_per_s"]) for p in fits)
        names = {f"{p['system']}: {p['config']}" for p in fits if float(p["tokens_per_s"]) == best}
        assert r["best_peer_at_or_below"] in names
        assert float(r["vs_best_peer"]) == pytest.approx(float(r["tokens_per_s"]) / best, rel=1e-5)


def test_pair_ratios_are_taken_round_by_round():
    """The median of per-round ratios and the ratio of medians differ when one configuration's
    slow round is another's fast one ([Note: what the frontier's memory is])."""
    from bench.bench_frontier import Config, _pair_ratios

    a, b = Config("elastic", "budget 0", None), Config("fsdp2", "reshard", None)
    a.times, b.times = [50.0, 1.0, 2.0, 10.0], [60.0, 3.0, 2.0, 4.0]  # the first round is warm-up
    r = _pair_ratios(a, b)
    assert r["ratios"] == [3.0, 1.0, 0.4] and r["rounds"] == 3
    assert (r["median_of_ratios"], r["min"], r["max"]) == (1.0, 0.4, 3.0)
    assert r["ratio_of_medians"] == 3.0 / 2.0


@pytest.mark.distributed
@pytest.mark.needs_ext
def test_frontier_script_reports_the_pairs_round_by_round(frontier_run):
    _, _, stdout = frontier_run
    for pair in ("budget 0 vs fsdp2: reshard", "budget all vs ddp: replicated"):
        line = next(x for x in stdout.splitlines() if x.startswith(f"per-round ratios, {pair}: "))
        assert len(line.split(": ")[-1].split(", ")) == 2, line  # one ratio per timed round
    assert "| tokens/s ratio, median of per-round ratios [min, max] | ratio of medians |" in stdout


@pytest.mark.parametrize("argv,said", [
    (["--budgets", "0,x"], r"--budgets: not a size: 'x'"),
    (["--host-budgets", "-1"], r"--host-budgets: a size must be >= 0"),
    (["--legacy-budgets", "150%"], r"--legacy-budgets: a percentage in \[0, 100\]"),
    (["--peers", "fsdp3"], r"--peers: unknown peer\(s\) \['fsdp3'\]"),
    (["--fsdp2-reshard", "maybe"], r"--fsdp2-reshard: expected true, false or a number of ranks"),
    (["--planned-caps", "-1"], r"--planned-caps: a number of caps >= 0"),
    (["--groups", "1"], r"--groups: 0 \(one group\) or a group size >= 2"),
])
def test_frontier_script_refuses_bad_arguments_before_anything_runs(argv, said, capsys):
    """Each was a traceback on every rank once the runs were being built (or, for --peers, a
    peer silently left out); now an argument error before any process group exists."""
    import re

    from bench.bench_frontier import _parse

    with pytest.raises(SystemExit) as info:
        _parse(["--preset", "tiny", *argv])
    assert info.value.code == 2
    assert re.search(said, capsys.readouterr().err), argv


def test_groups_keep_the_anchor_in_each_and_each_pair_together():
    """[Note: frontier groups]: at most `size` alive, the anchor first in every group, a pair
    of --pairs never split, every other configuration in exactly one group, in listed order."""
    from bench.bench_frontier import Config, groups_of

    cs = [Config("elastic", f"budget {b}", None) for b in ("0", "25%", "all")]
    cs += [Config("fsdp2", "reshard", None), Config("fsdp2", "no reshard", None), Config("ddp", "replicated", None)]
    g = groups_of(cs, 3, cs[0], ["budget 0=fsdp2:reshard", "budget all=ddp:replicated"])
    labels = [[c.label for c in grp] for grp in g]
    assert labels == [["budget 0", "budget 25%"], ["budget 0", "budget all", "replicated"],
                      ["budget 0", "reshard", "no reshard"]]
    assert groups_of(cs, 0, cs[0], [])[0] == cs  # one group: all, listed order
    assert [len(x) for x in groups_of(cs, 2, cs[2], [])] == [2] * 5  # anchor + one; a pair cannot fit


def test_speed_against_the_anchor_is_taken_round_by_round_in_each_group():
    from bench.bench_frontier import Config, relate_to_anchor

    a, b, c = Config("elastic", "budget 0", None), Config("elastic", "budget all", None), Config("ddp", "replicated", None)
    a.times_in = {0: [9.0, 2.0, 4.0, 2.0], 1: [9.0, 1.0, 1.0, 3.0]}  # first round: warm-up
    b.times_in = {0: [5.0, 1.0, 1.0, 4.0]}
    c.times_in = {1: [5.0, 2.0, 0.5, 1.0]}
    relate_to_anchor([[a, b], [a, c]])
    assert b.vs_anchor["ratios"] == [2.0, 4.0, 0.5] and b.vs_anchor["median"] == 2.0
    assert c.vs_anchor["ratios"] == [0.5, 2.0, 3.0] and (c.vs_anchor["min"], c.vs_anchor["max"]) == (0.5, 3.0)
    assert c.vs_anchor["group"] == 1 and a.vs_anchor["median"] == 1.0 and a.times == a.times_in[0]


@pytest.mark.distributed
@pytest.mark.needs_ext
def test_profile_script_profiles_each_configuration():
    """bench/profile_frontier.py on the tiny preset: a table of ops for each configuration it
    was given (elastic budget all, DDP), with the GEMMs among them; a bad own option is an
    argument error."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    script = os.path.join(REPO, "bench", "profile_frontier.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script,
           "--preset", "tiny", "--num-layers", "2", "--budgets", "all", "--host-budgets", "", "--planned-caps", "0",
           "--peers", "ddp", "--profile-steps", "1", "--top", "5"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    heads = [line for line in proc.stdout.splitlines() if line.startswith("=== ")]
    assert [h.split(":")[0] for h in heads] == ["=== elastic budget all", "=== ddp replicated"], heads
    assert proc.stdout.count("Self CPU time total") == 2 and "aten::mm" in proc.stdout
    bad = subprocess.run([sys.executable, script, "--profile-steps", "0"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--profile-steps and --top must be >= 1" in bad.stderr, bad.stderr
