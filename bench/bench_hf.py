"""The Hugging Face Trainer on the real model (SmolLM2-135M-Instruct): what a checkpoint costs,
and what bf16 autocast does to the losses of elastic and PEFT (issue 28).

    python bench/bench_hf.py checkpoint   # bytes of one ElasticTrainer checkpoint, adapter-only vs full
    python bench/bench_hf.py bf16 [--lr LR] [--b-init zero|small]
                                          # losses under Trainer(bf16=True) vs fp32, elastic and PEFT

One process, CPU. Both parts print a markdown table (bench/results/2026-12-03_hf.md holds the
figures). LoRA r=8, alpha=16 on the 7 projections of every layer; batches of 2 windows of 128
tokens of the embedded corpus (python_api/finetune/data.py), the same for every run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SEQ, BATCH = 128, 2


def _model_dir() -> str:
    from elastic_kernels.api.loading.pretrained import pretrained_dir

    return pretrained_dir("smollm2-135m-instruct")


def _rows(path: str, n: int):
    from transformers import AutoTokenizer

    from elastic_kernels.api.finetune.data import embedded_documents

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tok("\n\n".join(embedded_documents()[:40]), return_tensors="pt").input_ids[0]
    return [{"input_ids": ids[i * SEQ:(i + 1) * SEQ], "labels": ids[i * SEQ:(i + 1) * SEQ]} for i in range(n)]


def _elastic(path: str):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.loading import load_elastic
    from elastic_kernels.api.nn import LoRAConfig

    return load_elastic(path, LoRAConfig(r=8, alpha=16, target_modules=TARGETS), ElasticPolicy(),
                        dtype=torch.float32).train()


def _args(out: str, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, use_cpu=True, per_device_train_batch_size=BATCH, learning_rate=2e-4,
                lr_scheduler_type="constant", logging_steps=1, report_to=[], seed=0, disable_tqdm=True,
                dataloader_num_workers=0, save_strategy="no")
    return TrainingArguments(**{**base, **kw})


def _dir_bytes(path: str) -> dict[str, int]:
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, path)] = os.path.getsize(p)
    return out


def checkpoint() -> None:
    from elastic_kernels.api.hf import ElasticTrainer

    path = _model_dir()
    rows = _rows(path, 4)
    print("| checkpoint | files | bytes |\n|---|---|---:|")
    for full in (True, False):
        model = _elastic(path)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = ElasticTrainer(model=model, args=_args(tmp, max_steps=1, save_strategy="steps", save_steps=1),
                                     train_dataset=rows, save_full_model=full)
            trainer.train()
            sizes = _dir_bytes(os.path.join(tmp, "checkpoint-1"))
        what = "save_full_model=True (before issue 28)" if full else "adapter only (default)"
        files = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(sizes.items(), key=lambda kv: -kv[1]))
        print(f"| {what} | {files} | {sum(sizes.values()):,} |")


def _losses(path: str, peft: bool, bf16: bool, rows, lr: float, b_init: str) -> list[float]:
    from transformers import AutoModelForCausalLM, Trainer

    from elastic_kernels.api.nn import lora_layers

    elastic = _elastic(path)
    if b_init == "small":  # B != 0: the adapters start as a small update (else PEFT's B = 0)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, layer in lora_layers(elastic):
                layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 1e-3)
    model = elastic
    if peft:
        from peft import LoraConfig, get_peft_model

        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS), lora_dropout=0.0))
        mods = dict(model.base_model.model.named_modules())
        with torch.no_grad():
            for name, layer in lora_layers(elastic):
                mods[name].lora_A["default"].weight.copy_(layer.lora_A.weight)
                mods[name].lora_B["default"].weight.copy_(layer.lora_B.weight)
        model.train()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(model=model, args=_args(tmp, max_steps=3, bf16=bf16, learning_rate=lr), train_dataset=rows)
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def bf16(lr: float, b_init: str) -> None:
    path = _model_dir()
    rows = _rows(path, 6)
    runs = {}
    for peft in (False, True):
        for half in (False, True):
            runs[(peft, half)] = _losses(path, peft, half, rows, lr, b_init)
    print(f"lr {lr}, B initialised {b_init}; the loss logged at step k is computed before update k\n")
    print("| run | loss step 1 | step 2 | step 3 | step 3 - fp32 step 3 (same library) |\n|---|---:|---:|---:|---:|")
    for (peft, half), losses in runs.items():
        ref = runs[(peft, False)][-1]
        name = f"{'PEFT' if peft else 'elastic'} {'bf16' if half else 'fp32'}"
        print(f"| {name} | " + " | ".join(f"{x:.4f}" for x in losses) + f" | {losses[-1] - ref:+.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["checkpoint", "bf16"])
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--b-init", choices=["zero", "small"], default="small")
    args = parser.parse_args()
    torch.manual_seed(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    print(f"<!-- bench/bench_hf.py {args.what}, commit {commit}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads -->", file=sys.stderr)
    if args.what == "checkpoint":
        checkpoint()
    else:
        bf16(args.lr, args.b_init)


if __name__ == "__main__":
    main()
