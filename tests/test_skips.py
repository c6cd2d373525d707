"""tests/_skips.py: the GPU check sees a GPU that torch can use even without /dev/nvidia<N>
nodes (issue 17), and never initialises CUDA in the test process."""

from __future__ import annotations

import subprocess
import sys

from tests import _skips


def test_gpu_exposed_without_device_nodes_is_seen(monkeypatch):
    """A GPU reached through the driver without /dev/nvidia<N> (WSL's /dev/dxg, renamed nodes,
    ROCm) is decided by torch.cuda.is_available(), not skipped silently."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(_skips.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(_skips, "_gpu_driver_present", lambda: True, raising=False)
    monkeypatch.setattr(_skips, "_torch_uses_a_gpu", lambda: (True, "torch x (12.8)"), raising=False)
    assert _skips.gpu_present() is True
    assert _skips.gpu_skip_reason() is None
    monkeypatch.setattr(_skips, "_torch_uses_a_gpu", lambda: (False, "torch x (CPU-only build)"), raising=False)
    assert _skips.gpu_present() is False


def test_no_driver_no_nodes_means_no_gpu_without_asking_torch(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(_skips.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(_skips, "_gpu_driver_present", lambda: False, raising=False)

    def never():
        raise AssertionError("torch was asked although no GPU driver is there")

    monkeypatch.setattr(_skips, "_torch_uses_a_gpu", never, raising=False)
    assert _skips.gpu_present() is False
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(_skips.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    assert _skips.gpu_present() is False  # hidden on purpose


def test_probe_does_not_initialise_cuda_here():
    """The check leaves this process's CUDA state untouched (it asks a child)."""
    code = ("import sys; sys.path.insert(0, '.'); import torch; from tests import _skips; _skips._torch_uses_a_gpu(); "
            "print(int(torch.cuda.is_initialized()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
