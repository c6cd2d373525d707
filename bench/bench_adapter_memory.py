"""The planner's memory model against a K-adapter job on the real model (issue 29: "the
planner's memory model predicts it within 10%"): the profile of a ONE-adapter job
(measure_profile), the prediction for K adapters (`Choices.num_adapters = K`, keep nothing,
one 128-token sequence per adapter, no recompute), and the K-adapter job's measured tensor
peak (`measure_peak_bytes`), on every rank; rank 0 prints one line per K.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_adapter_memory.py 1,2,4

tests/planner/test_memory_model_adapters.py checks the same on the demo model in the suite.
"""

import gc
import sys
import time
import weakref

import torch
import torch.distributed as dist

SEQ = 128
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load():
    from transformers import AutoModelForCausalLM

    from elastic_kernels.api.loading.pretrained import pretrained_dir
    return AutoModelForCausalLM.from_pretrained(str(pretrained_dir("smollm2-135m-instruct")), torch_dtype=torch.float32)


def profile_one(policy, lora, gen, vocab):
    from elastic_kernels.api import convert_to_elastic
    from elastic_kernels.api.nn.convert import runtime_of
    from elastic_kernels.api.planning.measure import measure_profile
    one = convert_to_elastic(load(), lora, policy)
    one.train()
    t = time.time()
    profile = measure_profile(one, [torch.randint(0, vocab, (2, SEQ), generator=gen)], capacity_bytes=8 << 30)
    return weakref.ref(runtime_of(one)), profile, time.time() - t


def measure_k(k, profile, policy, lora, gen, vocab):
    from elastic_kernels.api import convert_to_elastic
    from elastic_kernels.api.planner.memory import Choices
    from elastic_kernels.api.planner.search import plan_of
    from elastic_kernels.api.planning.apply import apply_plan
    from elastic_kernels.api.planning.peaks import measure_peak_bytes
    names = [f"a{i}" for i in range(k)]
    model = convert_to_elastic(load(), {n: lora for n in names}, policy)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    plan = plan_of(profile, Choices.uniform(profile, 1, 0.0, num_adapters=k), memory_bytes=8 << 30,
                   global_batch=dist.get_world_size())
    ids = torch.randint(0, vocab, (k, SEQ), generator=gen)

    def step():
        model(input_ids=ids, labels=ids, adapter_names=names).loss.backward()

    apply_plan(model, plan)
    for _ in range(2):
        step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    measured = measure_peak_bytes(model, step)
    return plan.predicted_peak_bytes, measured


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    from elastic_kernels.api import ElasticPolicy, LoRAConfig
    policy = ElasticPolicy(chunk_bytes=256 << 10)
    lora = LoRAConfig(r=8, alpha=16, target_modules=TARGETS)
    gen = torch.Generator().manual_seed(rank)
    vocab = 49152
    gone, profile, secs = profile_one(policy, lora, gen, vocab)
    gc.collect()
    assert gone() is None
    if rank == 0:
        print(f"profiled in {secs:.1f} s", flush=True)
    for k in [int(x) for x in sys.argv[1].split(",")]:
        predicted, measured = measure_k(k, profile, policy, lora, gen, vocab)
        gc.collect()
        if rank == 0:
            err = (predicted - measured) / measured
            print(f"K={k}: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB ({err:+.1%})",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
