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
	$(FASTDECODE) generate -m smollm2-135m --chat --threads $(THREADS) --max-tokens 200 \
		-p "Write a Python function that checks whether a string is a palindrome, with a docstring."

test: test-install
	$(FASTDECODE) pull smollm2-135m
	$(FASTDECODE) pull gemma3-270m
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info
