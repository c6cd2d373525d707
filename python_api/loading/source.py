"""The safetensors files of a Hugging Face model directory, read by rows from memory maps
(`SafetensorsSource`), and `LoadError`. Loading a model with it: model.py.

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

import torch
import torch.nn as nn

from python_api.distributed.agree import agree

# The most bytes one read of a replicated tensor touches in a file's map (see `tensor`).
READ_BLOCK_BYTES = 64 << 20
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files that can sit beside the weights in a model directory but are not the model: the adapter
# written by save_pretrained / save_adapter (python_api/nn/adapters.py, ADAPTER_WEIGHTS).
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
        agree(error, group, error_type=LoadError)

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
