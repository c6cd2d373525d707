"""Build of elastic_kernels._C.

Environment switches (also in README.md):

  ELASTIC_SKIP_EXT=1    build no extension at all: install the Python and Triton code only;
                        the pure-torch references serve every op.
  ELASTIC_SKIP_CUDA=1   build the C++ (CPU) part only, even where CUDA could be built.
  ELASTIC_FORCE_CUDA=1  fail loudly unless the CUDA part is built (CI sets this).
  TORCH_CUDA_ARCH_LIST  GPU architectures to compile for; default "8.0;9.0" when no GPU is
                        visible (torch's own default otherwise: the visible GPUs).
  MAX_JOBS              parallel compile jobs; default min(CPUs, GiB of RAM / 3), since one
                        translation unit that includes torch takes 2-3 GiB.

The CUDA part is built whenever this torch is a CUDA build (torch.version.cuda is set) and a
CUDA toolkit is found (CUDA_HOME, or nvcc on PATH), whether or not a GPU is visible.

Layout of the sources (compile time matters, see NOTES.md):
  csrc/*.cpp           schemas (TORCH_LIBRARY) and C++ CPU impls, the pool, the Python module
  csrc/host/*.cpp      the host store (shared host segment; cudaHostRegister in the CUDA build)
  csrc/quant/*.cpp     C++ CPU impls of the dequant ops (quantized chunk blobs)
  csrc/cuda/*.cu       CUDA kernels; they include only CUDA headers and csrc/include/elastic/*.h
  csrc/cuda/*.cpp      thin bindings: argument checks + TORCH_LIBRARY_IMPL(elastic, CUDA)
"""

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _default_max_jobs() -> str:
    cpus = os.cpu_count() or 1
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = 8.0
    return str(max(1, min(cpus, int(mem_gib // 3))))


def _cuda_home():
    """The CUDA toolkit to build with, or None: CUDA_HOME/CUDA_PATH, else the toolkit of the
    nvcc on PATH (which may be a wrapper script), else /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
            os.path.join(home, "include", "cuda_runtime.h")
        ):
            return home
    return None


def _extra_cuda_include_dirs():
    """Headers that ATen/cuda includes (cusparse.h, cublas_v2.h, ...) ship in the nvidia-*
    wheels under site-packages/nvidia/cu*/include, not in the toolkit's include dir."""
    dirs = []
    for base in sys.path:
        for d in sorted(glob.glob(os.path.join(base, "nvidia", "cu*", "include"))):
            if os.path.isdir(d) and d not in dirs:
                dirs.append(d)
    return dirs


def _extensions():
    if _flag("ELASTIC_SKIP_EXT"):
        print("elastic-kernels: ELASTIC_SKIP_EXT=1, building no extension", flush=True)
        return [], {}

    import torch

    # torch.utils.cpp_extension reads CUDA_HOME once, at import: settle it first.
    cuda_home = _cuda_home()
    if cuda_home is not None:
        os.environ["CUDA_HOME"] = cuda_home
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    os.environ.setdefault("MAX_JOBS", _default_max_jobs())

    cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cpp_sources += sorted(glob.glob(os.path.join("csrc", "pool", "*.cpp")))
    cpp_sources += sorted(glob.glob(os.path.join("csrc", "host", "*.cpp")))
    cpp_sources += sorted(glob.glob(os.path.join("csrc", "quant", "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    cuda_sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))

    include_dirs = [os.path.join(ROOT, "csrc", "include")]
    # No -std flag: torch's cpp_extension picks the standard its headers need (C++20 since 2.10).
    # -ffp-contract=off: no multiply-add is fused into an FMA, so the C++ kernels round as the
    # references and bitsandbytes do (csrc/include/elastic/quant_blob.h nested_absmax).
    cxx_flags = ["-O3", "-fvisibility=hidden", "-ffp-contract=off"]
    nvcc_flags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]

    build_cuda = bool(torch.version.cuda) and cuda_home is not None and not _flag("ELASTIC_SKIP_CUDA")
    if _flag("ELASTIC_FORCE_CUDA") and not build_cuda:
        why = (
            "ELASTIC_SKIP_CUDA is set" if _flag("ELASTIC_SKIP_CUDA")
            else f"torch {torch.__version__} is not a CUDA build" if not torch.version.cuda
            else "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"
        )
        raise RuntimeError(f"ELASTIC_FORCE_CUDA=1 but the CUDA part cannot be built: {why}")

    if build_cuda:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
        include_dirs += _extra_cuda_include_dirs()
        print(
            f"elastic-kernels: building C++ and CUDA (torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"toolkit {cuda_home}, archs {os.environ.get('TORCH_CUDA_ARCH_LIST', 'visible GPUs')}, "
            f"MAX_JOBS={os.environ['MAX_JOBS']})",
            flush=True,
        )
        ext = CUDAExtension(
            name="elastic_kernels._C",
            sources=cpp_sources + cuda_sources,
            include_dirs=include_dirs,
            define_macros=[("ELASTIC_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        )
    else:
        print(f"elastic-kernels: building C++ only (torch {torch.__version__})", flush=True)
        ext = CppExtension(
            name="elastic_kernels._C",
            sources=cpp_sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
        )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    name="elastic-kernels",
    version="0.1.0",
    description="LoRA fine-tuning across GPUs with frozen base weights kept as an elastic, paged cache",
    # The library's folder python_api/ installs as the import package elastic_kernels.api (a
    # name no user project can collide with); the mechanism layer is elastic_kernels itself.
    packages=find_packages(include=["elastic_kernels", "elastic_kernels.*"])
    + ["elastic_kernels.api" + p[len("python_api"):] for p in find_packages(include=["python_api", "python_api.*"])],
    package_dir={"elastic_kernels.api": "python_api"},
    python_requires=">=3.10",
    install_requires=["torch>=2.11"],
    # `--baseline deepspeed` (ZeRO-3 beside the elastic runs); DeepSpeed's sdist must be built
    # against the installed torch: DS_BUILD_OPS=0 pip install --no-build-isolation ...
    extras_require={"baselines": ["deepspeed>=0.19"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    # The fine-tuning CLI; under torchrun: `torchrun --nproc-per-node N --no-python elastic-finetune ...`
    entry_points={"console_scripts": ["elastic-finetune = elastic_kernels.api.finetune.cli:entry"]},
    zip_safe=False,
)
