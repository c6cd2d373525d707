"""Text data for the fine-tuning CLI: corpora, tokenizers, and the per-step batches.

Corpora
- embedded: the Python language reference topics that ship with CPython
  (`pydoc_data.topics.topics`, ~0.47 M characters of English text and code examples); no file
  and no network needed.
- a local `.txt` file (one document: the whole file) or `.jsonl` file (one JSON object per
  line with a string field "text"; blank lines are skipped). Files are read as UTF-8.

Tokenizers
- `ByteTokenizer`: UTF-8 bytes are ids 0..255; with `eos=True` id 256 separates documents
  (vocabulary 257). Without it documents are joined by a blank line.
- a local Hugging Face tokenizer (`transformers.AutoTokenizer`, `local_files_only=True`).

[Note: batches depend only on (seed, step)]
The tokens are one stream: documents joined by the separator. Its tail holds `probe_seqs`
held-out windows of `seq_len` tokens (the probe batch: held-out loss, logits check); training
windows start anywhere in the rest. Optimizer step s uses world_size x micro_batch x
grad_accum windows whose starts are drawn by a generator seeded with (seed, s) alone; micro-step
a of rank r takes windows [(a*W + r)*M, (a*W + r + 1)*M). So a step's data is independent of
any RNG state (a resumed run sees the very batches an uninterrupted one saw) and the global
batch of a step depends only on the global batch size, not on how it is split into ranks,
micro-batches and accumulation steps. `--seed` changes every step's batch (`_step_seed`).
"""

from __future__ import annotations

import hashlib
import os

import torch


class DataError(ValueError):
    """Bad data input: raised before any training step, with the file and line named."""


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus an end-of-document id 256 when `eos`."""

    name = "byte-level"

    def __init__(self, eos: bool = True):
        self.eos_id = 256 if eos else None
        self.vocab_size = 257 if eos else 256
        self.fingerprint = f"byte-level, vocabulary {self.vocab_size}"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer behind the same two-method face."""

    def __init__(self, tok, path: str):
        self.tok = tok
        self.name = f"{type(tok).__name__} from {path}"
        self.eos_id = tok.eos_token_id
        self.vocab_size = len(tok)
        self.fingerprint = f"{type(tok).__name__}, vocabulary {len(tok)}, eos {tok.eos_token_id}"

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.tok.decode(ids)


def embedded_documents() -> list[str]:
    """The language reference topics of the running CPython, in a fixed (sorted) order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions strip pydoc_data
        raise DataError(
            "the embedded corpus (pydoc_data.topics of the Python standard library) is not installed "
            "with this Python; pass --data FILE (.txt or .jsonl)"
        ) from exc
    return [topics[k] for k in sorted(topics)]


def read_data_file(path: str) -> tuple[str, str]:
    """(extension, UTF-8 content) of a data file, its existence, type and encoding checked."""
    if not os.path.exists(path):
        raise DataError(f"data file {path} does not exist")
    if not os.path.isfile(path):
        raise DataError(f"data file {path} is not a regular file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".txt", ".jsonl"):
        raise DataError(f"data file {path}: unknown type {ext or '(no extension)'!r}; expected .txt (raw text) or "
                        ".jsonl (per line {\"messages\": [...]}, {\"prompt\", \"completion\"} or {\"text\"})")
    try:
        with open(path, encoding="utf-8") as f:
            content = f.read()
    except UnicodeDecodeError as exc:
        raise DataError(f"data file {path} is not valid UTF-8 (byte {exc.start}): {exc.reason}") from exc
    except OSError as exc:
        raise DataError(f"data file {path} cannot be read: {exc.strerror or exc}") from exc
    return ext, content


def tokenize(documents: list[str], tokenizer) -> torch.Tensor:
    """One int64 stream: the documents' tokens joined by eos (or by a blank line's tokens)."""
    sep = [tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode("\n\n")
    ids: list[int] = []
    for i, doc in enumerate(documents):
        if i:
            ids.extend(sep)
        ids.extend(tokenizer.encode(doc))
    return torch.tensor(ids, dtype=torch.int64)


def token_digest(tokens: torch.Tensor) -> str:
    """sha256 of the token stream (identifies the data in a checkpoint's configuration)."""
    return hashlib.sha256(tokens.numpy().tobytes()).hexdigest()


# An odd multiplier (2**32 / the golden ratio): seeds that differ by at most 1000 map to offsets
# at least 1,954,453 apart modulo 2**32 (computed), so their runs share no batch within that
# many steps.
_SEED_MIX = 0x9E3779B1


def _step_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s generator (an epoch's in sft.py). torch's CPU generator
    (mt19937) keeps only the low 32 bits of a seed, so the pair is folded into 32 bits:
    (seed x _SEED_MIX + step) mod 2**32. The steps of one seed get distinct generators (step <
    2**32); seed 0 gives step, as before. The former (seed << 32) | step lost the seed in
    those bits: every --seed drew the batches of seed 0."""
    return (seed * _SEED_MIX + step) & 0xFFFFFFFF


class TokenWindows:
    """Training windows and the held-out probe batch over one token stream (see [Note:
    batches depend only on (seed, step)])."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, probe_seqs: int, source: str):
        if seq_len < 2:
            raise DataError(f"--seq-len must be >= 2, got {seq_len}")
        need = (probe_seqs + 1) * seq_len
        if tokens.numel() < need:
            raise DataError(
                f"{source} has {tokens.numel()} tokens; --seq-len {seq_len} needs at least {need} "
                f"({probe_seqs} held-out windows and one training window)"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.n_train = tokens.numel() - probe_seqs * seq_len
        self.probe = tokens[self.n_train :].view(probe_seqs, seq_len).clone()

    def global_starts(self, seed: int, step: int, count: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(_step_seed(seed, step))
        return torch.randint(0, self.n_train - self.seq_len + 1, (count,), generator=gen)

    def inputs(self, seed: int, step: int, world_size: int, rank: int, micro_batch: int, grad_accum: int) -> dict:
        """The model's inputs of step `step` (as sft.RecordRows.inputs): every token is a label."""
        b = self.batch(seed, step, world_size, rank, micro_batch, grad_accum)
        return {"input_ids": b, "labels": b}

    def probe_inputs(self) -> dict:
        return {"input_ids": self.probe, "labels": self.probe}

    def batch(self, seed: int, step: int, world_size: int, rank: int, micro_batch: int, grad_accum: int) -> torch.Tensor:
        """This rank's windows of step `step`: int64 [grad_accum, micro_batch, seq_len]."""
        starts = self.global_starts(seed, step, world_size * micro_batch * grad_accum)
        offsets = torch.arange(self.seq_len)
        out = torch.empty(grad_accum, micro_batch, self.seq_len, dtype=torch.int64)
        for a in range(grad_accum):
            first = (a * world_size + rank) * micro_batch
            out[a] = self.tokens[starts[first : first + micro_batch, None] + offsets]
        return out
