"""The runtime's check that a process on NCCL uses its own GPU (check_nccl_device in
python_api/runtime/runtime.py): pure, so it runs without a GPU."""

from __future__ import annotations

import pytest
import torch


def test_nccl_device_must_be_the_current_one_and_local_ranks():
    from elastic_kernels.api.runtime.runtime import check_nccl_device

    cuda = torch.device
    check_nccl_device(cuda("cuda", 2), current=2, device_count=8, local_rank="2")  # set_device(local_rank): fine
    check_nccl_device(cuda("cuda", 0), current=0, device_count=1, local_rank="5")  # one visible GPU per process
    check_nccl_device(cuda("cuda", 0), current=0, device_count=8, local_rank=None)  # no torchrun
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK is 3 but the current CUDA device is cuda:0.*torch.cuda.set_device"):
        check_nccl_device(cuda("cuda", 0), current=0, device_count=8, local_rank="3")  # forgot set_device
    with pytest.raises(RuntimeError, match=r"the weights are on cuda:1, but the current CUDA device is cuda:0"):
        check_nccl_device(cuda("cuda", 1), current=0, device_count=8, local_rank="1")
