"""The memory-throughput plane: each run is a point (peak memory, tokens/s); a system's Pareto
frontier is the set of its points that no other point of it beats on both axes; an elastic
point is compared with the fastest peer configuration that needs at most its memory.

    front = pareto([(mem, tps), ...])                       # indices, by increasing memory
    best = best_peer_at_or_below(mem, peer_points)          # the fastest peer point that fits, or None
    plot_frontier(ax, points)                               # markers and one frontier line per system

[Note: the frontier's question]
A user choosing a system asks: at the memory I have, which gives the most tokens/s? A
configuration that needs more memory than another and is not faster is never the answer, so
each system is drawn as its frontier. The yardstick of an elastic point is the best peer at
*less or equal* memory: a faster peer that needs more memory does not answer the question at
this memory level, and a slower one at less memory is beaten.
"""

from __future__ import annotations

ELASTIC_KINDS = ("elastic", "planned", "sweep")
SYSTEM_NAMES = {"elastic": "elastic", "fsdp2": "FSDP2", "deepspeed": "DeepSpeed ZeRO-3", "ddp": "DDP",
                "fsdp2-nf4": "FSDP2-NF4", "elastic nf4": "elastic nf4", "elastic int8": "elastic int8"}


def system_of(kind: str, weight_format: str = "none") -> str:
    """The system a run of this kind belongs to: every elastic variant (budgets, the host tier,
    planned) of one weight format is one system ("elastic", "elastic nf4": other numerics, so
    another frontier); each peer is its own."""
    if kind in ELASTIC_KINDS:
        return "elastic" if weight_format in (None, "none") else f"elastic {weight_format}"
    return kind


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (memory, tokens/s) that no other point dominates (memory <= and
    tokens/s >=, one of them strictly), in increasing memory. Of equal points the first is
    kept. Points with None in either coordinate are left out."""
    order = sorted((i for i, (m, t) in enumerate(points) if m is not None and t is not None),
                   key=lambda i: (points[i][0], -points[i][1], i))
    front, best = [], None
    for i in order:
        t = points[i][1]
        if best is None or t > best:
            front.append(i)
            best = t
    return front


def best_peer_at_or_below(memory: float | None, peers: list[dict]) -> dict | None:
    """The peer point (a dict with 'memory' and 'tokens_per_s') of most tokens/s among those
    whose memory is at most `memory`; None if none fits or `memory` is unknown. Ties: the one
    of less memory."""
    if memory is None:
        return None
    fits = [p for p in peers if p["memory"] is not None and p["tokens_per_s"] is not None and p["memory"] <= memory]
    if not fits:
        return None
    return max(fits, key=lambda p: (p["tokens_per_s"], -p["memory"]))


def plot_frontier(ax, points: list[dict], *, memory_label: str = "peak memory MiB", annotate: bool = True) -> None:
    """Points (dicts with 'system', 'label', 'memory' bytes, 'tokens_per_s') as markers, one
    colour and marker per system, and each system's Pareto frontier as a step line."""
    markers = {"elastic": "o", "fsdp2": "s", "deepspeed": "^", "ddp": "D", "elastic nf4": "P", "fsdp2-nf4": "v",
               "elastic int8": "X"}
    colors = {"elastic": "C0", "fsdp2": "C1", "deepspeed": "C2", "ddp": "C3", "elastic nf4": "C4", "fsdp2-nf4": "C5",
              "elastic int8": "C6"}
    known = ("elastic", "fsdp2", "deepspeed", "ddp", "elastic nf4", "fsdp2-nf4", "elastic int8")
    systems = [s for s in known if any(p["system"] == s for p in points)]
    systems += sorted({p["system"] for p in points} - set(systems))
    for k, s in enumerate(systems):
        pts = [p for p in points if p["system"] == s and p["memory"] is not None and p["tokens_per_s"] is not None]
        if not pts:
            continue
        color, marker = colors.get(s, f"C{7 + k}"), markers.get(s, "x")
        xs = [p["memory"] / 2**20 for p in pts]
        ys = [p["tokens_per_s"] for p in pts]
        ax.scatter(xs, ys, color=color, marker=marker, s=36, zorder=3, label=SYSTEM_NAMES.get(s, s))
        front = pareto(list(zip(xs, ys)))
        fx = [xs[i] for i in front]
        fy = [ys[i] for i in front]
        ax.step(fx, fy, where="post", color=color, linewidth=1.3, alpha=0.8, zorder=2)
        if annotate:
            for p, x, y in zip(pts, xs, ys):
                ax.annotate(p["label"], (x, y), textcoords="offset points", xytext=(4, 3), fontsize=6, color=color)
    ax.set_xlabel(memory_label)
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
