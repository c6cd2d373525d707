"""The peers of the elastic runtime, trained beside it in one process group (`--baseline`):
FSDP2 + PEFT at a reshard setting (python_api/finetune/engines.py), DeepSpeed ZeRO-3 + PEFT
(zero3.py, an optional dependency), DDP + PEFT with replicated weights (ddp.py) and FSDP2 over
torchao NF4 weights + PEFT (fsdp2_nf4.py: torchtune's QLoRA path); and the memory-throughput
frontier they are compared on (frontier.py).

    skipped = check(job)                 # collective, before any run: bad settings fail every rank,
                                         # a peer not installed on some rank is skipped on all
    engine = build(job, "deepspeed", counter)

Every peer trains the same base weights from the elastic run's initial adapters, with PEFT
LoRA of the same r, alpha, dropout and targets, the same AdamW and the same batches, through
the same loop (python_api/finetune/loop.py), so their losses agree with the elastic run's
within fp32 rounding ([Note: what is compared with FSDP2, and the tolerance]); the NF4 peer's
with an elastic nf4 run's within the NF4 tolerance ([Note: the NF4 peer's loss tolerance] in
python_api/finetune/report.py).

[Note: engines that own their optimizer step]
`train()` drives every engine alike (python_api/finetune/engine.py, [Note: the engine
interface]): `accumulate(is_last)` around each micro-step's forward and
`(loss / accum).backward()`, then `optimizer_step(opt)`, by default `opt.step();
opt.zero_grad()`. An engine whose framework owns the step (DeepSpeed: ZeRO-3 steps its own
partitions) carries `optimizer`, the torch AdamW it handed over (the loop's learning-rate
schedule writes its param_groups, and the loop steps no other), and overrides
`optimizer_step`. The elastic engine below a full cache carries a ShardedOptimizer (each rank
steps its share of the adapters: [Note: sharded optimizer state] in
python_api/distributed/zero.py) and keeps the default `optimizer_step`. The others carry None
and get the loop's AdamW.
"""

from __future__ import annotations

from ...distributed.agree import exchange, ranks_text
from ..agreement import agree_error
from ..engines import FSDP2Engine, fsdp2_reshard_error
from ..errors import FinetuneError
from ..job import Job
from ..option_values import PEERS
from .ddp import DDPEngine
from .fsdp2_nf4 import FSDP2NF4Engine, import_to_nf4, shape_error
from .zero3 import ZeRO3Engine, ZeRO3Setting, import_deepspeed, setting_error

__all__ = ["PEERS", "build", "check", "missing_reason"]


def missing_reason(kind: str, job: Job) -> str | None:
    """Why peer `kind` cannot run on this rank for lack of its package, or None."""
    try:
        if kind == "deepspeed":
            import_deepspeed(job.device)
        elif kind == "fsdp2-nf4":
            import_to_nf4()
    except ImportError as exc:
        return str(exc)
    return None


def _settings_error(job: Job) -> str | None:
    peers = job.cfg.peers
    if "fsdp2" in peers.baselines and peers.fsdp2_reshard is not None:
        err = fsdp2_reshard_error(peers.fsdp2_reshard, job.world_size)
        if err:
            return err
    if "fsdp2-nf4" in peers.baselines:
        err = shape_error(job)
        if err:
            return err
    if "deepspeed" in peers.baselines:
        return setting_error(ZeRO3Setting.from_args(peers), job.device, job.spec.dtype)
    return None


def check(job: Job) -> dict[str, str]:
    """Collective, before the first run. Settings no peer can run stop every rank
    (FinetuneError); a peer whose package is missing on any rank is left out on every rank:
    returns {peer: why}. The same decision on every rank ([Note: agreeing across ranks])."""
    agree_error(_settings_error(job), job.world_size)
    reasons = {kind: missing_reason(kind, job) for kind in job.cfg.peers.baselines}
    every = exchange(reasons, what="which peers are installed")
    skipped = {}
    for kind in job.cfg.peers.baselines:
        bad = [(r, rs[kind]) for r, rs in enumerate(every) if rs[kind]]
        if bad:
            where = "" if len(bad) == len(every) else f" (on {ranks_text([r for r, _ in bad])})"
            skipped[kind] = bad[0][1] + where
    return skipped


def build(job: Job, kind: str, counter):
    """The engine of peer `kind` for this job (a collective build)."""
    peers = job.cfg.peers
    if kind == "fsdp2":
        return FSDP2Engine(job, counter, True if peers.fsdp2_reshard is None else peers.fsdp2_reshard)
    if kind == "ddp":
        return DDPEngine(job, counter)
    if kind == "deepspeed":
        return ZeRO3Engine(job, counter, ZeRO3Setting.from_args(peers))
    if kind == "fsdp2-nf4":
        return FSDP2NF4Engine(job, counter)
    raise FinetuneError(f"unknown peer {kind!r} (expected one of {', '.join(PEERS)})")
