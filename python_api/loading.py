"""Loading a model from its safetensors files without holding it whole on any rank.

    model = load_elastic("path/to/hf_model", LoRAConfig(r=16, alpha=32), ElasticPolicy())

or, step by step (the same thing):

    source = SafetensorsSource("path/to/hf_model", device="cuda")
    model = empty_model("path/to/hf_model", torch.bfloat16)      # parameters on meta
    model = convert_to_elastic(model, lora, policy, source=source)

[Note: loading from files]
`convert_to_elastic` on a model already built in memory needs every rank to hold the whole
model first (one copy per rank). With a `source`, the model is built with its parameters on the
meta device (`empty_model`: shapes and dtypes only; buffers real, as
`accelerate.init_empty_weights(include_buffers=False)` makes them, so non-persistent buffers
such as rotary `inv_freq` keep the values the model's constructor computes), and then
1. `source.check(model)` compares every parameter (and every persistent buffer the files hold)
   with the files' headers: present, same shape, same dtype (or, with `allow_cast`, a floating
   dtype cast on load, as `from_pretrained(dtype=...)` does). Nothing else is read before it
   passes, on every rank (the ranks agree on the outcome in one collective, so a rank whose
   files differ fails all of them instead of leaving its peers waiting);
2. each elastic weight is registered with `rows=source.rows(name)`: the runtime reads only the
   rows its shard needs (`ChunkLayout.shard_from_rows`), about 1/W of the weight, plus 16 rows
   for the fingerprint. A transformers `Conv1D` stores its weight [in, out]; the elastic weight
   is [out, in], so its rows are columns of the stored tensor (`rows(name, transpose=True)`);
3. every other parameter (embeddings, norms, biases, small replicated linears, a tied lm_head)
   is read whole onto the target device, one tensor at a time, and tied parameters get one
   tensor for all their names (then `tie_weights()` for a Hugging Face model).
Peak host memory per rank is then its share of the frozen weights + the replicated parameters +
one read at a time (a chunk's rows; a whole Conv1D weight for a column read), never a whole
model: see `tests/test_loading.py::test_meta_loading_peak_rss` for the measured figures.

[Note: memory-mapped reads and the resident set]
safetensors (0.8) returns tensors and slices as views of a private memory map of the file, and
the map lives as long as any view of it. Pages of the map a read touches count in the process's
resident set (RssFile) until the map is unmapped: with one handle held open for the whole load,
a rank's resident set grows by its share *twice* (the touched file pages plus the copy in the
shard; measured: 270 MB for a 134 MB half of a 268 MB tensor read chunk by chunk), with one
handle per read it grows by the shard plus one read (144 MB). So every read here opens the file,
takes its slice and closes it (opening costs ~0.1 ms: the header is parsed again); whoever keeps
the result keeps only what it copies out of it. `tensor()` returns a copy that owns its memory,
never a view of the map (a frozen parameter aliasing a file that is later rewritten in place
would change, or fault, under training), and copies it in blocks of rows, so that a large
replicated tensor (an embedding) costs itself plus one block, not twice itself.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

# The most bytes one read of a replicated tensor touches in a file's map (see `tensor`).
READ_BLOCK_BYTES = 64 << 20
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files that can sit beside the weights in a model directory but are not the model: the adapter
# written by save_pretrained / save_adapter (python_api/lora.py, ADAPTER_WEIGHTS).
_NOT_THE_MODEL = ("adapter_model.safetensors",)

# safetensors header dtype names -> torch dtypes (the names safetensors 0.8 reports).
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
    "U16": getattr(torch, "uint16", None), "U32": getattr(torch, "uint32", None), "U64": getattr(torch, "uint64", None),
}


class LoadError(ValueError):
    """A model directory whose files do not fit the model (or cannot be read)."""


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else str(dtype)


class _Entry:
    __slots__ = ("key", "file", "dtype", "dtype_name", "shape")

    def __init__(self, key: str, file: str, dtype_name: str, shape: tuple[int, ...]):
        self.key, self.file, self.dtype_name, self.shape = key, file, dtype_name, shape
        self.dtype = _DTYPES.get(dtype_name)


class SafetensorsSource:
    """The tensors of a Hugging Face model directory's `*.safetensors` files (one file, or
    shards listed by `model.safetensors.index.json`), read lazily through memory maps.

    Building it reads only the files' headers (a truncated or corrupt file is a `LoadError`
    here). `device` is where the loaded model lives (default CPU); `allow_cast` lets a
    floating tensor of another floating dtype load cast to the model's dtype (else a dtype that
    differs is an error). See [Note: loading from files]."""

    def __init__(self, path: str | os.PathLike, device: torch.device | str | None = None, allow_cast: bool = False):
        self.path = os.path.abspath(os.fspath(path))
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.allow_cast = bool(allow_cast)
        # The model's `base_model_prefix` (see `resolve`), learnt by `check(model)`.
        self.prefix: str | None = None
        self.files, self.entries = self._index()

    def __repr__(self) -> str:
        return f"SafetensorsSource({self.path!r}, {len(self.entries)} tensors in {len(self.files)} file(s), device={self.device})"

    # ------------------------------------------------------------------ index

    def _index(self) -> tuple[list[str], dict[str, _Entry]]:
        from safetensors import safe_open

        if not os.path.isdir(self.path):
            raise LoadError(f"{self.path} is not a directory (a Hugging Face model directory holds config.json and *.safetensors)")
        index_path = os.path.join(self.path, INDEX_FILE)
        weight_map = None
        # from_pretrained's order: one model.safetensors, else the index of shards, else any.
        if os.path.isfile(os.path.join(self.path, SINGLE_FILE)):
            files = [SINGLE_FILE]
        elif os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f).get("weight_map")
            except (OSError, ValueError, AttributeError) as exc:
                raise LoadError(f"{index_path} is not a valid index: {exc}") from exc
            if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise LoadError(f"{index_path} has no 'weight_map' object {{tensor name: file}}")
            files = sorted(set(weight_map.values()))
            for name in files:
                if os.path.basename(name) != name or not os.path.isfile(os.path.join(self.path, name)):
                    raise LoadError(f"{index_path} lists {name!r}, which is not a file in {self.path}")
        else:
            files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors") and f not in _NOT_THE_MODEL)
            if not files:
                raise LoadError(f"{self.path} has no *.safetensors weights")
        entries: dict[str, _Entry] = {}
        for name in files:
            full = os.path.join(self.path, name)
            try:
                with safe_open(full, framework="pt") as f:
                    for key in f.keys():
                        sl = f.get_slice(key)
                        entry = _Entry(key, name, sl.get_dtype(), tuple(sl.get_shape()))
                        if key in entries:
                            raise LoadError(f"{key!r} is in two files of {self.path}: {entries[key].file} and {name}")
                        entries[key] = entry
            except LoadError:
                raise
            except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: a file that cannot be read
                raise LoadError(
                    f"{full} is not a valid safetensors file (truncated or corrupt?): {type(exc).__name__}: {exc}"
                ) from exc
        if weight_map is not None:
            for key, name in sorted(weight_map.items()):
                if key not in entries or entries[key].file != name:
                    where = f"it is in {entries[key].file}" if key in entries else "no file has it"
                    raise LoadError(f"{index_path} says {key!r} is in {name}, but {where}")
        return files, entries

    def resolve(self, name: str, prefix: str | None = None) -> str | None:
        """The key under which the files hold the model's tensor `name`: `name` itself, or, for
        a checkpoint of the base model or of a wrapped one, `name` without / with the model's
        `base_model_prefix` (Hugging Face's rule). None if no file holds it."""
        if name in self.entries:
            return name
        if prefix:
            if name.startswith(prefix + ".") and name[len(prefix) + 1:] in self.entries:
                return name[len(prefix) + 1:]
            if f"{prefix}.{name}" in self.entries:
                return f"{prefix}.{name}"
        return None

    def _key(self, names: list[str], prefix: str | None) -> str | None:
        """The key of the first of a tensor's (tied) names that the files hold."""
        return next((k for k in (self.resolve(n, prefix) for n in names) if k is not None), None)

    def _entry(self, name: str) -> _Entry:
        key = self.resolve(name, self.prefix)
        entry = None if key is None else self.entries[key]
        if entry is None:
            raise LoadError(f"{name!r} is in none of the files of {self.path} ({', '.join(self.files)})")
        return entry

    # ------------------------------------------------------------------ reads

    def rows(self, name: str, transpose: bool = False):
        """A reader `rows(begin, end)` of rows [begin, end) of the model's tensor `name` (its first
        dimension), reading only those rows from the file. With `transpose` (a Conv1D weight
        stored [in, out]), rows of the transposed [out, in] tensor, i.e. columns of the stored
        one. The result is a view of a memory map: copy what you keep
        ([Note: memory-mapped reads and the resident set])."""
        from safetensors import safe_open

        entry = self._entry(name)
        if transpose and len(entry.shape) != 2:
            raise LoadError(f"{name}: a transposed read needs a 2-D tensor, the file has shape {entry.shape}")
        full = os.path.join(self.path, entry.file)
        key = entry.key

        def read(begin: int, end: int) -> torch.Tensor:
            with safe_open(full, framework="pt") as f:
                sl = f.get_slice(key)
                return sl[:, begin:end].t() if transpose else sl[begin:end]

        return read

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The model's tensor `name` whole, on `self.device` (cast to `dtype` if given), in
        memory of its own (a copy, never a view of the file's map), copied in blocks of rows of
        at most `READ_BLOCK_BYTES` so that the pages of the map it touches never add up to more
        than one block ([Note: memory-mapped reads and the resident set]): a 2 GB embedding
        costs 2 GB, not 4."""
        from safetensors import safe_open

        entry = self._entry(name)
        if entry.dtype is None:
            raise LoadError(f"{entry.key!r} in {entry.file} has dtype {entry.dtype_name}, which torch cannot hold")
        out = torch.empty(entry.shape, dtype=dtype or entry.dtype, device=self.device)
        if out.dim() == 0 or out.numel() == 0:
            with safe_open(os.path.join(self.path, entry.file), framework="pt") as f:
                out.copy_(f.get_tensor(entry.key))
            return out
        rows = self.rows(name)
        row_bytes = max(1, math.prod(entry.shape[1:]) * torch.empty((), dtype=entry.dtype).element_size())
        step = max(1, READ_BLOCK_BYTES // row_bytes)
        for begin in range(0, entry.shape[0], step):
            end = min(begin + step, entry.shape[0])
            out[begin:end].copy_(rows(begin, end))
        return out

    # ------------------------------------------------------------------ against a model

    def _expected(self, model: nn.Module):
        """(tensor, [its names], is_param, persistent) for every distinct parameter and
        buffer of `model`, tied names together."""
        groups: dict[int, list] = {}
        for mname, module in model.named_modules(remove_duplicate=False):
            for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
                for local, t in table.items():
                    if t is None:
                        continue
                    full = f"{mname}.{local}" if mname else local
                    persistent = kind == "param" or local not in module._non_persistent_buffers_set
                    g = groups.setdefault(id(t), [t, [], kind == "param", persistent, []])
                    if full not in g[1]:
                        g[1].append(full)
                        g[4].append((module, kind, local))
        return list(groups.values())

    def _problems(self, model: nn.Module) -> list[str]:
        prefix = self.prefix
        problems = []
        for t, names, is_param, persistent, _ in self._expected(model):
            key = self._key(names, prefix) if persistent else None
            what = "parameter" if is_param else "buffer"
            if key is None:
                if is_param:
                    problems.append(
                        f"{names[0]} ({what}, shape {tuple(t.shape)}, {_dtype_name(t.dtype)}) is in none of the files "
                        f"({', '.join(self.files)})")
                elif t.is_meta:
                    problems.append(
                        f"{names[0]} (buffer) is on the meta device and in none of the files: build the model with "
                        f"python_api.loading.empty_model (parameters on meta, buffers real)")
                continue
            entry = self.entries[key]
            where = f"{key!r} in {entry.file}"
            if entry.shape != tuple(t.shape):
                problems.append(f"{where} has shape {entry.shape}, the model's {names[0]} expects {tuple(t.shape)}")
                continue
            if entry.dtype is None:
                problems.append(f"{where} has dtype {entry.dtype_name}, which torch cannot hold")
            elif entry.dtype != t.dtype:
                castable = self.allow_cast and entry.dtype.is_floating_point and t.dtype.is_floating_point
                if not castable:
                    hint = "" if self.allow_cast else " (pass dtype= to load_elastic to cast floating weights on load)"
                    problems.append(
                        f"{where} has dtype {_dtype_name(entry.dtype)}, the model's {names[0]} expects "
                        f"{_dtype_name(t.dtype)}{hint}")
        return problems

    def check(self, model: nn.Module, group=None) -> None:
        """Before anything is read: every parameter of `model` (and every persistent buffer the
        files hold) is in the files with the model's shape and dtype ([Note: loading from
        files]); a LoadError naming the tensor, the file, expected and found otherwise. With a
        process group, a collective: every rank raises if any rank's check failed."""
        self.prefix = getattr(model, "base_model_prefix", None) or None
        problems = self._problems(model)
        error = None
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            error = f"the files of {self.path} do not fit the model: " + "; ".join(problems[:5]) + more
        agree(error, group)

    def materialize(self, model: nn.Module, skip_modules=()) -> None:
        """Read every parameter of `model` except the weights of the modules named in
        `skip_modules` (those become elastic: read by rows) onto `self.device`, and every
        persistent buffer the files hold; move every other buffer to `self.device`. Tied
        parameters get one tensor for all their names. Call `check` first."""
        prefix = getattr(model, "base_model_prefix", None) or None
        skip = {f"{m}.weight" for m in skip_modules}
        for t, names, is_param, persistent, owners in self._expected(model):
            if is_param and skip.intersection(names):
                continue
            key = self._key(names, prefix) if persistent else None
            if key is not None:
                value = self.tensor(key, dtype=t.dtype)
            elif not is_param:
                value = t.to(self.device)  # a buffer the files do not hold (non-persistent): as built
            else:
                raise LoadError(f"{names[0]} is in none of the files of {self.path} (call check() first)")
            if is_param:
                value = nn.Parameter(value, requires_grad=False)
            for module, kind, local in owners:
                (module._parameters if kind == "param" else module._buffers)[local] = value
        if hasattr(model, "tie_weights") and hasattr(model, "config"):
            model.tie_weights()  # Hugging Face: re-tie what its config says is tied


