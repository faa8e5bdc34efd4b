# maskplug — every target sets up what it needs.
#   make demo   the main job: an end-to-end structured-output serving simulation
#   make test   the whole test suite (core, plugins, engine adapters)
#   make lint   ruff + mypy (every distribution and the tests) + the API reference build; CI runs it before the tests
#   make docs   the API reference from the docstrings (pdoc), into build/docs/index.html
#   make bench  the benchmarks: maskplug bench, then the full scripts under benchmarks/

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q -c constraints/cpu.txt --no-build-isolation
STAMP  := $(VENV)/.maskplug-installed
# Every plugin distribution in the tree, installed editable beside the core.
PLUGIN_DIRS := $(patsubst %/pyproject.toml,%,$(wildcard backends/*/pyproject.toml grammars/*/pyproject.toml))
PLUGIN_ARGS := $(foreach d,$(PLUGIN_DIRS),-e $(d))

.PHONY: venv demo demo-vllm test test-core test-engines lint docs bench clean

$(STAMP): pyproject.toml constraints/cpu.txt $(wildcard requirements/*.txt) $(wildcard backends/*/pyproject.toml grammars/*/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PIP) -e '.[test,lint]' $(PLUGIN_ARGS) -r requirements/extras.txt
	test ! -s requirements/nodeps.txt || $(PIP) --no-deps -r requirements/nodeps.txt
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/maskplug demo

# The real-engine companion of `make demo`: vLLM's OpenAI server (adapters/.venv-vllm) with maskplug
# choosing the verify budget, on a tiny Llama trained on the demo's tasks (about a minute the first
# time, cached under ~/.cache/maskplug/demo-vllm), then a couple of minutes. DEMO_ARGS passes options.
demo-vllm:
	$(MAKE) -C adapters .venv-vllm/.maskplug-vllm-installed
	cd adapters/vllm && ../.venv-vllm/bin/python -m maskplug_vllm.demo $(DEMO_ARGS)

test: test-core test-engines

test-core: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 tests

test-engines:
	@if [ -f adapters/Makefile ]; then $(MAKE) -C adapters test; else echo "no engine adapters yet"; fi

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	cd adapters/vllm && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml maskplug_vllm tests
	cd adapters/sglang && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml maskplug_sglang tests
	$(MAKE) docs

# The API reference: every public module of the core and of the plugin distributions, from their
# docstrings. A module that fails to import or a docstring pdoc cannot process fails the build.
docs: $(STAMP)
	rm -rf build/docs
	$(PY) docs/build_api.py build/docs

bench: $(STAMP)
	$(VENV)/bin/maskplug bench
	$(PY) benchmarks/host_path.py
	$(PY) benchmarks/cpu_apply.py
	$(PY) benchmarks/draft_rows.py
	$(PY) benchmarks/schedulers.py

clean:
	rm -rf $(VENV) build *.egg-info
