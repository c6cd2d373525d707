"""Supervised fine-tuning data: chat and prompt-completion records, their loss masks, and the
rows they are packed (or padded) into.

Formats (`--data FILE.jsonl`, one JSON object per line, blank lines skipped, one format per file):
  {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
      a conversation, rendered with the tokenizer's chat template
  {"prompt": str, "completion": str}
      TRL's prompt-completion format: the text is prompt + completion + eos
  {"text": str}
      plain text: the token stream of data.py (loss on every token), as before

[Note: which tokens are trained]
By default the loss is on what the model is asked to produce, as TRL's
`assistant_only_loss` / `completion_only_loss` and torchtune's masking do: the assistant
turns of a conversation and the completion of a prompt-completion record; `--loss-on all`
trains on every token. The spans are found the way TRL finds a completion: the token ids of
the conversation rendered up to the start of an assistant turn (the template's generation
prompt included) are compared with those of the whole conversation, and the turn starts where
they diverge; it ends where the rendering through that turn ends (its end-of-turn token and
the template's separator after it included, as TRL's prompt-completion masking includes
them). A prompt-completion record is tokenized as TRL does: ids(prompt) against
ids(prompt + completion + eos), special tokens added by the tokenizer. tests/finetune/
test_sft.py checks the masks against TRL's own tokenization of the same records and against
a hand-built span.

[Note: records are packed, attention stays in each record]
Records are packed in file order into rows of --seq-len tokens (a record never split; one
that does not fit starts the next row), each record's position ids restarting at 0, so
transformers' masking (masking_utils.find_packed_sequence_indices: a position id that does
not follow its predecessor starts a new sequence) confines attention to the record; the
first token of every record gets no label (it would be predicted from the record before it).
A row's tail that no record fills is padding (eos ids, no label) whose position ids go on
from the last record's, so a row of one record is one sequence and keeps the plain causal
mask. Measured on the real model (bench/bench_sft_packing.py, bench/results/
2026-12-03_realmodel.md): on the default instruction set at --seq-len 256 packed rows hold
0.78 real tokens per slot against 0.36 padded, a packed step costs 1.33x a padded one (the
block-causal mask instead of the causal kernel), so packing trains 1.61x the real tokens per
second; at --seq-len 128 (records of 59-165 tokens) no two records fit a row and both
layouts are the same rows. So packing is the default; `--pad-records` puts one record per row
(no position ids: the plain causal mask). A record longer than --seq-len keeps its first --seq-len tokens and is counted
(the header, results.md and summary.json say how many); one left with no trained token is
dropped, and counted too. Never silently.

[Note: the held-out records]
The last records of the file are held out (an eighth, at least 1 and at most 8; the default
instruction set holds out fixed topics): they are never trained on, their rows are the probe
batch (held-out loss before the first step and after the last) and their prompts the
generation samples. The rows of a step are drawn like the text windows ([Note: batches
depend only on (seed, step)]): global sample i of step s is row perm_e[i mod n] of the
permutation of epoch e = i div n, seeded by (seed, e): every row once per epoch, and the same
rows whatever the split into ranks and micro-batches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from .data import DataError, _step_seed

ROLES = ("system", "user", "assistant")
FORMATS = {"messages": "chat (messages)", "prompt": "prompt-completion", "text": "text"}
HELDOUT_MAX = 8
IGNORE = -100


@dataclass
class Record:
    line: int  # 1-based line of the file (or index + 1 of an embedded list)
    messages: list | None = None  # chat
    prompt: str | None = None  # prompt-completion
    completion: str | None = None


def record_format(obj, where: str) -> str:
    """'messages', 'prompt' or 'text': the format of one JSON line."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with \"messages\", \"prompt\"/\"completion\" or \"text\"")
    keys = [k for k in ("messages", "prompt", "text") if k in obj]
    if "completion" in obj and "prompt" not in obj:
        raise DataError(f"{where}: a \"completion\" without a \"prompt\"")
    if len(keys) != 1:
        raise DataError(f"{where}: expected exactly one of \"messages\", \"prompt\" (with \"completion\") or \"text\", "
                        f"got {sorted(obj) or 'an empty object'}")
    return keys[0]


