"""Checkpoints: read and checked before the process group starts, written collectively.

[Note: checkpoint layout and resume]
`--save-dir DIR` gets DIR/checkpoint/ every --save-every steps and at the end:
  config.json                the run configuration (what must match to resume), the record of
                             the options (configuration.py) and info
  trainer_state.json         step, the loss of every step so far
  adapter_model.safetensors  the adapters at that step (PEFT format, with adapter_config.json)
  optimizer.pt               AdamW state and the parameter names it belongs to
  rng_rank{r}.pt             each rank's torch (and CUDA) and Python RNG states
  manifest.json              the run's id, the step, and the size and sha256 of every file above
Every rank writes its RNG file, rank 0 the shared files, all into DIR/.checkpoint-tmp/;
after a barrier rank 0 swaps the folder in by rename (the previous checkpoint is kept under
DIR/.checkpoint-old until the swap is done), so a checkpoint is never seen half-written.
The folder is assumed to be on a file system every rank sees (as the output folder is).
`--resume DIR` (DIR or DIR/checkpoint) restores all of it and continues to --steps. Batches
depend on (seed, step) only (python_api/finetune/data.py), the adapters and optimizer state are
restored bit for bit, and every RNG draw after the checkpoint (LoRA dropout) continues from the
saved states, so on CPU a resumed run reproduces the losses of an uninterrupted one bit for
bit (a test checks it). The elastic policy's residency knobs (--pool-budget, --keep-ratio,
--persist-ratio, --prefetch-depth, --collective-kib) may change on resume: they never change
a computed bit (ARCHITECTURE.md, correctness invariant). What changes numerics must match, and
a checkpoint that differs is refused before any step, naming the field: world size, model
configuration and dtype, tokenizer, data (token count and sha256), seq-len, micro-batch,
grad-accum, optimizer hyper-parameters, seed, LoRA r/alpha/dropout/targets, chunk size.
The base weights of a --model directory are identified by its configuration only.
Every file of a checkpoint is validated when it is read, before the process group starts
(JSON fields, adapter names/shapes, finite values, optimizer and RNG state structure): a
damaged or edited file is one error naming it, never a traceback during the run.

[Note: the checkpoint's manifest]
A damaged file can be well formed: one flipped data byte, an exponent bit set (0.0012 becomes
0.307), another run's adapters of the same shapes, all-zero adapters. No structural check
sees these, and resuming from them trained on with exit 0. So every rank hashes its RNG file
after writing it, the ranks exchange the digests, and rank 0 writes manifest.json last (size
and sha256 of every file, the run's id and the step) before the folder is swapped in.
Resuming verifies, on every rank before anything else is read, each file it reads against
the manifest and refuses, naming the file, one that differs; a checkpoint without a manifest
(or of format /1, written before manifests) is refused too: it cannot be verified. The run's
id (rank 0's uuid4, agreed when the run starts, kept by every resume) is in the manifest,
config.json and trainer_state.json, so files mixed from two runs are refused even where
their digests were recomputed. What the manifest cannot tell: a checkpoint whose files *and*
manifest were rewritten consistently; behind it, adapters whose lora_A and lora_B are both
all zero (they would never train) are refused as well. A checkpoint
written at the last planned step (a run killed before its report) is resumed by training
nothing and writing the adapter, probe and report from it. Each process that trains part of a
run is one segment of trainer_state.json (see [Note: segments of a run]).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
from dataclasses import dataclass, field

import torch

from ..distributed.agree import exchange
from .agreement import configuration_differences
from .configuration import FinetuneConfig, resume_differences
from .constants import CHECKPOINT_FORMAT, MANIFEST_FORMAT, PROG
from .errors import FinetuneError
from .files import agreed_write, local_now, torch_save_atomic, write_json
from .option_values import budget_label
from .policy import elastic_policy

CKPT = "checkpoint"
_CKPT_TMP = ".checkpoint-tmp"
_CKPT_OLD = ".checkpoint-old"
_SHARED_FILES = ("config.json", "trainer_state.json", "adapter_model.safetensors", "adapter_config.json", "optimizer.pt")
MANIFEST = "manifest.json"


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


@dataclass
class Resume:
    path: str
    step: int
    losses: list[float]
    optimizer: dict
    param_names: list[str]
    rng: dict
    segments: list[dict] = field(default_factory=list)  # see [Note: segments of a run]
    run_id: str = ""  # the run's identity ([Note: the checkpoint's manifest])
    digests: dict = field(default_factory=dict)  # file name -> sha256 of the shared files, from the manifest


def find_checkpoint(path: str) -> str:
    if not os.path.exists(path):
        raise FinetuneError(f"--resume {path}: no such directory")
    if not os.path.isdir(path):
        raise FinetuneError(f"--resume {path}: not a directory")
    inner = os.path.join(path, CKPT)
    if os.path.isdir(inner):
        return inner
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        return path
    if os.path.isdir(os.path.join(path, _CKPT_OLD)):
        raise FinetuneError(
            f"--resume {path}: no {CKPT}/ folder, but {_CKPT_OLD}/ exists: a checkpoint swap was interrupted; "
            f"rename {os.path.join(path, _CKPT_OLD)} to {inner} to resume from the previous checkpoint"
        )
    if _is_sweep_output(path):
        raise FinetuneError(f"--resume {path}: a sweep job's output (--sweep): a sweep writes no checkpoint and is "
                            "not resumed; run it again ([Note: a sweep job] in python_api/finetune/sweep.py)")
    raise FinetuneError(f"--resume {path}: no checkpoint there (expected {inner}/ written by --save-dir {path})")


def _is_sweep_output(path: str) -> bool:
    """Whether `path` holds a sweep job's configuration record (configuration.json with a sweep)."""
    try:
        with open(os.path.join(path, "configuration.json")) as f:
            return bool(json.load(f).get("training", {}).get("sweep"))
    except (OSError, ValueError, AttributeError):
        return False


