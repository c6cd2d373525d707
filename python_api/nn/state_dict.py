"""Full state dicts of converted models: `model.state_dict()` holds every frozen weight whole
under its original name (gathered on demand), `load_state_dict` puts each rank's shard back.

[Note: the full state dict is a collective]
Every rank holds 1/W of each frozen weight, so `model.state_dict()` all-gathers each weight in
turn (like FSDP's FULL_STATE_DICT) and must be called on every rank of the runtime's group, in
the same order. Gathered weights are moved to the CPU one by one (FSDP's offload_to_cpu), so
the device never holds more than one extra weight. Before each gather the ranks meet in the
process group's store, not in a collective: a rank that calls `state_dict()` alone (rank 0 of
a Trainer on several ranks, say) fails with a clear message after
`ElasticPolicy.collective_timeout_s` instead of hanging, and no collective is left half-issued.
Exports meet by their order number (a rank's n-th weight export pairs with the others' n-th;
a rank that gave up takes its arrival back), so they must be made alike on every rank, as
collectives must.
`load_state_dict` of a full state dict is local for weights kept as device shards: every rank
cuts its shard out of the full weight with the tensor's layout and drops the pool's cached
chunks of it (they would be stale). A weight in the host store is a collective ([Note: one
writer per node]).

[Note: one writer per node]
The host store is one segment per node, mapped by every local rank and read by their
host -> page copies (on each rank's copy stream, asynchronously on CUDA). Replacing a weight
there is therefore not a local write: every local rank writing the same bytes races with the
copies of the others (and of its own copy stream) that may still be reading them, and a torn
weight ends up in some rank's pool. So, for a weight in the store: (1) every rank waits for its
own copy stream (nothing it queued still reads the store); (2) the ranks meet (an `agree`,
which also makes an error on one rank, a weight in use, say, an error on every rank before
anything is written); (3) the node's first local rank alone writes the weight into the
store; (4) the ranks meet again (agreeing on the write's outcome) before any of them reads it.
Two small collectives per weight, on every rank of the runtime's group, so `load_state_dict`
of a model with its weights on the host must be called on every rank, like `state_dict()`.
"""

from __future__ import annotations

import datetime
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed.agree import agree
from ..runtime import ElasticRuntime, ElasticTensor
from .embedding import elastic_tensors_of


def _is_elastic_layer(module: nn.Module) -> bool:
    return bool(elastic_tensors_of(module))


_rendezvous_counts: dict[tuple, int] = {}


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _rendezvous(rt: ElasticRuntime, what: str) -> None:
    """Wait until every rank of the runtime's group has reached this point (the n-th export
    call of this process on this group), or raise after `collective_timeout_s`. Uses the
    store only: a rank that is alone never leaves a collective half-issued.
    See [Note: the full state dict is a collective]."""
    if rt.world_size == 1:
        return
    store = _store()
    if store is None:  # no store to meet in: the collective itself will have to do
        return
    ranks = tuple(dist.get_process_group_ranks(rt.group))
    n = _rendezvous_counts.get(ranks, 0)
    _rendezvous_counts[ranks] = n + 1
    prefix = f"elastic_kernels/export/{'-'.join(map(str, ranks))}/{n}"
    mine = f"{prefix}/{rt.rank}"
    store.set(mine, b"1")
    keys = [f"{prefix}/{r}" for r in range(rt.world_size)]
    timeout = rt.policy.collective_timeout_s
    try:
        if timeout is None:
            store.wait(keys)
        else:
            store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        # Undo this arrival so that the ranks' counts stay equal: the next export on every
        # rank meets at this same n again.
        _rendezvous_counts[ranks] = n
        try:
            store.delete_key(mine)
        except RuntimeError:
            pass
        raise RuntimeError(
            f"elastic: {what} is a collective (every frozen weight is sharded across the "
            f"{rt.world_size} ranks), but ranks {missing} did not call it within "
            f"{timeout} s (ElasticPolicy.collective_timeout_s). Call state_dict()/save_pretrained() "
            "on every rank. With transformers.Trainer on several ranks only rank 0 saves: use "
            "elastic_kernels.api.hf.ElasticTrainer (or ElasticTrainerMixin), which gathers on every rank first."
        ) from exc


_gather_only = False  # set by gather_only(): take part in the gathers, keep nothing


@contextmanager
def gather_only():
    """`state_dict()` inside this context joins every gather but keeps no gathered weight (they
    are left out of the returned dict): for the ranks that do not write, so that only the
    writer ever holds the whole model in host memory."""
    global _gather_only
    previous, _gather_only = _gather_only, True
    try:
        yield
    finally:
        _gather_only = previous


# id(state dict being built) -> {wid: the weight gathered for it}; an entry goes with its dict.
_exported: dict[int, dict[int, torch.Tensor | None]] = {}


def _exported_of(state_dict: dict) -> dict[int, torch.Tensor | None]:
    key = id(state_dict)
    out = _exported.get(key)
    if out is None:
        out = _exported[key] = {}
        try:
            weakref.finalize(state_dict, _exported.pop, key, None)
        except TypeError:  # a plain dict cannot be weakly referenced: nothing is shared across calls
            del _exported[key]
    return out



