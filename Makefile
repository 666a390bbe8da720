# Two commands do everything on a fresh machine (2-core x86 CPU, Python 3.11):
#   make demo   set up, fetch the default models, run the main job (vanilla vs vLLM eagle3 vs the plugin's
#               EAGLE-2 tree and its speculation controller, 13-20 minutes; python -m benchmarks main
#               --full runs all seven setups; benchmarks/README.md lists the other benchmarks)
#   make test   set up, run the default test suite (what CI runs): the engine-free fast lane, then the engine tests
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.easyspec-installed

.PHONY: setup demo test test-slow lint

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q --upgrade pip
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0+cpu
	$(BIN)/pip install --disable-pip-version-check -q -e ".[cpu,dev,train,bench]"
	# Their registry builds need CUDA and break `import transformers`; vLLM does not need them.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import transformers, vllm, vllm_easyspec.plugin"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m benchmarks main

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not engine and not slow"  # the fast lane first: engine-free, under 2 minutes
	$(BIN)/python -m pytest -q -m "engine and not slow" --durations=15

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check .
