"""A user's own training script on a converted model (issue 28): converting under a launcher
before any process group exists, adapter-only checkpoints of `ElasticTrainer` and their resume,
a plain `Trainer` refused on several ranks before step 1, and `accelerate`.

Exactness: resuming and the ranks' agreement are compared bit for bit (same chunking, same
values, same reduction order); the accelerate path against a single-process reference with
TOL (rtol = atol = 1e-4 in fp32, tests/nn/test_lora.py: chunked GEMMs and a 2-rank average
sum in another order).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from tests._dist import run_distributed
from tests.hf.test_hf_save import _args, _converted, _logits, _Rows

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_torchrun(rank, world_size, port):
    """Leave the helper's process group and set what torchrun sets: the script starts with no
    process group, as under a launcher."""
    import torch.distributed as dist

    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")


# ------------------------------------------------------------- the group under a launcher


def _convert_before_args_worker(rank, world_size, port, tmp):
    import torch.distributed as dist

    from elastic_kernels.api import hf
    from elastic_kernels.api.nn import runtime_of

    _as_torchrun(rank, world_size, port)
    assert not dist.is_initialized()
    model = _converted()  # the natural HF order: load, convert, then TrainingArguments
    rt = runtime_of(model)
    sharded = (rt.world_size, rt.rank, dist.is_initialized() and dist.get_backend())
    trainer = hf.ElasticTrainer(model=model, args=_args(tmp), train_dataset=_Rows(seed=rank))
    trainer.train()
    model.eval()
    return sharded, type(trainer.model_wrapped).__name__, trainer.args.world_size, _logits(model)


def test_convert_before_training_arguments_shards(tmp_path):
    results = run_distributed(_convert_before_args_worker, 2, _free_port(), str(tmp_path), timeout=300)
    for rank, (sharded, wrapped, args_world, _) in enumerate(results):
        assert sharded == (2, rank, "gloo"), sharded  # not a silent world size 1
        assert wrapped == "DistributedDataParallel" and args_world == 2
    # Different data per rank, averaged gradients: the ranks stayed identical.
    torch.testing.assert_close(results[0][3], results[1][3], rtol=0, atol=0)


def test_world_size_without_rendezvous_is_refused(monkeypatch):
    import torch.distributed as dist

    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2.*torchrun.*init_process_group"):
        _converted()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(RuntimeError, match="WORLD_SIZE is 'two'"):
        _converted()
    monkeypatch.setenv("WORLD_SIZE", "1")  # a one-process launch: a plain script
    from elastic_kernels.api.nn import runtime_of

    assert runtime_of(_converted()).world_size == 1 and not dist.is_initialized()
