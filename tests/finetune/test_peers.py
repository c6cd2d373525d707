"""The peers of the elastic runtime (python_api/finetune/peers/): DeepSpeed ZeRO-3 + PEFT,
DDP + PEFT and FSDP2 at each reshard setting, trained beside the elastic run in one gloo
process group on the same base weights, initial adapters, batches and AdamW.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed]


# ------------------------------------------------------------------ the all-gather counter


def _counter_worker(rank, world_size):
    import torch.distributed as dist

    from python_api.finetune.measure import AllGatherCounter

    inp = torch.full((3, 5), float(rank))
    out = torch.empty(world_size * 3, 5)
    with AllGatherCounter() as counter:
        # DeepSpeed's TorchBackend calls it with keywords (comm/torch.py:380 in 0.19.8)
        dist.all_gather_into_tensor(output_tensor=out, input_tensor=inp)
        keyword = (counter.bytes, counter.calls)
        dist.all_gather_into_tensor(out, inp, None, False)
        positional = (counter.bytes, counter.calls)
        dist.all_gather([torch.empty(2) for _ in range(world_size)], torch.zeros(2))  # a list gather: not counted
        listed = (counter.bytes, counter.calls)
    return keyword, positional, listed, out[:, 0].tolist()


def test_counter_counts_keyword_and_positional_calls():
    """The counter takes the call the way DeepSpeed makes it (keywords) and the way FSDP2 and
    the runtime make it (positional): each counts what a rank receives, (W - 1) x input bytes."""
    W = 2
    per_call = (W - 1) * 3 * 5 * 4
    for keyword, positional, listed, gathered in run_distributed(_counter_worker, W, timeout=120):
        assert keyword == (per_call, 1)
        assert positional == (2 * per_call, 2)
        assert listed == positional
        assert gathered == [0.0] * 3 + [1.0] * 3