def agree(error: str | None, group=None) -> None:
    """Raise LoadError(error) on every rank of `group` if any rank has an error (one collective
    when torch.distributed is initialised with more than one rank; local otherwise)."""
    if dist.is_available() and dist.is_initialized():
        group = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        if world > 1:
            every = [None] * world
            dist.all_gather_object(every, error, group=group)
            bad = [(r, e) for r, e in enumerate(every) if e]
            if not bad:
                return
            if len({e for _, e in bad}) == 1:
                ranks = "" if len(bad) == world else f" (on rank(s) {[r for r, _ in bad]})"
                raise LoadError(bad[0][1] + ranks)
            raise LoadError("; ".join(f"rank {r}: {e}" for r, e in bad))
    if error:
        raise LoadError(error)


# ---------------------------------------------------------------------- building on meta


@contextmanager
def params_on_meta():
    """Inside, every parameter a module registers is moved to the meta device as it is
    registered; buffers stay where they are built (accelerate's
    `init_empty_weights(include_buffers=False)`). A parameter's own initialisation (which runs
    after it is registered, in `reset_parameters`) then costs nothing; the tensor a constructor
    allocates before registering is freed at once, untouched."""
    real_register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        real_register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and not p.is_meta:
            meta = type(p)(p.to("meta"), requires_grad=p.requires_grad)
            meta.__dict__.update(p.__dict__)
            module._parameters[name] = meta

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = real_register