def check_record(obj, fmt: str, where: str) -> Record | str:
    """The record of a JSON line of format `fmt` (a str for text), its fields checked."""
    if fmt == "text":
        if not isinstance(obj["text"], str):
            raise DataError(f"{where}: \"text\" must be a string, got {type(obj['text']).__name__}")
        return obj["text"]
    line = int(where.rsplit("line ", 1)[-1]) if "line " in where else 0
    if fmt == "prompt":
        p, c = obj.get("prompt"), obj.get("completion")
        if "completion" not in obj:
            raise DataError(f"{where}: a \"prompt\" without a \"completion\"")
        if not isinstance(p, str) or not isinstance(c, str):
            raise DataError(f"{where}: \"prompt\" and \"completion\" must be strings (use \"messages\" for "
                            f"conversations), got {type(p).__name__} and {type(c).__name__}")
        if not c.strip():
            raise DataError(f"{where}: the completion is empty: the record has no token to train on")
        return Record(line, prompt=p, completion=c)
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects "
                        f"(an empty record)")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {i + 1} must be an object with \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i + 1} has the unknown role {m['role']!r} (expected one of "
                            f"{', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: message {i + 1}'s content must be a string, got {type(m['content']).__name__}")
    if not any(m["content"].strip() for m in msgs):
        raise DataError(f"{where}: every message is empty (an empty record)")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
        raise DataError(f"{where}: no assistant message with content: the record has no token to train on")
    return Record(line, messages=[{"role": m["role"], "content": m["content"]} for m in msgs])


def read_jsonl(path: str, content: str) -> tuple[str, list]:
    """(format, items) of a .jsonl file: format 'text' (items: str) or 'messages' / 'prompt'
    (items: Record); a file mixing formats is refused naming the first line that differs."""
    fmt, first, items = None, None, []
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"data file {path}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
        f = record_format(obj, where)
        if fmt is None:
            fmt, first = f, lineno
        elif f != fmt:
            raise DataError(f"{where}: a {FORMATS[f]} record in a file of {FORMATS[fmt]} records (line {first}): "
                            "one format per file")
        items.append(check_record(obj, f, where))
    if fmt is None:
        raise DataError(f"data file {path} has no documents (every line is blank)")
    return fmt, items


# ---------------------------------------------------------------- the default instruction set

# The held-out topics of the default instruction set (their prompts are the generation samples).
HELDOUT_TOPICS = ("with", "lambda", "for", "assert")
ANSWER_CHARS = 240  # the topic's text is cut at the last sentence end before this many characters


