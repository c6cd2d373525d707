"""bf16 semantics on the real model (issue 28; docs/huggingface.md, "bf16"): under
`Trainer(bf16=True)` the elastic layers keep the adapters fp32 and round the base product and
the LoRA term once, PEFT (under autocast) rounds its fp32 adapters to bf16 and rounds the two
products separately. From the same initial adapters (B = 0, PEFT's default) and the same rows,
three AdamW steps at lr 1e-3: the elastic bf16 losses stay closer to the fp32 run's than PEFT's
bf16 losses do, at steps 2 and 3 (step 1 is the base model's loss before any update).

Measured on this VM (bench/results/2026-12-03_hf.md, `python bench/bench_hf.py bf16 --lr 1e-3
--b-init zero`): step 3 minus fp32, elastic +0.0040 and PEFT +0.0117; step 2 +0.0027 and
+0.0146. The fp32 reference is the elastic fp32 run (equal to PEFT's fp32 run to the 4 decimals
printed there); the bound that elastic stays within 0.01 of it is that file's figure with
2.5x room."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.needs_ext]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SEQ, BATCH, STEPS, LR = 128, 2, 3, 1e-3


def _rows(path: str):
    from transformers import AutoTokenizer

    from elastic_kernels.api.finetune.data import embedded_documents

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tok("\n\n".join(embedded_documents()[:40]), return_tensors="pt").input_ids[0]
    return [{"input_ids": ids[i * SEQ:(i + 1) * SEQ], "labels": ids[i * SEQ:(i + 1) * SEQ]} for i in range(BATCH * STEPS)]


def _losses(path, rows, peft: bool, bf16: bool, tmp) -> list[float]:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from elastic_kernels.api import ElasticPolicy, load_elastic
    from elastic_kernels.api.nn import LoRAConfig, lora_layers

    elastic = load_elastic(path, LoRAConfig(r=8, alpha=16, target_modules=TARGETS), ElasticPolicy(),
                           dtype=torch.float32).train()
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
    args = TrainingArguments(output_dir=str(tmp), use_cpu=True, per_device_train_batch_size=BATCH, learning_rate=LR,
                             lr_scheduler_type="constant", logging_steps=1, report_to=[], seed=0, disable_tqdm=True,
                             dataloader_num_workers=0, save_strategy="no", max_steps=STEPS, bf16=bf16)
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_bf16_elastic_stays_closer_to_fp32_than_peft(real_model, tmp_path):
    rows = _rows(real_model)
    fp32 = _losses(real_model, rows, peft=False, bf16=False, tmp=tmp_path / "fp32")
    ours = _losses(real_model, rows, peft=False, bf16=True, tmp=tmp_path / "elastic-bf16")
    peft = _losses(real_model, rows, peft=True, bf16=True, tmp=tmp_path / "peft-bf16")
    print(f"fp32 {fp32}\nelastic bf16 {ours}\nPEFT bf16 {peft}")
    assert len(fp32) == len(ours) == len(peft) == STEPS
    for step in (1, 2):  # steps 2 and 3: after updates
        e, p = abs(ours[step] - fp32[step]), abs(peft[step] - fp32[step])
        assert e < p, f"step {step + 1}: elastic bf16 is {e:.4f} from fp32, PEFT bf16 {p:.4f}"
        assert e <= 0.01, f"step {step + 1}: elastic bf16 is {e:.4f} from fp32"
