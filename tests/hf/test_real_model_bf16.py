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

pytestmark = [pytest.mark.needs_ext]

LR, STEPS = 1e-3, 3


def test_bf16_elastic_stays_closer_to_fp32_than_peft(real_model):
    from bench.bench_hf import _losses, _rows  # the measurement the figures above come from

    rows = _rows(real_model, 6)
    fp32 = _losses(real_model, peft=False, bf16=False, rows=rows, lr=LR, b_init="zero")
    ours = _losses(real_model, peft=False, bf16=True, rows=rows, lr=LR, b_init="zero")
    peft = _losses(real_model, peft=True, bf16=True, rows=rows, lr=LR, b_init="zero")
    print(f"fp32 {fp32}\nelastic bf16 {ours}\nPEFT bf16 {peft}")
    assert len(fp32) == len(ours) == len(peft) == STEPS
    for step in (1, 2):  # steps 2 and 3: after updates
        e, p = abs(ours[step] - fp32[step]), abs(peft[step] - fp32[step])
        assert e < p, f"step {step + 1}: elastic bf16 is {e:.4f} from fp32, PEFT bf16 {p:.4f}"
        assert e <= 0.01, f"step {step + 1}: elastic bf16 is {e:.4f} from fp32"
