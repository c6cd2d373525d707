"""What the trained adapter does, seen the way a user loads it: on rank 0, the saved adapter
folder is loaded with PEFT over a fresh copy of the base model, and the held-out loss and
greedy generation samples are taken with the adapter disabled (before: the initial adapters'
B is zero, so this is the model at step 0) and enabled (after).

[Note: the held-out loss before and after, and the samples]
Before training the model is the base model exactly (LoRA's B starts at zero), so the step-0
held-out loss is the base model's loss on the held-out batch, the same for every run of the
job. It is measured here rather than by a forward of each run's engine before its first
step: that forward would teach the elastic runtime its layer order before step 1 and change
what the first step gathers ([Note: learned order and prefetch]). The "after" loss of the
reloaded adapter is reported beside the elastic run's own held-out loss: they differ by
rounding only, which checks that the saved adapter is the trained one. Samples: the first two
held-out prompts, greedy, --sample-tokens new tokens, stopping at the end-of-turn token.
This loads the whole base model on rank 0: `--sample-tokens 0` skips it for a model that
does not fit one rank.
"""

from __future__ import annotations

import torch


def _loss(model, inputs: dict) -> float:
    kw = dict(inputs)
    if "position_ids" in kw:
        kw["use_cache"] = False
    with torch.no_grad():
        return float(model(**kw).loss)


def _generate(model, tokenizer, prompt: dict, max_new: int) -> str:
    tok = tokenizer.tok
    if "messages" in prompt:
        text = tok.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = tok(prompt["prompt"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def prompt_text(prompt: dict) -> str:
    if "messages" in prompt:
        return prompt["messages"][-1]["content"]
    return prompt["prompt"]


def _peft_base(spec):
    """The base model PEFT reloads the adapter onto. A bitsandbytes 4-bit checkpoint is loaded
    as a QLoRA user loads it: transformers reads its quantization_config and builds Linear4bit
    layers over the packed weights (bitsandbytes, on the CPU here), in its compute dtype."""
    if spec.packed is None:
        return spec.build()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec.source, local_files_only=True, dtype=spec.dtype, device_map="cpu")


def reload_and_sample(job, adapter_dir: str) -> dict:
    """Rank 0: {"heldout_loss_before", "heldout_loss_reloaded", "samples": [{prompt, before,
    after}], "sample_tokens"} ([Note: the held-out loss before and after, and the samples])."""
    from peft import PeftModel

    base = _peft_base(job.spec).eval()
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    probe = job.windows.probe_inputs()
    prompts = job.data_info.get("samples", []) if hasattr(job.spec.tokenizer, "tok") else []
    n = job.cfg.output.sample_tokens
    out = {"sample_tokens": n, "samples": []}
    with model.disable_adapter():
        out["heldout_loss_before"] = _loss(model, probe)
        before = [_generate(model, job.spec.tokenizer, p, n) for p in prompts]
    out["heldout_loss_reloaded"] = _loss(model, probe)
    after = [_generate(model, job.spec.tokenizer, p, n) for p in prompts]
    out["samples"] = [{"prompt": prompt_text(p), "before": b, "after": a} for p, b, a in zip(prompts, before, after)]
    return out