def _read_json(path: str, what: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FinetuneError(f"checkpoint {os.path.dirname(path)} is incomplete: {os.path.basename(path)} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FinetuneError(f"checkpoint {what} {path} is not valid JSON: {exc}") from exc


def file_digest(path: str) -> dict:
    """{"bytes": size, "sha256": hex digest} of the file at `path`."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            n += len(block)
    return {"bytes": n, "sha256": h.hexdigest()}


def _is_run_id(v) -> bool:
    return isinstance(v, str) and len(v) == 32 and all(c in "0123456789abcdef" for c in v)


def _verify_listed(ckpt: str, manifest: dict, name: str) -> None:
    """The file `name` of the checkpoint is the one its manifest lists (size and sha256)."""
    files = manifest["files"]
    if name not in files:
        raise FinetuneError(f"checkpoint {ckpt}: {name} is not listed in its {MANIFEST} (damaged or edited)")
    full = os.path.join(ckpt, name)
    if not os.path.isfile(full):
        raise FinetuneError(f"checkpoint {ckpt} is incomplete: {name} is missing")
    got, want = file_digest(full), files[name]
    if got != {"bytes": want["bytes"], "sha256": want["sha256"]}:
        raise FinetuneError(
            f"checkpoint {ckpt}: {name} does not match the sha256 in its {MANIFEST} ({got['bytes']} bytes, sha256 "
            f"{got['sha256'][:16]}..., the manifest says {want['bytes']} bytes, {want['sha256'][:16]}...): the "
            f"file was damaged or replaced after the checkpoint was written; resume from an intact copy")


def _verify_manifest(ckpt: str) -> dict:
    """The checkpoint's manifest, after every shared file (all but the ranks' RNG files, which
    `read_checkpoint` verifies once the world size is known to match) has been checked against
    it ([Note: the checkpoint's manifest]); a FinetuneError naming the file otherwise."""
    path = os.path.join(ckpt, MANIFEST)
    if not os.path.isfile(path):
        try:
            with open(os.path.join(ckpt, "config.json")) as f:
                fmt = json.load(f).get("format")
        except (OSError, ValueError, AttributeError):
            fmt = None
        why = (f"it was written in format {fmt}, before checkpoints carried checksums, so its files cannot be "
               f"verified; resume it with the version that wrote it" if isinstance(fmt, str) and fmt != CHECKPOINT_FORMAT
               else "the checkpoint is incomplete or was damaged (the manifest is written last)")
        raise FinetuneError(f"checkpoint {ckpt} has no {MANIFEST} (the size and sha256 of each of its files): {why}")
    manifest = _read_json(path, "manifest")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or not _is_run_id(manifest.get("run_id"))
            or not _is_int(manifest.get("step")) or not isinstance(files, dict) or not all(
                isinstance(e, dict) and _is_int(e.get("bytes")) and isinstance(e.get("sha256"), str) for e in files.values())):
        raise FinetuneError(f"checkpoint {ckpt}: {MANIFEST} is not an {PROG} manifest ({MANIFEST_FORMAT}): the file was "
                            "damaged or edited")
    for name in _SHARED_FILES:
        _verify_listed(ckpt, manifest, name)
    return manifest


def _torch_load(path: str, what: str):
    if not os.path.isfile(path):
        raise FinetuneError(f"checkpoint {os.path.dirname(path)} is incomplete: {os.path.basename(path)} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file
        raise FinetuneError(f"checkpoint {what} {path} cannot be read: {type(exc).__name__}: {exc}") from exc


def nonfinite(t: torch.Tensor) -> bool:
    return t.is_floating_point() and not bool(torch.isfinite(t).all())


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_segments(segments, step: int, where: str) -> list[dict]:
    """trainer_state.json's "segments" (absent in older checkpoints): see [Note: segments of a run]."""
    if segments is None:
        return []
    bad = FinetuneError(f"{where}: \"segments\" is malformed (edited or damaged file)")
    if not isinstance(segments, list):
        raise bad
    last = None  # the first segment may start after step 1 (a checkpoint of a version without segments, resumed)
    for seg in segments:
        if not isinstance(seg, dict) or not all(_is_int(seg.get(k)) for k in ("first_step", "last_step")):
            raise bad
        if seg["first_step"] < 1 or (last is not None and seg["first_step"] != last + 1):
            raise bad
        if seg["last_step"] < seg["first_step"] - 1 or not isinstance(seg.get("pool_budget"), str):
            raise bad
        for k in ("step_times_s", "allgather_bytes_per_step", "allgather_bytes_counted_per_step"):
            v = seg.get(k)
            if not isinstance(v, list) or len(v) != seg["last_step"] - seg["first_step"] + 1 or not all(
                    _is_number(x) and math.isfinite(x) for x in v):
                raise bad
        if not (seg.get("peak_memory_bytes") is None or _is_int(seg["peak_memory_bytes"])):
            raise bad
        last = seg["last_step"]
    if segments and last != step:
        raise bad
    return segments


def read_checkpoint(path: str, rank: int, current: dict, steps: int, adapter_shapes: dict | None = None,
                    configuration: FinetuneConfig | None = None) -> Resume:
    """Read and check everything this rank needs from a checkpoint (no collective): every
    field of its JSON files that is used, the adapters' names, shapes and values, the
    optimizer state's structure and values, this rank's RNG state. A damaged or edited file is
    refused here, before the process group exists, never by a traceback during the run.
    `adapter_shapes`: PEFT key -> expected shape (None: not checked), from prepare().
    `configuration`: this run's (resolved), compared with the record the checkpoint holds
    (written since the configuration became types; an older checkpoint has only its run
    configuration, `current`'s counterpart, which is compared in every case)."""
    ckpt = find_checkpoint(path)
    manifest = _verify_manifest(ckpt)
    run_id = manifest["run_id"]
    cfile = os.path.join(ckpt, "config.json")
    config = _read_json(cfile, "configuration")
    if not isinstance(config, dict) or config.get("format") != CHECKPOINT_FORMAT or not isinstance(config.get("run"), dict):
        raise FinetuneError(f"checkpoint {ckpt}: config.json is not an {PROG} checkpoint configuration ({CHECKPOINT_FORMAT})")
    written_by = config.get("info", {}).get("run_id") if isinstance(config.get("info"), dict) else None
    if written_by != run_id:
        raise FinetuneError(f"checkpoint {ckpt}: its {MANIFEST} belongs to run {run_id}, its config.json to run "
                            f"{written_by}: files of two runs were mixed")
    diffs = configuration_differences(config["run"], current)
    if not diffs and configuration is not None and "configuration" in config:
        # The same fields in the record of the options ([Note: configuration as types]): equal
        # where the run configuration is, unless the file was edited.
        try:
            saved = FinetuneConfig.from_dict(config["configuration"])
        except (FinetuneError, TypeError) as exc:
            raise FinetuneError(f"checkpoint {ckpt}: config.json's configuration record is damaged: {exc}") from None
        diffs = resume_differences(saved, configuration)
    if diffs:
        raise FinetuneError(
            f"checkpoint {ckpt} was written by a different configuration ({len(diffs)} field"
            f"{'s' if len(diffs) > 1 else ''} differ): " + "; ".join(diffs[:5])
        )
    _verify_listed(ckpt, manifest, _rng_file(rank))  # the same world size: this rank's file exists
    sfile = os.path.join(ckpt, "trainer_state.json")
    state = _read_json(sfile, "state")
    if not isinstance(state, dict) or not _is_int(state.get("step")) or not isinstance(state.get("losses"), list):
        raise FinetuneError(f"checkpoint {ckpt}: trainer_state.json lacks a valid step (an integer) and losses (a list)")
    step, losses = state["step"], state["losses"]
    if step < 1:
        raise FinetuneError(f"checkpoint {ckpt}: trainer_state.json has step {step}; a checkpoint is at step 1 or later")
    if not all(_is_number(x) and math.isfinite(x) for x in losses):
        raise FinetuneError(f"checkpoint {ckpt}: trainer_state.json has a loss that is not a finite number "
                            "(a run stops at a non-finite loss and never saves it: the file was damaged or edited)")
    losses = [float(x) for x in losses]
    if len(losses) != step:
        raise FinetuneError(f"checkpoint {ckpt}: trainer_state.json has {len(losses)} losses for step {step}")
    segments = _check_segments(state.get("segments"), step, f"checkpoint {ckpt}: trainer_state.json")
    if state.get("run_id") != run_id or manifest["step"] != step:
        raise FinetuneError(f"checkpoint {ckpt}: trainer_state.json (run {state.get('run_id')}, step {step}) is not the "
                            f"one its {MANIFEST} lists (run {run_id}, step {manifest['step']}): files of two checkpoints "
                            "were mixed")
    if step > steps:
        raise FinetuneError(f"checkpoint {ckpt} is at step {step}, past --steps {steps}; pass --steps {step} or more")
    wfile = os.path.join(ckpt, "adapter_model.safetensors")
    acfile = os.path.join(ckpt, "adapter_config.json")
    if not os.path.isfile(wfile) or not os.path.isfile(acfile):
        raise FinetuneError(f"checkpoint {ckpt} is incomplete: adapter_model.safetensors / adapter_config.json missing")
    aconf = _read_json(acfile, "adapter configuration")
    lora = current.get("lora", {})
    if not isinstance(aconf, dict) or aconf.get("peft_type") != "LORA":
        raise FinetuneError(f"checkpoint {ckpt}: adapter_config.json is not a PEFT LoRA configuration (peft_type LORA)")
    for key, want in (("r", lora.get("r")), ("lora_alpha", lora.get("alpha")), ("use_rslora", False)):
        got = aconf.get(key, False if key == "use_rslora" else "<absent>")
        if got != want or type(got) is bool and type(want) is not bool:
            raise FinetuneError(f"checkpoint {ckpt}: adapter_config.json has {key}={got!r}, this run (and the "
                                f"checkpoint's config.json) {want!r}: the file was damaged or edited")
    from safetensors.torch import load_file

    try:
        adapters = load_file(wfile)  # read now so a damaged file is refused before any step; train() loads it
    except Exception as exc:  # noqa: BLE001
        raise FinetuneError(f"checkpoint adapters {wfile} cannot be read: {exc}") from exc
    if adapter_shapes is not None:
        if set(adapters) != set(adapter_shapes):
            extra, lack = sorted(set(adapters) - set(adapter_shapes)), sorted(set(adapter_shapes) - set(adapters))
            raise FinetuneError(f"checkpoint adapters {wfile} do not fit this model's adapters"
                                + (f"; unknown: {extra[:3]}" if extra else "") + (f"; missing: {lack[:3]}" if lack else ""))
        for key, shape in adapter_shapes.items():
            if shape is not None and tuple(adapters[key].shape) != shape:
                raise FinetuneError(f"checkpoint adapters {wfile}: {key} has shape {tuple(adapters[key].shape)}, "
                                    f"this model's adapter {shape}")
    for key, t in adapters.items():
        if not t.is_floating_point():
            raise FinetuneError(f"checkpoint adapters {wfile}: {key} is {t.dtype}, not a floating-point tensor")
        if nonfinite(t):
            raise FinetuneError(f"checkpoint adapters {wfile}: {key} holds NaN or Inf values (training never saves "
                                "them: the file was damaged or edited)")
    for key, t in adapters.items():
        other = key.replace(".lora_A.", ".lora_B.")
        if key != other and other in adapters and not t.any() and not adapters[other].any():
            module = key[len("base_model.model."):].rsplit(".lora_A.", 1)[0]
            raise FinetuneError(f"checkpoint adapters {wfile}: lora_A and lora_B of {module} are both all zero: they "
                                "would never train (both gradients are zero), and training never writes them so: the "
                                "file was damaged or edited")
    opt = _torch_load(os.path.join(ckpt, "optimizer.pt"), "optimizer state")
    if not isinstance(opt, dict) or "state_dict" not in opt or "param_names" not in opt:
        raise FinetuneError(f"checkpoint {ckpt}: optimizer.pt is not an {PROG} optimizer state")
    _check_optimizer_state(opt, adapters, ckpt)
    rng = _torch_load(os.path.join(ckpt, _rng_file(rank)), f"RNG state of rank {rank}")
    _check_rng_state(rng, os.path.join(ckpt, _rng_file(rank)))
    digests = {name: manifest["files"][name]["sha256"] for name in _SHARED_FILES}
    return Resume(ckpt, step, losses, opt["state_dict"], list(opt["param_names"]), rng, segments, run_id, digests)


def _check_optimizer_state(opt: dict, adapters: dict, ckpt: str) -> None:
    """The AdamW state_dict's structure (one group over the named parameters, exp_avg and
    exp_avg_sq of each parameter's shape), and finite values."""
    where = f"checkpoint {ckpt}: optimizer.pt"
    names, sd = opt["param_names"], opt["state_dict"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise FinetuneError(f"{where}: param_names is not a list of names")
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) or not isinstance(sd.get("param_groups"), list):
        raise FinetuneError(f"{where}: not an AdamW state (state, param_groups)")
    groups = sd["param_groups"]
    if len(groups) != 1 or not isinstance(groups[0], dict) or list(groups[0].get("params", [])) != list(range(len(names))):
        raise FinetuneError(f"{where}: expected one parameter group over its {len(names)} named parameters")
    for index, entry in sd["state"].items():
        if not _is_int(index) or not 0 <= index < len(names) or not isinstance(entry, dict):
            raise FinetuneError(f"{where}: a state entry belongs to no parameter ({index!r})")
        adapter = adapters.get(f"base_model.model.{names[index]}")
        for key in ("exp_avg", "exp_avg_sq", "step"):
            t = entry.get(key)
            if not isinstance(t, torch.Tensor):
                raise FinetuneError(f"{where}: {names[index]} lacks {key}")
            if key != "step" and adapter is not None and t.shape != adapter.shape:
                raise FinetuneError(f"{where}: {key} of {names[index]} has shape {tuple(t.shape)}, "
                                    f"the adapter {tuple(adapter.shape)}")
            if nonfinite(t):
                raise FinetuneError(f"{where}: {key} of {names[index]} holds NaN or Inf values (the file was damaged or edited)")


def _check_rng_state(rng, path: str) -> None:
    """What _restore_rng will set: refused here rather than by a RuntimeError in the run."""
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor):
        raise FinetuneError(f"checkpoint {path} is not an RNG state")
    want = torch.get_rng_state()
    if rng["torch"].dtype != want.dtype or rng["torch"].shape != want.shape:
        raise FinetuneError(f"checkpoint {path}: the torch RNG state has the wrong size (damaged or edited file)")
    try:
        random.Random().setstate(to_tuple(rng.get("python")))
    except (TypeError, ValueError) as exc:
        raise FinetuneError(f"checkpoint {path}: the Python RNG state is invalid: {exc}") from exc


def write_checkpoint(job, step: int, losses: list[float], segments: list[dict], optimizer_state: dict,
                     save_adapter) -> None:
    """Collective: every rank calls it at the same step (see [Note: checkpoint layout and
    resume]). A write that fails on any rank (disk full, folder gone) stops every rank with
    one message naming the path; the previous checkpoint is left as it was. `optimizer_state`:
    what optimizer.pt holds, every rank's part gathered already (loop.optimizer_state);
    `save_adapter(job, folder, what)`: the collective that writes the adapter
    (Engine.save_adapter)."""
    save_dir, rank = job.save_dir, job.rank
    tmp = os.path.join(save_dir, _CKPT_TMP)
    final = os.path.join(save_dir, CKPT)
    kept = (f"; {final} still holds the checkpoint of step {job.checkpoint_step}" if job.checkpoint_step
            else "; no checkpoint was written")
    what = f"the checkpoint of step {step} was not written{kept}"

    def fresh_folder():
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)

    def files():
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
               "cuda": torch.cuda.get_rng_state(job.device) if job.device.type == "cuda" else None}
        torch_save_atomic(rng, os.path.join(tmp, _rng_file(rank)))
        digests[_rng_file(rank)] = file_digest(os.path.join(tmp, _rng_file(rank)))
        if rank == 0:
            torch_save_atomic(optimizer_state, os.path.join(tmp, "optimizer.pt"))
            write_json(os.path.join(tmp, "trainer_state.json"), {"step": step, "losses": losses, "segments": segments,
                                                                  "run_id": job.run_id})
            write_json(os.path.join(tmp, "config.json"), {
                "format": CHECKPOINT_FORMAT, "run": job.config, "configuration": job.cfg.to_dict(),
                "info": {"run_id": job.run_id, "step": step, "steps_planned": job.cfg.training.steps, "written": local_now(),
                         "model_source": job.spec.source, "data_source": job.data_info["source"],
                         "policy": {k: getattr(elastic_policy(job.cfg, job.cfg.elastic.pool_budget), k) for k in (
                             "chunk_bytes", "keep_ratio", "persist_ratio", "prefetch_depth", "collective_bytes",
                             "weight_format", "quant_block_size", "quant_nested")},
                         "pool_budget": budget_label(job.cfg.elastic.pool_budget)},
            })

    def swap():
        if rank != 0:
            return
        missing = [f for f in _SHARED_FILES + (MANIFEST,) + tuple(_rng_file(r) for r in range(job.world_size))
                   if not os.path.isfile(os.path.join(tmp, f))]
        if missing:
            raise FinetuneError(f"{missing} are missing from {tmp} (every rank must see --save-dir on one shared file system)")
        old = os.path.join(save_dir, _CKPT_OLD)
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)

    def manifest():
        if rank != 0:
            return
        listed = {}
        for d in every:
            listed.update(d)
        for name in _SHARED_FILES:
            listed[name] = file_digest(os.path.join(tmp, name))
        write_json(os.path.join(tmp, MANIFEST), {"format": MANIFEST_FORMAT, "run_id": job.run_id, "step": step,
                                                 "files": dict(sorted(listed.items()))})

    digests: dict = {}
    agreed_write(job, fresh_folder, what)
    agreed_write(job, files, what)
    save_adapter(job, tmp, what)
    # Every rank's RNG digest to rank 0, which writes the manifest last ([Note: the checkpoint's manifest]).
    every = exchange(digests, what=what)
    agreed_write(job, manifest, what)
    agreed_write(job, swap, what)
    job.checkpoint_step = step


def to_tuple(x):
    return tuple(to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
