"""Output files: atomic writes (a reader never sees half a file) with the permissions a plain
open() gives, and writes agreed across ranks (a failure on one rank stops every rank with
one message naming the path)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile

import torch
import torch.distributed as dist

from ..nn import ADAPTER_WEIGHTS, runtime_of, save_adapter
from ..nn.adapters import adapters_of, is_multi_adapter
from .agreement import agree_error
from .errors import FinetuneError, OutputError


def _file_mode() -> int:
    """The permissions a plain open() gives a new file: 0666 minus the umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _remove_quietly(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


def write_bytes_atomic(path: str, write) -> None:
    """`write(tmp)` into a temporary file next to `path`, then rename it over `path` (a reader
    never sees half a file). The mode is set on the *written* file, just before the rename:
    safetensors' save_file replaces the file it is given, so a mode set before writing would be
    lost (the file would stay mkstemp's 0600). A failed write raises OutputError naming `path`."""
    from safetensors import SafetensorError

    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path) or ".")
        os.close(fd)
        write(tmp)
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    except (OSError, SafetensorError) as exc:
        _remove_quietly(tmp)
        raise OutputError(path, exc) from exc
    except BaseException:
        _remove_quietly(tmp)
        raise


def torch_save_atomic(obj, path: str) -> None:
    # Through a file object: torch.save(obj, name) derives its archive name from the file
    # name, and the temporary ".tmp-*" names are not valid archive names.
    def write(p):
        with open(p, "wb") as f:
            torch.save(obj, f)

    write_bytes_atomic(path, write)


def agreed_write(job, fn, what: str) -> None:
    """Collective: run `fn()` on this rank (it may do nothing on some), then agree. An output
    error on any rank stops every rank with one message naming the path: alone, the failing
    rank would die with a traceback while the others wait in their next collective until the
    timeout, or die of "Connection closed by peer"."""
    err = None
    try:
        fn()
    except FinetuneError as exc:
        err = f"{what}: {exc}"
    except OSError as exc:  # makedirs, rename: the path is in the exception
        err = f"{what}: {OutputError(exc.filename or job.save_dir, exc)}"
    agree_error(err, job.world_size)


def save_adapter_agreed(job, model, folder: str, what: str) -> None:
    """lora.save_adapter into `folder`, its write failures stopping every rank with one
    message, and the permissions a plain open() gives on the weights file.

    save_adapter writes on rank 0. Where it reports rank 0's failure on every rank itself (a
    RuntimeError "save_adapter(...) failed on rank 0: ..." on each), that message is agreed
    as is. Where it ends with a barrier instead, a write failure escapes on rank 0 before that
    barrier while the others wait in it: rank 0 joins the barrier, then the error is agreed."""
    from safetensors import SafetensorError

    err = None
    try:
        # [Note: adapters that load everywhere] (nn/adapters.py): the base the job loaded (the hub id,
        # else the directory: for a known name or a .gguf, the cache's), and its tokenizer beside.
        save_adapter(model, folder, base_model_name_or_path=getattr(job.spec, "name", None))
    except (OSError, SafetensorError) as exc:
        err = f"{what}: {OutputError(folder, exc)}"
        if job.world_size > 1:
            dist.barrier(group=runtime_of(model).group)
    except RuntimeError as exc:
        if isinstance(exc, dist.DistError):
            raise  # the group itself failed: no agreement is possible over it
        err = f"{what}: {exc}"
    else:
        # save_adapter's mode is lost to safetensors (it replaces the file it was given; see
        # write_bytes_atomic): set it here.
        if job.rank == 0:
            weights = os.path.join(folder, ADAPTER_WEIGHTS)
            try:
                # a model with named adapters (a sweep) has one folder per adapter under `folder`
                for one in ([os.path.join(folder, n) for n in adapters_of(model)] if is_multi_adapter(model)
                            else [folder]):
                    weights = os.path.join(one, ADAPTER_WEIGHTS)
                    os.chmod(weights, _file_mode())
                    tok = getattr(job.spec.tokenizer, "tok", None)
                    if tok is not None:  # beside the adapter: AutoPeftModelForCausalLM users find it there
                        tok.save_pretrained(one)
            except OSError as exc:
                err = f"{what}: {OutputError(exc.filename or weights, exc)}"
    agree_error(err, job.world_size)


def write_json(path: str, obj) -> None:
    def write(p):
        with open(p, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")

    write_bytes_atomic(path, write)


def write_text_atomic(path: str, text: str) -> None:
    def write(p):
        with open(p, "w") as f:
            f.write(text)

    write_bytes_atomic(path, write)


def local_now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")