def embedded_instructions() -> tuple[list[Record], list[Record]]:
    """The default SFT data of a model with a chat template: from the Python language reference
    topics that ship with CPython (pydoc_data.topics), one conversation per topic: "Explain the
    Python `<topic>` statement or feature in a few sentences." -> the topic's text, whitespace
    folded, cut at the last sentence end before ANSWER_CHARS characters. (train, held-out):
    HELDOUT_TOPICS are held out."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:
        raise DataError("the default instruction set is made from pydoc_data.topics, which this Python lacks; pass "
                        "--data FILE.jsonl") from exc
    train, held = [], []
    for i, key in enumerate(sorted(topics)):
        text = " ".join(topics[key].split())
        # the first line of a topic repeats its title ("The "with" statement *************")
        text = text.split("*" * 5)[-1].strip(" *")
        cut = text[:ANSWER_CHARS]
        end = cut.rfind(". ")
        answer = cut[: end + 1] if end > 40 else cut.rsplit(" ", 1)[0] + " ..."
        rec = Record(i + 1, messages=[
            {"role": "user", "content": f"Explain the Python `{key}` statement or feature in a few sentences."},
            {"role": "assistant", "content": answer}])
        (held if key in HELDOUT_TOPICS else train).append(rec)
    return train, held


# ---------------------------------------------------------------- tokenization and masks

def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def has_chat_template(tokenizer) -> bool:
    return getattr(getattr(tokenizer, "tok", None), "chat_template", None) is not None


def tokenize_record(rec: Record, tokenizer, loss_on: str = "assistant") -> tuple[list[int], list[int]]:
    """(token ids, trained mask: 1 where the loss is taken) of one record ([Note: which tokens are
    trained])."""
    where = f"line {rec.line}"
    if rec.messages is not None:
        tok = getattr(tokenizer, "tok", None)
        if not has_chat_template(tokenizer):
            raise DataError(f"{where}: a chat record, but the tokenizer ({tokenizer.name}) has no chat template; "
                            "use {\"prompt\", \"completion\"} records or a tokenizer with a chat template")

        def ids(msgs, gen):
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            return tok(text, add_special_tokens=False)["input_ids"]

        try:
            full = ids(rec.messages, False)
            mask = [0] * len(full)
            for i, m in enumerate(rec.messages):
                if m["role"] != "assistant":
                    continue
                start = _common_prefix(ids(rec.messages[:i], True), full) if i else 0
                end = _common_prefix(ids(rec.messages[: i + 1], False), full)
                mask[start:end] = [1] * (end - start)
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - the template's own error (a role it refuses, ...)
            raise DataError(f"{where}: the chat template cannot render this record: {type(exc).__name__}: "
                            f"{exc}") from exc
    else:
        if getattr(tokenizer, "tok", None) is not None:
            tok = tokenizer.tok
            completion = rec.completion
            if tok.eos_token and not completion.endswith(tok.eos_token):
                completion = completion + tok.eos_token  # as TRL's add_eos
            p = tok(rec.prompt)["input_ids"]
            full = tok(rec.prompt + completion)["input_ids"]
        else:  # the byte-level tokenizer: bytes, then its end-of-document id
            p = tokenizer.encode(rec.prompt)
            full = p + tokenizer.encode(rec.completion) + ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
        k = _common_prefix(p, full)
        mask = [0] * k + [1] * (len(full) - k)
    if loss_on == "all":
        mask = [1] * len(full)
    if not any(mask):
        raise DataError(f"{where}: no token to train on after tokenization (the assistant/completion span is empty)")
    return full, mask


@dataclass
class Rows:
    input_ids: torch.Tensor  # int64 [n, seq_len]
    labels: torch.Tensor  # int64 [n, seq_len], IGNORE where no loss
    position_ids: torch.Tensor | None  # int64 [n, seq_len] (packed), None (padded)
    real_tokens: int  # tokens of records (not padding)


def build_rows(encoded: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int, packed: bool) -> tuple[Rows, dict]:
    """Rows of `seq_len` from (ids, mask) records ([Note: records are packed, attention stays in
    each record]); counts: truncated and dropped records."""
    truncated = dropped = 0
    segs = []
    for ids, mask in encoded:
        if len(ids) > seq_len:
            truncated += 1
            ids, mask = ids[:seq_len], mask[:seq_len]
        labels = [t if m else IGNORE for t, m in zip(ids, mask)]
        labels[0] = IGNORE  # predicted from nothing of its own record
        if all(x == IGNORE for x in labels):
            dropped += 1
            continue
        segs.append((ids, labels))
    rows: list[list[tuple[list[int], list[int]]]] = []
    for seg in segs:
        if packed and rows and sum(len(s[0]) for s in rows[-1]) + len(seg[0]) <= seq_len:
            rows[-1].append(seg)
        else:
            rows.append([seg])
    n = len(rows)
    ids_t = torch.full((n, seq_len), pad_id, dtype=torch.int64)
    lab_t = torch.full((n, seq_len), IGNORE, dtype=torch.int64)
    pos_t = torch.zeros((n, seq_len), dtype=torch.int64) if packed else None
    real = 0
    for r, row in enumerate(rows):
        at = 0
        for ids, labels in row:
            L = len(ids)
            ids_t[r, at:at + L] = torch.tensor(ids)
            lab_t[r, at:at + L] = torch.tensor(labels)
            if pos_t is not None:
                pos_t[r, at:at + L] = torch.arange(L)
            at += L
        real += at
        if pos_t is not None and at < seq_len:  # the tail: padding that continues the last record's positions
            last = int(pos_t[r, at - 1]) if at else -1
            pos_t[r, at:] = torch.arange(last + 1, last + 1 + seq_len - at)
    return Rows(ids_t, lab_t, pos_t, real), {"records": len(encoded), "truncated": truncated, "dropped": dropped,
                                             "rows": n}


class RecordRows:
    """The SFT counterpart of data.TokenWindows: training rows drawn per (seed, step) by epoch
    permutations, and the held-out rows as the probe batch ([Note: the held-out records])."""

    def __init__(self, train: Rows, probe: Rows, seq_len: int, source: str):
        if train.input_ids.shape[0] == 0:
            raise DataError(f"{source}: no training record is left (all truncated to nothing or held out)")
        if probe.input_ids.shape[0] == 0:
            raise DataError(f"{source}: no held-out record is left after truncation")
        self.rows, self.probe_rows, self.seq_len = train, probe, seq_len
        self.n_train = train.input_ids.shape[0]
        self.probe = probe.input_ids
        self._perms: dict[int, torch.Tensor] = {}

    def _indices(self, seed: int, step: int, count: int) -> torch.Tensor:
        out = torch.empty(count, dtype=torch.int64)
        for j in range(count):
            i = step * count + j
            epoch, at = divmod(i, self.n_train)
            perm = self._perms.get(epoch)
            if perm is None:
                gen = torch.Generator().manual_seed(_step_seed(seed, epoch))
                perm = self._perms[epoch] = torch.randperm(self.n_train, generator=gen)
                if len(self._perms) > 4:
                    self._perms.pop(min(self._perms))
            out[j] = perm[at]
        return out

    def _take(self, rows: Rows, idx: torch.Tensor) -> dict:
        d = {"input_ids": rows.input_ids[idx], "labels": rows.labels[idx]}
        if rows.position_ids is not None:
            d["position_ids"] = rows.position_ids[idx]
        return d

    def inputs(self, seed: int, step: int, world_size: int, rank: int, micro_batch: int, grad_accum: int) -> dict:
        """This rank's rows of step `step`: name -> int64 [grad_accum, micro_batch, seq_len]."""
        idx = self._indices(seed, step, world_size * micro_batch * grad_accum)
        mine = torch.cat([idx[(a * world_size + rank) * micro_batch:(a * world_size + rank + 1) * micro_batch]
                          for a in range(grad_accum)])
        return {k: v.view(grad_accum, micro_batch, -1) for k, v in self._take(self.rows, mine).items()}

    def batch(self, seed: int, step: int, world_size: int, rank: int, micro_batch: int, grad_accum: int) -> torch.Tensor:
        """The input ids of inputs() (what profiling needs)."""
        return self.inputs(seed, step, world_size, rank, micro_batch, grad_accum)["input_ids"]

    def probe_inputs(self) -> dict:
        return self._take(self.probe_rows, torch.arange(self.probe_rows.input_ids.shape[0]))


