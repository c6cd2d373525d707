"""SFT data of the CLI (python_api/finetune/sft.py): the loss masks against TRL's own
tokenization and against hand-computed spans ([Note: which tokens are trained]), packing
against each record run alone ([Note: records are packed, attention stays in each record]),
the errors naming the line, truncation counted, the (seed, step) epochs ([Note: the held-out
records]), and one 2-rank run whose losses equal FSDP2 + PEFT's on packed records."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.finetune.test_finetune import DIMS, summary_of, torchrun

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = ("the a of to and in is it for on with as by this that be are from at or an not you can which Python "
         "statement loop value list function returns iterates each item context manager opens file closes").split()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer (trained here in well under a second) with ChatML
    special tokens and chat template, eos <|im_end|>: the shape of SmolLM2's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) for i in range(200)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML
    d = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(d)
    return str(d)


def _hf(tok_dir):
    from transformers import AutoTokenizer

    from elastic_kernels.api.finetune.data import HFTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(tok_dir), tok_dir)


PC = [{"prompt": "What does the for statement do?", "completion": " It iterates each item of a list."},
      {"prompt": "Explain with", "completion": " A context manager opens and closes the file."}]
CHAT = [[{"role": "user", "content": "What is a list?"}, {"role": "assistant", "content": "A list is a value."}],
        [{"role": "system", "content": "Be short."}, {"role": "user", "content": "for?"},
         {"role": "assistant", "content": "It iterates."}]]


def test_masks_equal_trl_tokenization(tok_dir, tmp_path):
    """Prompt-completion records (TRL's completion_only_loss) and single-turn conversations (as
    TRL's conversational prompt-completion: prompt = the turns before the answer) give the token
    ids and trained mask TRL's SFTTrainer computes for the same records."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from elastic_kernels.api.finetune import embedded_config, embedded_model
    from elastic_kernels.api.finetune.sft import Record, tokenize_record

    tok = _hf(tok_dir)
    cfg = embedded_config(**DIMS)
    cfg.vocab_size = len(tok.tok)
    model = embedded_model(cfg, seed=0)

    def trl_rows(records):
        conf = SFTConfig(output_dir=str(tmp_path / "trl"), completion_only_loss=True, max_length=None, packing=False,
                         report_to=[], dataset_num_proc=None, bf16=False, use_cpu=True)
        trainer = SFTTrainer(model=model, args=conf, train_dataset=Dataset.from_list(records), processing_class=tok.tok)
        return [(r["input_ids"], r["labels"]) for r in trainer.train_dataset]  # TRL folds its mask into labels

    def labelled(encoded):
        return [(ids, [t if m else -100 for t, m in zip(ids, mask)]) for ids, mask in encoded]

    ours = [tokenize_record(Record(i + 1, prompt=r["prompt"], completion=r["completion"]), tok) for i, r in enumerate(PC)]
    assert labelled(ours) == trl_rows(PC)
    conv = [{"prompt": c[:-1], "completion": c[-1:]} for c in CHAT]
    ours = [tokenize_record(Record(i + 1, messages=c), tok) for i, c in enumerate(CHAT)]
    assert labelled(ours) == trl_rows(conv)
    assert all(0 < sum(m) < len(m) for _, m in ours)


def test_multi_turn_mask_is_the_assistant_spans(tok_dir):
    """A hand-computed reference: the tokens whose characters lie in each assistant turn's
    rendering ('content<|im_end|>\\n'), from the tokenizer's offsets; --loss-on all trains all."""
    from elastic_kernels.api.finetune.sft import Record, tokenize_record

    tok = _hf(tok_dir)
    msgs = [{"role": "user", "content": "What is a list?"}, {"role": "assistant", "content": "A list is a value."},
            {"role": "user", "content": "And a loop?"}, {"role": "assistant", "content": "It iterates each item."}]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
    spans, at = [], 0
    for m in msgs:
        head = f"<|im_start|>{m['role']}\n"
        body = f"{m['content']}<|im_end|>\n"
        if m["role"] == "assistant":
            spans.append((at + len(head), at + len(head) + len(body)))
        at += len(head) + len(body)
    enc = tok.tok(text, add_special_tokens=False, return_offsets_mapping=True)
    expected = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    ids, mask = tokenize_record(Record(1, messages=msgs), tok)
    assert ids == enc["input_ids"] and mask == expected and sum(mask) > 0
    assert tokenize_record(Record(1, messages=msgs), tok, loss_on="all")[1] == [1] * len(ids)


def test_packed_rows_equal_each_record_alone(tok_dir):
    """Packed records (position ids restarting, no cache) get exactly the logits each record gets
    alone: attention stays in the record; the first token of each record has no label."""
    from elastic_kernels.api.finetune import embedded_config, embedded_model
    from elastic_kernels.api.finetune.engine import model_inputs
    from elastic_kernels.api.finetune.sft import IGNORE, Record, build_rows, tokenize_record

    tok = _hf(tok_dir)
    cfg = embedded_config(**DIMS)
    cfg.vocab_size = len(tok.tok)
    model = embedded_model(cfg, seed=1).eval()
    enc = [tokenize_record(Record(i + 1, messages=c), tok) for i, c in enumerate(CHAT)]
    enc += [tokenize_record(Record(3, prompt=p["prompt"], completion=p["completion"]), tok) for p in PC]
    lengths = [len(ids) for ids, _ in enc]
    rows, counts = build_rows(enc, sum(lengths) + 5, pad_id=0, packed=True)
    assert counts == {"records": 4, "truncated": 0, "dropped": 0, "rows": 1}
    batch = {"input_ids": rows.input_ids, "labels": rows.labels, "position_ids": rows.position_ids}
    with torch.no_grad():
        packed = model(**model_inputs(batch)).logits[0]
        at = 0
        for ids, mask in enc:
            alone = model(input_ids=torch.tensor([ids])).logits[0]
            torch.testing.assert_close(packed[at:at + len(ids)], alone, rtol=1e-5, atol=1e-5)
            assert rows.labels[0, at] == IGNORE
            assert rows.labels[0, at + 1:at + len(ids)].tolist() == [t if m else IGNORE for t, m in
                                                                      zip(ids[1:], mask[1:])]
            at += len(ids)
    assert (rows.labels[0, at:] == IGNORE).all()
    # Padded: one record per row, no position ids.
    rows, counts = build_rows(enc, max(lengths), pad_id=0, packed=False)
    assert counts["rows"] == 4 and rows.position_ids is None and rows.real_tokens == sum(lengths)


def test_truncation_is_counted_and_empty_records_dropped(tok_dir):
    from elastic_kernels.api.finetune.sft import Record, build_rows, tokenize_record

    tok = _hf(tok_dir)
    long = [{"role": "user", "content": " ".join(WORDS)}, {"role": "assistant", "content": "It is."}]
    enc = [tokenize_record(Record(1, messages=long), tok), tokenize_record(Record(2, messages=CHAT[0]), tok)]
    prompt_len = enc[0][1].index(1)
    rows, counts = build_rows(enc, prompt_len, pad_id=0, packed=True)  # record 1 keeps no trained token
    assert counts == {"records": 2, "truncated": 1, "dropped": 1, "rows": 1}
    rows, counts = build_rows(enc, prompt_len + 2, pad_id=0, packed=True)
    assert counts["truncated"] == 1 and counts["dropped"] == 0 and counts["rows"] == 2


@pytest.mark.parametrize("lines,message", [
    (['{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}',
      '{"prompt": "a", "completion": "b"}'], r"line 2: a prompt-completion record in a file of chat \(messages\) records \(line 1\)"),
    (['{"prompt": "a", "completion": "b"}', '', '{"text": "x"}'], "line 3: a text record in a file of prompt-completion"),
    (['{"messages": [{"role": "robot", "content": "a"}]}'], "line 1: message 1 has the unknown role 'robot'"),
    (['{"messages": []}'], r"line 1: .*\(an empty record\)"),
    (['{"prompt": "a", "completion": "b"}', '{}'], "line 2: expected exactly one of"),
    (['{"messages": [{"role": "user", "content": "a"}]}'], "line 1: no assistant message with content: the record has no token"),
    (['{"prompt": "a", "completion": "  "}'], "line 1: the completion is empty"),
    (['{"prompt": ["a"], "completion": "b"}'], 'line 1: "prompt" and "completion" must be strings'),
])
def test_bad_records_name_their_line(tmp_path, lines, message):
    from elastic_kernels.api.finetune.data import DataError
    from elastic_kernels.api.finetune.sft import read_jsonl

    path = str(tmp_path / "d.jsonl")
    with pytest.raises(DataError, match=f"data file {path}, {message}"):
        read_jsonl(path, "\n".join(lines) + "\n")


def test_rows_of_a_step_depend_on_seed_and_step_only(tok_dir):
    """Every training row once per epoch; a step's global rows do not depend on the split."""
    from elastic_kernels.api.finetune.sft import Record, RecordRows, build_rows, tokenize_record

    tok = _hf(tok_dir)
    enc = [tokenize_record(Record(i + 1, prompt=f"p{i}", completion=" value" * (1 + i % 3)), tok) for i in range(10)]
    rows, _ = build_rows(enc, 16, pad_id=0, packed=False)
    probe, _ = build_rows(enc[:1], 16, pad_id=0, packed=False)
    rr = RecordRows(rows, probe, 16, "test")
    seen = torch.cat([rr._indices(7, s, 5) for s in range(2)])  # 2 steps of 5 = one epoch of 10
    assert sorted(seen.tolist()) == list(range(10))
    one = rr.inputs(7, 3, 1, 0, 4, 1)["input_ids"].reshape(-1, 16)
    two = [rr.inputs(7, 3, 2, r, 2, 1)["input_ids"] for r in range(2)]
    assert torch.equal(one, torch.cat([t.reshape(-1, 16) for t in two]))


def test_sft_run_equals_fsdp2_on_packed_records(tok_dir, tmp_path):
    """2 gloo ranks, the tiny model over the tokenizer above, prompt-completion records packed:
    the elastic run's losses equal FSDP2 + PEFT's within fp32 rounding (position ids reach both),
    the header counts the truncated records, and the adapter folder has the tokenizer."""
    from elastic_kernels.api.finetune import embedded_config, embedded_model

    cfg = embedded_config(**DIMS)
    cfg.vocab_size = len(_hf(tok_dir).tok)
    mdir = tmp_path / "model"
    embedded_model(cfg, seed=3).save_pretrained(mdir)
    for f in os.listdir(tok_dir):
        os.link(os.path.join(tok_dir, f), mdir / f) if not (mdir / f).exists() else None
    data = tmp_path / "pc.jsonl"
    recs = [{"prompt": " ".join(WORDS[i:i + 3]), "completion": " " + " ".join(WORDS[i + 3:i + 6 + i % 4])}
            for i in range(24)]
    recs[5]["completion"] = " " + " ".join(WORDS) * 2  # longer than --seq-len: truncated, counted
    data.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    out = str(tmp_path / "out")
    _, stdout, _ = torchrun(["--model", str(mdir), "--data", str(data), "--seq-len", "32", "--steps", "3",
                             "--micro-batch", "2", "--grad-accum", "1", "--chunk-kib", "1", "--lora-r", "4",
                             "--no-progress", "--sample-tokens", "4", "--baseline", "fsdp2", "--save-dir", out],
                            what="SFT run")
    s = summary_of(out)
    assert s["data"]["format"] == "prompt-completion" and s["data"]["truncated_records"] == 1
    assert "1 record(s) truncated at --seq-len" in stdout
    elastic, fsdp2 = s["runs"][0], s["runs"][1]
    assert fsdp2["kind"] == "fsdp2"
    assert max(abs(a - b) for a, b in zip(elastic["losses"], fsdp2["losses"])) < 1e-5
    # The reloaded adapter's held-out loss is the elastic run's (the saved adapter is the trained one).
    assert abs(s["heldout"]["heldout_loss_reloaded"] - elastic["heldout_loss"]) < 1e-4
    assert len(s["heldout"]["samples"]) == 2  # 24 // 8 = 3 records held out; the first two are sampled
    assert os.path.isfile(os.path.join(out, "adapter", "tokenizer_config.json"))