def config_dtype(config) -> torch.dtype | None:
    """The dtype a Hugging Face config names (`dtype`, formerly `torch_dtype`), or None."""
    # transformers 5 names it `dtype` (reading `torch_dtype` there only warns that it is deprecated).
    d = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def empty_model(config_or_dir, dtype: torch.dtype | None = None, model_class=None) -> nn.Module:
    """The model of a Hugging Face config (or model directory) with its parameters on the meta
    device and its buffers real, in eval mode (as `from_pretrained` returns it). `dtype`:
    default the config's dtype, else float32. `model_class`: default `AutoModelForCausalLM`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = config_or_dir
    if isinstance(config_or_dir, (str, os.PathLike)):
        config = AutoConfig.from_pretrained(os.fspath(config_or_dir), local_files_only=True)
    dtype = dtype or config_dtype(config) or torch.float32
    with params_on_meta():
        if model_class is None:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = model_class._from_config(config, dtype=dtype) if hasattr(model_class, "_from_config") \
                else model_class(config)
    return model.eval()


def load_elastic(path: str | os.PathLike, lora, policy, group=None, device: torch.device | str | None = None,
                 unit_modules=None, dtype: torch.dtype | None = None, model_class=None) -> nn.Module:
    """The Hugging Face model in directory `path` under an elastic runtime with LoRA adapters,
    read from its safetensors files without any rank holding it whole ([Note: loading from
    files]): `convert_to_elastic(empty_model(path, dtype), lora, policy, group, unit_modules,
    source=SafetensorsSource(path, device))`. `dtype`: default the config's dtype (else the
    files' dtype, else float32), and then the files must hold it; given, floating weights of
    another dtype are cast on load. A collective: call it on every rank of `group`. The model
    comes back in eval mode (as `from_pretrained` returns it): call `.train()` to train with
    dropout."""
    from transformers import AutoConfig

    from python_api.lora import convert_to_elastic

    error, model, source = None, None, None
    try:
        source = SafetensorsSource(path, device=device, allow_cast=dtype is not None)
        try:
            config = AutoConfig.from_pretrained(source.path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - no or bad config.json: a bad model directory
            raise LoadError(f"{source.path}: cannot read the model's config: {type(exc).__name__}: {exc}") from exc
        if dtype is None:
            dtype = config_dtype(config) or next(
                (e.dtype for e in source.entries.values() if e.dtype is not None and e.dtype.is_floating_point), torch.float32)
        model = empty_model(config, dtype, model_class)
    except LoadError as exc:
        error = str(exc)
    agree(error, group)
    return convert_to_elastic(model, lora, policy, group=group, unit_modules=unit_modules, source=source)
