# Two commands for a fresh machine: `make demo` and `make test`. Everything installs into .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
FASTDECODE := $(VENV)/bin/fastdecode
THREADS ?= 2

.PHONY: demo test install test-install bench bench-deps clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# torch first, pinned to the CPU build on this machine's disk: any looser pin pulls a multi-GB CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e .
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(PIP) install -e '.[test]'
	touch $@

install: $(VENV)/.installed

test-install: $(VENV)/.test-installed

demo: install
	$(FASTDECODE) pull smollm2-135m
	$(FASTDECODE) generate -m smollm2-135m --chat --threads $(THREADS) --max-tokens 200 --speed-table \
		-p "Write a Python function that checks whether a string is a palindrome, with a docstring."

test: test-install
	$(FASTDECODE) pull smollm2-135m
	$(FASTDECODE) pull gemma3-270m
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info

# The benchmark's peers, kept out of `make test`: llama-cpp-python is built from source (about 4 minutes on 2 cores).
# Built with -march=native, llama.cpp's AMX path crashes on Sapphire Rapids (SIGSEGV at ldtilecfg, see
# shared/PERF_NOTES.md), so a CPU with AMX gets an explicit AVX-512 build without AMX; a CPU without AMX (an AVX2-only
# EPYC, say) builds native, because the AVX-512 flags would give it a library that dies on an illegal instruction.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CMAKE_ARGS ?= $(if $(shell grep -m1 -ow amx_tile /proc/cpuinfo 2>/dev/null),\
	-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF,-DGGML_NATIVE=ON)

# Order-only on the install: a newer pyproject.toml reinstalls fastdecode, not llama.cpp.
$(VENV)/.bench-installed: | $(VENV)/.installed
	@echo "building llama-cpp-python $(LLAMA_CPP_VERSION) from source with CMAKE_ARGS=$(strip $(LLAMA_CMAKE_ARGS))"
	# --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS and would hand back a wheel built with other flags.
	CMAKE_ARGS="$(strip $(LLAMA_CMAKE_ARGS))" $(PIP) install --no-cache-dir --no-binary llama-cpp-python \
		llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(PIP) install transformers accelerate
	touch $@

bench-deps: $(VENV)/.bench-installed

bench: bench-deps
	$(PY) bench/decode.py --threads $(THREADS)

# The speed lab on the embedded model: a sequential pass and a concurrency sweep over two prompts of each coding-agent
# category, through `fastdecode serve`; writes an HTML report and a JSON summary (docs/lab.md).
LAB_SERVE_ARGS ?= --quant int4 --threads $(THREADS)
LAB_OUT ?= bench/results
.PHONY: lab
lab: install
	$(FASTDECODE) pull smollm2-135m
	$(FASTDECODE) bench -m smollm2-135m --serve-arg "$(LAB_SERVE_ARGS)" --mode sequential --mode sweep \
		--concurrency 1,2,4 --requests-per-user 1 --per-category 2 --max-tokens 128 --label "make lab" \
		--report $(LAB_OUT)/lab.html --json $(LAB_OUT)/lab.json $(LAB_ARGS)

# A trained EAGLE-3-style drafter head for SmolLM2-135M (docs/eagle.md), made by the model itself: its greedy answers
# to generated and held-out bundled prompts plus stdlib sources. Writes head.safetensors, config.json and train.log to
# DRAFTER_DIR (where `--speculate eagle` and `auto+eagle` look); rerun to resume an interrupted run.
DRAFTER_DIR ?= $(or $(FASTDECODE_HOME),$(HOME)/.cache/fastdecode)/drafters/smollm2-135m
DRAFTER_ARGS ?= --chat-prompts 120 --answer-tokens 160 --code-tokens 30000 --epochs 3 --batch 8 --lr 2e-3
.PHONY: drafter
drafter: install
	$(FASTDECODE) pull smollm2-135m
	$(FASTDECODE) train-drafter -m smollm2-135m --out $(DRAFTER_DIR) --threads $(THREADS) $(DRAFTER_ARGS)

# Real coding agents through `fastdecode launch` (docs/agents.md), kept out of `make test`: Claude Code, Codex CLI
# and opencode installed with npm into $(FASTDECODE_HOME)/agents, each run as `fastdecode launch AGENT -m gemma3-270m
# -p TASK` on a one-file task, checking that the user's own configuration files are unchanged. Takes minutes: the
# agents' 7k-20k-token first prompts are prefilled on the CPU.
.PHONY: agents
agents: install
	$(FASTDECODE) pull gemma3-270m
	$(PY) bench/agents.py --threads $(THREADS) $(AGENTS_ARGS)
