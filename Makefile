# Two entry points, both self-installing: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moepec-installed

.PHONY: demo test lint bench report clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch is pinned: 2.13.0 is the CPU build the set-up path is tested with.
	# --no-compile: Python compiles what it imports on first use; compiling every module
	# of torch at install took 48 s against 11 s without (measured on this machine).
	$(PY) -m pip install -q --no-compile --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --no-compile --disable-pip-version-check -e '.[dev,hf]'
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
