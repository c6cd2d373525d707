"""The frontier's arithmetic (python_api/finetune/peers/frontier.py) on hand-made points: the
Pareto set of (memory, tokens/s) and the fastest peer at less or equal memory, each against
the answer worked out by hand below."""

from __future__ import annotations

from python_api.finetune.peers.frontier import best_peer_at_or_below, pareto, system_of


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