def sft_rows(train: list[Record], held: list[Record], tokenizer, data, seq_len: int,
             source: str) -> tuple[RecordRows, dict]:
    """The rows and the data's description (summary.json's "data") of SFT records (`data`: the
    data options, DataConfig: --loss-on, --pad-records)."""
    loss_on, packed = data.loss_on, not data.pad_records
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    enc_train = [tokenize_record(r, tokenizer, loss_on) for r in train]
    enc_held = [tokenize_record(r, tokenizer, loss_on) for r in held]
    rows, c1 = build_rows(enc_train, seq_len, pad, packed)
    probe, c2 = build_rows(enc_held, seq_len, pad, packed)
    windows = RecordRows(rows, probe, seq_len, source)
    import hashlib

    h = hashlib.sha256()
    for t in (rows.input_ids, rows.labels, probe.input_ids, probe.labels):
        h.update(t.numpy().tobytes())
    info = {
        "format": "chat" if (train + held)[0].messages is not None else "prompt-completion",
        "records": len(train), "heldout_records": len(held),
        "loss_on": loss_on, "layout": "packed" if packed else "padded",
        "rows": c1["rows"], "heldout_rows": c2["rows"],
        "truncated_records": c1["truncated"] + c2["truncated"],
        "dropped_records": c1["dropped"] + c2["dropped"],
        "tokens": int(rows.real_tokens), "row_fill": rows.real_tokens / max(1, rows.input_ids.numel()),
        "trained_tokens": int((rows.labels != IGNORE).sum()),
        "sha256": h.hexdigest(),
        "samples": [_sample_prompt(r) for r in held[:2]],
    }
    return windows, info


def _sample_prompt(rec: Record):
    """What a generation sample is asked: the conversation up to its last assistant turn, or the prompt."""
    if rec.messages is not None:
        last = max(i for i, m in enumerate(rec.messages) if m["role"] == "assistant")
        return {"messages": rec.messages[:last]}
    return {"prompt": rec.prompt}


def split_heldout(records: list[Record]) -> tuple[list[Record], list[Record]]:
    """The last records held out: an eighth, at least 1, at most HELDOUT_MAX ([Note: the held-out records])."""
    if len(records) < 2:
        raise DataError(f"{len(records)} record(s): at least 2 are needed (one to train on, one held out)")
    k = max(1, min(HELDOUT_MAX, len(records) // 8))
    return records[:-k], records[-k:]
