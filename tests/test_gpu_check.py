"""`make gpu-check` (bench/gpu_check.sh) dry-run here, as on a GPU machine that lacks things: no
GPU visible (CUDA_VISIBLE_DEVICES empty), an optional package hidden (a sitecustomize that
makes its import fail, as where it is not installed), the build skipped (the extension built
here is used). The script must still run every file it can, skip a file whose collection needs
the hidden package (saying which), count any other collection error as a failure, and write
its log and summary under $OUT (the comment at the top of the script says why). Collection only, on three small files written here: a few seconds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HIDE = '''
import os, sys
_HIDDEN = {n for n in os.environ.get("GPU_CHECK_HIDE", "").split(",") if n}
class _Hide:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in _HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Hide)
'''


@pytest.mark.parametrize("hidden", ["bitsandbytes"])
def test_gpu_check_dry_run_skips_what_it_cannot_import(tmp_path, hidden):
    site, files, out = tmp_path / "site", tmp_path / "files", tmp_path / "out"
    site.mkdir()
    files.mkdir()
    (site / "sitecustomize.py").write_text(HIDE)
    (files / "test_needs_optional.py").write_text(f"import {hidden}\n\n\ndef test_a():\n    pass\n")
    (files / "test_plain.py").write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_b():\n    pass\n")
    (files / "test_broken.py").write_text("import not_a_package_of_this_project\n\n\ndef test_c():\n    pass\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GPU_CHECK_HIDE=hidden, PYTHONPATH=str(site), OUT=str(out),
               PYTHON=sys.executable, GPU_CHECK_SKIP_BUILD="1", GPU_CHECK_IMPORT="0",
               GPU_CHECK_PYTEST_ARGS="--collect-only",
               GPU_TEST_FILES=" ".join(str(files / f) for f in ("test_needs_optional.py", "test_plain.py",
                                                                  "test_broken.py")))
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "tests"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    summary = (out / "summary.txt").read_text().splitlines()
    log = (out / "gpu_check.log").read_text()
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # the broken file fails the run
    assert f"optional {hidden}: absent" in log and "CUDA_VISIBLE_DEVICES ''" in log
    assert "install: elastic_kernels.api already importable from this worktree" in summary
    assert (f"tests {files}/test_needs_optional.py: skipped: ModuleNotFoundError: No module named '{hidden}' "
            f"(optional package missing here)") in summary
    assert f"tests {files}/test_plain.py: 1 test collected in" in "\n".join(summary)
    broken = [s for s in summary if s.startswith(f"tests {files}/test_broken.py: ")]
    assert broken and broken[0].startswith(f"tests {files}/test_broken.py: FAILED (pytest exit 2)"), summary
    # each file's output is in the log, in order, before the next file's header
    heads = [log.index(f"== gpu-check: pytest -m gpu {files}/{f}") for f in
             ("test_needs_optional.py", "test_plain.py", "test_broken.py")]
    assert heads == sorted(heads) and log.index("No module named 'not_a_package_of_this_project'") > heads[2]