def _state_dict_post_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    ets = elastic_tensors_of(module)  # one tensor, or a table's row blocks ([Note: a table in row blocks])
    rt = ets[0].runtime
    # A tensor used by two modules (an embedding and its tied output layer: [Note: embeddings
    # under the runtime] in embedding.py) is gathered once per state dict, on every rank alike,
    # and both keys get that one tensor, as a plain tied model's state dict has.
    exported = _exported_of(state_dict)
    key = ets[0].wid
    if key in exported:
        weight = exported[key]
    else:
        parts = []
        for et in ets:
            _rendezvous(rt, f"state_dict() ({et.name})")
            part = rt.full_weight(et)
            if part.device.type != "cpu" and not _gather_only:
                part = part.cpu()  # one weight at a time on the device: see [Note: the full state dict is a collective]
            parts.append(part)
        weight = parts[0] if len(parts) == 1 else torch.cat(parts)
        exported[key] = None if _gather_only else weight
    if _gather_only:
        return
    if getattr(module, "fan_in_fan_out", False):
        weight = weight.t().contiguous()  # Conv1D stores [in, out]; the runtime holds [out, in]
    # This module's keys are the last ones (its subtree was just saved): re-add them after the
    # weight so the order is nn.Linear's (weight, bias, then the adapters).
    own = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    state_dict[prefix + "weight"] = weight
    state_dict.update(own)


def _load_state_dict_pre_hook(
    module: nn.Module, state_dict: dict, prefix: str, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    key = prefix + "weight"
    if key not in state_dict:
        if strict:
            missing_keys.append(key)
        return
    full = state_dict.pop(key)  # not a Parameter of this module: it would count as unexpected
    ets = elastic_tensors_of(module)
    conv1d = getattr(module, "fan_in_fan_out", False)  # Conv1D saves [in, out]; the runtime holds [out, in]
    shape = (sum(et.shape[0] for et in ets), *ets[0].shape[1:])
    expected = shape[::-1] if conv1d else shape
    if tuple(full.shape) != tuple(expected):
        error_msgs.append(
            f"size mismatch for {key}: copying a param with shape {tuple(full.shape)} from checkpoint, "
            f"the shape in current model is {torch.Size(expected)}."
        )
        return
    full = full.t() if conv1d else full
    r0 = 0
    for et in ets:  # a table's row blocks ([Note: a table in row blocks] in embedding.py), in row order
        load_full_weight(et, full[r0 : r0 + et.shape[0]])
        r0 += et.shape[0]


def load_full_weight(et: ElasticTensor, full: torch.Tensor) -> None:
    """Replace the frozen weight of `et` by `full` (its whole value, on every rank): each rank
    keeps its own shard; cached chunks of the old value are dropped from the pool. Local (no
    collective) for a weight kept as device shards; for a weight in the host store a
    collective of the runtime's group ([Note: one writer per node]). Not while a forward or
    backward is using the weight."""
    rt = et.runtime
    err = None
    try:
        rt.drop_cached(et)  # before the copy: a weight in use is refused with nothing changed
    except RuntimeError as exc:
        err = f"load_state_dict: {exc}"
    if et.store_offset is not None:
        _store_barrier(rt, err, f"load_state_dict({et.name}): before writing the host store")
    elif err is not None:
        raise RuntimeError(err)
    with torch.no_grad():
        full = full.detach().to(et.dtype)
        if et.shard is not None:
            # Cut where the source lives (quantized again when the weight is stored quantized).
            shard = et.shard_of_weight(full) if et.qlayout is not None else et.layout.shard(full, rt.rank, padded=False)
            et.shard.copy_(shard)  # in place: world size 1 keeps chunk views of the shard
        if et.store_offset is None:
            return
        err = None
        if rt.host_node is None or rt.host_node.layout.local_rank == 0:
            try:
                write_host_store(et, full)
            except Exception as exc:  # noqa: BLE001 - agreed below, raised on every rank
                err = f"{type(exc).__name__}: {exc}"
        _store_barrier(rt, err, f"load_state_dict({et.name}): writing the host store")


def _store_barrier(rt: ElasticRuntime, err: str | None, what: str) -> None:
    """Steps (1)-(2) or (4) of [Note: one writer per node]: nothing of this rank reads the store
    any more, then every rank meets (and fails together when any passes an error)."""
    if rt.copy_stream is not None:
        rt.copy_stream.synchronize()  # host copies this rank queued are done reading the store
    agree(err, rt.group, what=what, timeout_s=rt.policy.collective_timeout_s)


def write_host_store(et: ElasticTensor, full: torch.Tensor) -> None:
    """Write the whole weight `full` into the node's host store (the node's first local rank,
    between the barriers of [Note: one writer per node])."""
    et.write_host(full)  # as stored: its quantized image for a quantized weight


def install_hooks(model: nn.Module) -> None:
    """The state-dict post-hook and the load pre-hook on every elastic layer of `model`."""
    for module in model.modules():
        if _is_elastic_layer(module):
            module.register_state_dict_post_hook(_state_dict_post_hook)
            module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
