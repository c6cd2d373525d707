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
import re
import stat
import warnings

import torch
import torch.nn as nn

from ..distributed.agree import agree
from ..nn.lora import is_conv1d
from .bnb import (
    AUX,
    BnbNF4Weight,
    PackedFormatError,
    check_packed,
    packed_bases,
    parse_quant_state,
    quant_state_key,
    read_slices,
)

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


class LoadWarning(UserWarning):
    """The files load, but not as they say: tensors the model does not use (a config with
    fewer layers than the files), or tied weights whose files differ (loaded untied)."""


def check_regular_file(path: str, what: str) -> None:
    """A LoadError unless `path` is a regular file this process can read, saying which of
    those it is not (missing, a dangling symbolic link, a directory, a FIFO, unreadable).
    A FIFO is refused without being opened: opening one for reading blocks until a writer
    comes, which would hang this rank and leave its peers waiting in their next collective."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise LoadError(f"{what} {path} is a symbolic link to {os.readlink(path)!r}, which does not exist") from None
        raise LoadError(f"{what} {path} does not exist") from None
    except OSError as exc:  # EACCES on a folder above it, ELOOP, ...
        raise LoadError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or
                stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise LoadError(f"{what} {path} is {kind}, not a regular file")
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as exc:
        raise LoadError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def list_directory(path: str, what: str = "model directory") -> list[str]:
    """The names in directory `path`; a LoadError naming the reason when it cannot be listed
    (a folder without read or search permission reads as empty to `os.path.isfile`, which
    would report a missing config.json instead)."""
    try:
        return os.listdir(path)
    except OSError as exc:
        raise LoadError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


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
        # Weights the files hold packed by bitsandbytes ({key: quant type}), read only once
        # `read_packed` is given the checkpoint's format ([Note: loading a bitsandbytes 4-bit
        # checkpoint] in python_api/loading/bnb.py); their parsed records, by key.
        self.packed = packed_bases(self.entries)
        self.packed_format = None
        self._records: dict[str, dict] = {}
        self._shapes: dict[str, tuple[int, int]] = {}

    def __repr__(self) -> str:
        return f"SafetensorsSource({self.path!r}, {len(self.entries)} tensors in {len(self.files)} file(s), device={self.device})"

    # ------------------------------------------------------------------ index

    def _index(self) -> tuple[list[str], dict[str, _Entry]]:
        from safetensors import safe_open

        if not os.path.isdir(self.path):
            raise LoadError(f"{self.path} is not a directory (a Hugging Face model directory holds config.json and *.safetensors)")
        listing = list_directory(self.path)
        index_path = os.path.join(self.path, INDEX_FILE)
        weight_map = None
        # from_pretrained's order: one model.safetensors, else the index of shards, else any.
        # A name in the listing that is no readable regular file (a dangling link, a FIFO, no
        # permission) is named as such by check_regular_file, never skipped.
        if SINGLE_FILE in listing:
            files = [SINGLE_FILE]
        elif INDEX_FILE in listing:
            check_regular_file(index_path, "the index")
            try:
                with open(index_path) as f:
                    weight_map = json.load(f).get("weight_map")
            except OSError as exc:
                raise LoadError(f"cannot read the index {index_path}: {exc.strerror or exc}") from exc
            except (ValueError, AttributeError) as exc:
                raise LoadError(f"{index_path} is not a valid index: {exc}") from exc
            if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise LoadError(f"{index_path} has no 'weight_map' object {{tensor name: file}}")
            files = sorted(set(weight_map.values()))
            for name in files:
                if os.path.basename(name) != name or name not in listing:
                    raise LoadError(f"{index_path} lists {name!r}, which is not a file in {self.path}")
        else:
            files = sorted(f for f in listing if f.endswith(".safetensors") and f not in _NOT_THE_MODEL)
            if not files:
                raise LoadError(f"{self.path} has no *.safetensors weights")
        entries: dict[str, _Entry] = {}
        for name in files:
            full = os.path.join(self.path, name)
            # safetensors reports an unreadable file as "No such file or directory": ask first.
            check_regular_file(full, "the weights file")
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

    def read_packed(self, fmt) -> None:
        """Read the files' bitsandbytes-packed weights in format `fmt` (a `Bnb4bitFormat`, from
        `elastic_kernels.api.loading.bnb.packed_format`, which checked it against the policy)."""
        self.packed_format = fmt

    def _record(self, key: str) -> dict:
        """The parsed quant_state record of packed weight `key` (read once; a few hundred bytes)."""
        if key not in self._records:
            try:
                self._records[key] = parse_quant_state(self._small(quant_state_key(key)), key)
            except PackedFormatError as exc:
                raise LoadError(str(exc)) from exc
        return self._records[key]

    def _small(self, key: str) -> torch.Tensor:
        """A tiny tensor of the files whole (a packed weight's record or codebook)."""
        from safetensors import safe_open

        entry = self.entries[key]
        with safe_open(os.path.join(self.path, entry.file), framework="pt") as f:
            return f.get_tensor(key).clone()

    def _packed(self, key: str) -> BnbNF4Weight:
        """The reader of packed weight `key` (checked by `check`)."""
        if self.packed_format is None or key not in self._shapes:
            raise LoadError(f"{key!r} is packed by bitsandbytes and was not checked (call check() first, with the "
                            "source told the checkpoint's format by read_packed)")
        itemsize = torch.empty((), dtype=self.entries[key].dtype).element_size()
        return BnbNF4Weight(key, self._record(key), self._shapes[key],
                            read_slices(self.path, lambda k: self.entries[k].file), itemsize)

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

    def is_packed(self, name: str, prefix: str | None = None) -> bool:
        """Whether the model's tensor `name` is held packed by bitsandbytes in the files (False
        for a name the files do not hold). `prefix`: the model's `base_model_prefix` (before
        `check` learnt it)."""
        key = self.resolve(name, self.prefix or prefix)
        return key is not None and key in self.packed

    def rows(self, name: str, transpose: bool = False):
        """A reader `rows(begin, end)` of rows [begin, end) of the model's tensor `name` (its first
        dimension), reading only those rows from the file. With `transpose` (a Conv1D weight
        stored [in, out]), rows of the transposed [out, in] tensor, i.e. columns of the stored
        one. The result is a view of a memory map: copy what you keep
        ([Note: memory-mapped reads and the resident set])."""
        from safetensors import safe_open

        entry = self._entry(name)
        if entry.key in self.packed:
            # Packed by bitsandbytes as the Linear4bit that replaced the module: [out, in]
            # already, a Conv1D's included, so its rows are the elastic weight's.
            return self._packed(entry.key)
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
        if entry.key in self.packed:
            # A packed weight [out, in] dequantized whole (a replicated linear's: small).
            packed = self._packed(entry.key)
            return packed.dequantized(0, packed.rows_, dtype or packed.dtype).to(self.device)
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

    def _present_keys(self, names: list[str]) -> list[str]:
        """The distinct keys under which the files hold a tensor's (tied) names, in name order."""
        keys = []
        for n in names:
            k = self.resolve(n, self.prefix)
            if k is not None and k not in keys:
                keys.append(k)
        return keys

    def _packed_problems(self, key: str, t: torch.Tensor, owners) -> list[str]:
        """The problems of packed weight `key` against the model's parameter `t` (the source
        reads packed weights: `read_packed` was called)."""
        if self.packed[key] != "nf4":
            return [f"{key!r} is packed as bitsandbytes {self.packed[key]!r}; only nf4 is read"]
        if t.dim() != 2:
            return [f"{key!r} is packed by bitsandbytes, the model's tensor has shape {tuple(t.shape)} (not a weight)"]
        conv = any(kind == "param" and is_conv1d(module) for module, kind, _ in owners)
        shape = (int(t.shape[1]), int(t.shape[0])) if conv else (int(t.shape[0]), int(t.shape[1]))
        problems = check_packed(key, self._record(key), self.entries, self._small, self.packed_format, shape,
                                t.dtype, self.allow_cast)
        if not problems:
            self._shapes[key] = shape
        return problems

    def _problems(self, model: nn.Module) -> list[str]:
        problems, unread = [], []
        for t, names, is_param, persistent, owners in self._expected(model):
            keys = self._present_keys(names) if persistent else []
            what = "parameter" if is_param else "buffer"
            if not keys:
                if is_param:
                    problems.append(
                        f"{names[0]} ({what}, shape {tuple(t.shape)}, {_dtype_name(t.dtype)}) is in none of the files "
                        f"({', '.join(self.files)})")
                elif t.is_meta:
                    problems.append(
                        f"{names[0]} (buffer) is on the meta device and in none of the files: build the model with "
                        f"elastic_kernels.api.loading.empty_model (parameters on meta, buffers real)")
                continue
            # Tied names held under several keys: each must fit (untie_differing may load it).
            for key in keys:
                if key in self.packed and is_param:
                    if self.packed_format is None:
                        unread.append(key)
                    else:
                        problems.extend(self._packed_problems(key, t, owners))
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
        if unread:
            kinds = ", ".join(sorted({repr(self.packed[k]) for k in unread}))
            problems.insert(0, f"{len(unread)} weight(s) are stored packed by bitsandbytes ({kinds} 4-bit), e.g. "
                               f"{unread[0]!r}, and this source reads full-precision tensors: load the checkpoint with "
                               f"elastic_kernels.api.load_elastic and ElasticPolicy(weight_format='nf4', "
                               f"quant_nested=<its bnb_4bit_use_double_quant>)")
        if self.packed_format is not None and not self.packed:
            problems.append(f"the config says the checkpoint is saved quantized ({self.packed_format.describe()}), "
                            f"but no tensor of its files is packed (no *.quant_state.bitsandbytes__nf4 record)")
        return problems

    def unused_keys(self, model: nn.Module) -> list[str]:
        """The files' tensors that no parameter or buffer of `model` takes (what from_pretrained
        reports as unexpected keys), less those the model declares it ignores
        (`_keys_to_ignore_on_load_unexpected`). A config with fewer layers than its files, or of
        another architecture's naming, leaves them."""
        if self.prefix is None:
            self.prefix = getattr(model, "base_model_prefix", None) or None
        used = set()
        for _, names, _, _, _ in self._expected(model):
            used.update(self._present_keys(names))
        for key in [k for k in used if k in self.packed]:  # the tensors beside a packed weight
            used.update(k for k in (f"{key}{a}" for a in AUX) if k in self.entries)
            used.add(f"{key}.quant_state.bitsandbytes__{self.packed[key]}")
        ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
        return sorted(k for k in self.entries if k not in used and not any(p.search(k) for p in ignore))

    def unused_message(self, model: nn.Module) -> str | None:
        """One line naming the unused tensors (`unused_keys`), or None when every tensor is used."""
        unused = self.unused_keys(model)
        if not unused:
            return None
        layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        hint = (f"; its config has num_hidden_layers={layers}: does it describe fewer layers than the files?"
                if layers is not None else "")
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        return (f"{len(unused)} tensor(s) in the files of {self.path} are not used by the model "
                f"({type(model).__name__}) and are not loaded: {shown}{hint}")

    def check(self, model: nn.Module, group=None) -> None:
        """Before anything is read: every parameter of `model` (and every persistent buffer the
        files hold) is in the files with the model's shape and dtype ([Note: loading from
        files]); a LoadError naming the tensor, the file, expected and found otherwise. With a
        process group, a collective: every rank raises if any rank's check failed. Tensors of
        the files that the model does not take are named in a LoadWarning (from_pretrained's
        "unexpected keys"), on every rank: they are not loaded."""
        self.prefix = getattr(model, "base_model_prefix", None) or None
        problems = self._problems(model)
        error = None
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            error = f"the files of {self.path} do not fit the model: " + "; ".join(problems[:5]) + more
        agree(error, group, error_type=LoadError)
        message = self.unused_message(model)
        if message is not None:
            warnings.warn(message, LoadWarning, stacklevel=2)

    def same_values(self, key_a: str, key_b: str) -> bool:
        """Whether the files' tensors `key_a` and `key_b` hold the same shape, dtype and values,
        compared in blocks of rows (neither is held whole)."""
        a, b = self.entries[key_a], self.entries[key_b]
        if a.shape != b.shape or a.dtype != b.dtype or a.dtype is None:
            return False
        if len(a.shape) == 0 or math.prod(a.shape) == 0:
            return torch.equal(self.tensor(key_a), self.tensor(key_b))
        ra, rb = self.rows(key_a), self.rows(key_b)
        row_bytes = max(1, math.prod(a.shape[1:]) * torch.empty((), dtype=a.dtype).element_size())
        step = max(1, READ_BLOCK_BYTES // row_bytes)
        return all(torch.equal(ra(i, min(i + step, a.shape[0])), rb(i, min(i + step, a.shape[0])))
                   for i in range(0, a.shape[0], step))

    def untie_differing(self, model: nn.Module) -> list[tuple[str, str]]:
        """Tied parameters (one tensor under several names, e.g. `tie_word_embeddings`) whose
        names the files hold as *different* tensors are untied in `model`: each such name gets a
        parameter of its own (on the parameter's device, meta included), loaded from its own
        key. This is transformers' `from_pretrained` (5.x: "both are present in the checkpoints
        with different values, so we will NOT tie them"): tying would silently replace the
        files' head by the embeddings. Warns (LoadWarning) once per untied pair; returns the
        (kept name, untied name) pairs. Call after `check` (it reads the two tensors, in blocks,
        to compare them)."""
        if self.prefix is None:
            self.prefix = getattr(model, "base_model_prefix", None) or None
        untied = []
        for t, names, is_param, _, owners in self._expected(model):
            if not is_param or len(names) < 2:
                continue
            keys = [self.resolve(n, self.prefix) for n in names]
            first = next((k for k in keys if k is not None), None)
            differing = {k for k in keys if k is not None and k != first and not self.same_values(first, k)}
            if not differing:
                continue
            kept = names[keys.index(first)]
            fresh: dict[str, nn.Parameter] = {}
            for name, key, (module, _, local) in zip(names, keys, owners):
                if key not in differing:
                    continue
                if key not in fresh:
                    p = nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device=t.device), requires_grad=t.requires_grad)
                    p.__dict__.update(t.__dict__)
                    fresh[key] = p
                    untied.append((kept, name))
                    warnings.warn(
                        f"the model's config ties {name} to {kept} (tie_word_embeddings or the model's tied weights), "
                        f"but the files of {self.path} hold them as different tensors ({key!r} and {first!r}): they "
                        f"are loaded untied, each from its own tensor, as transformers' from_pretrained does; set "
                        f"tie_word_embeddings to false in config.json to silence this", LoadWarning, stacklevel=2)
                module._parameters[local] = fresh[key]
        # transformers 5 keeps the tied pairs it will re-tie in `all_tied_weights_keys`
        # (target -> source); from_pretrained drops an untied pair from it, and so does this.
        tied_keys = getattr(model, "all_tied_weights_keys", None)
        if untied and isinstance(tied_keys, dict):
            pairs = {frozenset(p) for p in untied}
            for target, source in list(tied_keys.items()):
                if frozenset((target, source)) in pairs or any(target == u for _, u in untied):
                    tied_keys.pop(target, None)
        return untied

    def materialize(self, model: nn.Module, skip_modules=()) -> None:
        """Read every parameter of `model` except the weights of the modules named in
        `skip_modules` (those become elastic: read by rows) onto `self.device`, and every
        persistent buffer the files hold; move every other buffer to `self.device`. Tied
        parameters get one tensor for all their names, unless the files hold them as different
        tensors (`untie_differing`, which runs first). Call `check` first.

        No `tie_weights()` afterwards: a tie is one tensor under several names, and every name
        of it gets the same tensor here; re-tying by the config would undo `untie_differing`."""
        self.untie_differing(model)
        prefix = self.prefix
        skip = {f"{m}.weight" for m in skip_modules}
        for t, names, is_param, persistent, owners in self._expected(model):
            if is_param and skip.intersection(names):
                continue
            key = self._key(names, prefix) if persistent else None
            if key is not None:
                value = self.tensor(key, dtype=t.dtype)
                if key in self.packed and any(is_conv1d(module) for module, kind, _ in owners if kind == "param"):
                    value = value.t().contiguous()  # packed [out, in]; a Conv1D holds [in, out]
            elif not is_param:
                value = t.to(self.device)  # a buffer the files do not hold (non-persistent): as built
            else:
                raise LoadError(f"{names[0]} is in none of the files of {self.path} (call check() first)")
            if is_param:
                value = nn.Parameter(value, requires_grad=False)
            for module, kind, local in owners:
                (module._parameters if kind == "param" else module._buffers)[local] = value
