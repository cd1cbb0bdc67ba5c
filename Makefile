# Two commands for a fresh machine: `make demo` (the main job, on CPU) and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, from the CPU wheel (never let a dependency pull a multi-GB CUDA build)
TORCH ?= torch==2.13.0

.PHONY: setup test test-fast lint demo demo-lora demo-agent demo-distill test-mcore-latest clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

test: setup
	$(BIN)/python -m pytest -q --durations=25  # the slowest tests, to keep the suite fast

test-fast: setup  # everything that starts no process (no `world` marker): a broken import fails in minutes
	$(BIN)/python -m pytest -q -m "not world" --durations=10

lint: setup  # ruff, configured in pyproject.toml: lint rules and the formatter (120 columns)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

demo: setup
	$(BIN)/moe-rl train configs/demo_cpu.yaml --overwrite  # a fresh runs/demo each time

demo-lora: setup
	$(BIN)/moe-rl train configs/demo_lora_cpu.yaml --overwrite  # adapter-only RL, runs/demo_lora

demo-agent: setup
	$(BIN)/moe-rl train configs/demo_agent_cpu.yaml --overwrite  # multi-turn tool episodes, runs/demo_agent

demo-distill: setup  # on-policy distillation from `make demo`'s policy into a fresh student, runs/demo_distill
	test -f runs/demo/final_hf/config.json || $(MAKE) demo
	$(BIN)/moe-rl train configs/demo_distill_cpu.yaml --overwrite

# Python 3.12 with megatron-core 0.19.x (what clusters run): the test files whose processes build
# or read a Megatron model (bridges, checkpoints, trainer, LoRA, the loss on Megatron, the export
# into sync). The sync, conformance, engine and algorithm tests that never import megatron-core (or,
# as the LoRA payload test, stand in for its patch themselves) ran in `make test` already.
# torch comes from the registry as a CUDA build (~3 GB) and runs on CPU. CI runs it after
# `make test`; MCORE_TESTS=tests runs everything.
MCORE_PYTHON ?= 3.12.1
MCORE_TESTS ?= tests/parallel tests/trainer tests/algorithms/test_policy_loss_megatron.py \
	tests/sync/test_shapes.py tests/sync/test_sync_export.py tests/sync/test_sync_pipeline.py \
	tests/sync/test_sync_stages.py tests/sync/test_sync_owner.py tests/sync/test_bench_sync.py tests/test_config.py
MCORE_VENV := .venv-mcore

$(MCORE_VENV)/.installed: pyproject.toml
	PYENV_VERSION=$(MCORE_PYTHON) pyenv exec python -m venv $(MCORE_VENV)
	$(MCORE_VENV)/bin/pip install --quiet --upgrade pip
	$(MCORE_VENV)/bin/pip install --quiet 'megatron-core>=0.19,<0.20' -e '.[dev]'
	touch $@

test-mcore-latest: $(MCORE_VENV)/.installed
	$(MCORE_VENV)/bin/python -c "import megatron.core.package_info as p, sys; print('megatron-core', p.__version__, 'python', sys.version.split()[0])"
	$(MCORE_VENV)/bin/python -m pytest -q --durations=10 $(MCORE_TESTS)

clean:
	rm -rf $(VENV) .venv-mcore .pytest_cache
