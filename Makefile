# Two commands for a fresh machine: `make demo` (the main job, on CPU) and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, from the CPU wheel (never let a dependency pull a multi-GB CUDA build)
TORCH ?= torch==2.13.0

.PHONY: setup test lint demo demo-lora demo-agent test-mcore-latest clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

test: setup
	$(BIN)/python -m pytest -q --durations=25  # the slowest tests, to keep the suite fast

lint: setup  # ruff, configured in pyproject.toml: lint rules and the formatter (120 columns)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

demo: setup
	$(BIN)/moe-rl train configs/demo_cpu.yaml --overwrite  # a fresh runs/demo each time

demo-lora: setup
	$(BIN)/moe-rl train configs/demo_lora_cpu.yaml --overwrite  # adapter-only RL, runs/demo_lora

demo-agent: setup
	$(BIN)/moe-rl train configs/demo_agent_cpu.yaml --overwrite  # multi-turn tool episodes, runs/demo_agent

# The same suite on Python 3.12 with megatron-core 0.19.x (what clusters run). torch comes
# from the registry as a CUDA build (~3 GB) and runs on CPU. Not in CI.
test-mcore-latest:
	PYENV_VERSION=3.12.1 pyenv exec python -m venv .venv-mcore
	.venv-mcore/bin/pip install --quiet --upgrade pip
	.venv-mcore/bin/pip install --quiet 'megatron-core>=0.19,<0.20' -e '.[dev]'
	.venv-mcore/bin/python -m pytest -q

clean:
	rm -rf $(VENV) .venv-mcore .pytest_cache
