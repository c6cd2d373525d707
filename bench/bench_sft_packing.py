"""Packed vs padded SFT rows ([Note: records are packed, attention stays in each record] in
python_api/finetune/sft.py): real (non-padding) tokens per second of one forward + backward of
the real model with LoRA (PEFT, r 8, the CLI's targets) over rows of the default instruction
set, the two layouts' steps interleaved (round k: packed then padded; round k+1 reversed), the
median of the per-round ratios. The attention masking is what differs (packed rows carry
position ids and get transformers' block-causal mask; padded rows the plain causal one); the
elastic runtime does not touch attention, so the dense model measures that difference.

    python bench/bench_sft_packing.py [--seq-len 256] [--rows 2] [--rounds 6] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rows", type=int, default=2, help="rows per step (a micro-batch)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from elastic_kernels.api.finetune.data import HFTokenizer
    from elastic_kernels.api.finetune.engine import model_inputs
    from elastic_kernels.api.finetune.sft import build_rows, embedded_instructions, tokenize_record
    from elastic_kernels.api.loading.pretrained import pretrained_dir

    d = str(pretrained_dir("smollm2-135m-instruct"))
    tok = HFTokenizer(AutoTokenizer.from_pretrained(d), d)
    train, _ = embedded_instructions()
    enc = [tokenize_record(r, tok) for r in train]
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.train()
    batches, fill = {}, {}
    for name, packed in (("packed", True), ("padded", False)):
        rows, counts = build_rows(enc, args.seq_len, tok.eos_id, packed)
        b = {"input_ids": rows.input_ids[: args.rows], "labels": rows.labels[: args.rows]}
        if rows.position_ids is not None:
            b["position_ids"] = rows.position_ids[: args.rows]
        batches[name] = b
        fill[name] = (int((b["input_ids"] != tok.eos_id).sum()), counts["rows"], rows.real_tokens / rows.input_ids.numel())

    def step(name):
        t0 = time.perf_counter()
        model(**model_inputs(batches[name])).loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for name in batches:  # warm-up
        step(name)
    ratios, times = [], {"packed": [], "padded": []}
    for k in range(args.rounds):
        order = ["packed", "padded"] if k % 2 == 0 else ["padded", "packed"]
        t = {n: step(n) for n in order}
        for n in t:
            times[n].append(t[n])
        ratios.append(t["padded"] / t["packed"])
    step_ratio = statistics.median(ratios)
    real = {n: fill[n][2] for n in fill}
    print(f"seq {args.seq_len}, {args.rows} rows/step, {args.rounds} rounds, {args.threads} thread(s)")
    for n in ("packed", "padded"):
        print(f"{n}: {fill[n][1]} rows for the {len(enc)} training records, real-token fill {real[n]:.3f}, "
              f"median step {statistics.median(times[n]):.3f} s")
    print(f"step time padded/packed (median of per-round ratios): {step_ratio:.3f}")
    print(f"real tokens/s packed/padded: {step_ratio * real['packed'] / real['padded']:.2f}x")


if __name__ == "__main__":
    main()
