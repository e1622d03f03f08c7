# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# The CPU wheel; any unpinned torch would pull a multi-GB CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test,sim]'
	touch $(STAMP)

.PHONY: venv demo test lint bench gpu-test gpu-megatron
venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/leto-run --config configs/demo.yaml

test: $(STAMP) lint
	$(VENV)/bin/python -m pytest -q --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The goodput bench's peers (pyproject's extra `bench`, pinned) go to .bench-peers, not the venv:
# lm-resiliency's torchrun.handlers entry point is broken under torch 2.13 and would make every
# torchrun in the venv log a traceback. --no-deps: torch stays the pinned 2.13.0 CPU wheel.
BENCH_PEERS := lm-resiliency==0.2.0
bench: $(STAMP)
	$(VENV)/bin/python bench/recovery_cpu.py
	$(VENV)/bin/pip install -q --no-deps --upgrade --target .bench-peers $(BENCH_PEERS)
	$(VENV)/bin/python bench/goodput.py --json bench/results/goodput_cpu.json

# On a GPU machine: the GPU tests (CPU CI skips them, saying why) and the GPU benchmark.
gpu-test:
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. python3 -m pytest -q tests/gpu
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. python3 bench/recovery_gpu.py

# On a GPU machine with megatron-core's wheel in .whl/ (docs/MEGATRON.md): Megatron's GPU tests and benchmark.
GPU_ENV := NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=/tmp/site:.
gpu-megatron:
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
	$(GPU_ENV) python3 -m pytest -q -rs tests/gpu/test_megatron_gpu.py
	$(GPU_ENV) python3 bench/megatron_gpu.py
