# Two entry points, both self-installing: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moepec-installed

.PHONY: demo test lint bench report clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch is pinned: 2.13.0 is the CPU build the set-up path is tested with.
	# Byte-compiled at install (pip's default), on purpose: with PYTHONDONTWRITEBYTECODE
	# set, as on this machine, nothing is compiled later, and every test process would
	# compile torch from source again (a --no-compile install made the suite 16% slower).
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check --no-deps megatron-core==0.16.1
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,hf,ft,megatron,titan-deps]'
	# torchtitan's metadata caps datasets below dev's fsspec (pyproject.toml, titan-deps).
	$(PY) -m pip install -q --disable-pip-version-check --no-deps torchtitan==0.3.0
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m moepec demo

lint: $(STAMP)
	$(PY) -m ruff check moepec tests benchmarks

test: lint
	$(PY) -m pytest -q -ra

bench: $(STAMP)
	$(PY) benchmarks/size.py
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
