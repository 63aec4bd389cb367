# Two entry points, both self-installing: `make demo` and `make test`.
# Two stamps: DEMO_STAMP (torch, the package with its runtime dependencies, and torchft:
# what `moepec demo` needs) and STAMP (every extra: what the tests need). STAMP implies
# DEMO_STAMP: `make test` after `make demo` installs the rest, `make demo` after
# `make test` installs nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
DEMO_STAMP := $(VENV)/.moepec-demo-installed
STAMP := $(VENV)/.moepec-installed

.PHONY: demo test test-busy lint bench bench-check report clean

# torch is pinned: 2.13.0 is the CPU build the set-up path is tested with.
# Byte-compiled at install (pip's default), on purpose: with PYTHONDONTWRITEBYTECODE
# set, as on this machine, nothing is compiled later, and every test process would
# compile torch from source again (a --no-compile install made the suite 16% slower).
# A venv whose full install is current only gets the stamp (dated as STAMP, so that
# STAMP stays up to date).
$(DEMO_STAMP): pyproject.toml
	@if [ $(STAMP) -nt pyproject.toml ]; then touch -r $(STAMP) $@; else \
	  echo "moepec: installing torch 2.13.0 (CPU), moepec and torchft into $(VENV)" \
	    "(once; a few minutes: torch alone is a large download)"; \
	  { test -x $(PY) || python3 -m venv $(VENV); } && \
	  $(PIP) torch==2.13.0 && $(PIP) -e '.[ft]' && touch $@; fi

# The frameworks of the integrations' tests (Hugging Face, Megatron-Core, torchtitan and
# what it imports, DeepSpeed built without ops), and the test tools. megatron-core first, with --no-deps (pyproject.toml,
# megatron); torchtitan last, with --no-deps: its metadata caps datasets below dev's fsspec
# (pyproject.toml, titan-deps).
$(STAMP): $(DEMO_STAMP) pyproject.toml
	@echo "moepec: installing the test extras (transformers, megatron-core, torchtitan," \
	  "deepspeed, lightning, datasets, test tools) into $(VENV)"
	$(PIP) --no-deps megatron-core==0.16.1
	DS_BUILD_OPS=0 $(PIP) -e '.[dev,hf,ft,megatron,titan-deps,deepspeed,lightning]'
	$(PIP) --no-deps torchtitan==0.3.0
	touch $(DEMO_STAMP)
	touch -r $(DEMO_STAMP) $(STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m moepec demo

lint: $(STAMP)
	$(PY) -m ruff check moepec tests benchmarks

# Two pytest-xdist workers, a test file at a time each (tests/conftest.py: longest first).
# A serial run (`$(PY) -m pytest`) runs the same tests.
test: lint
	$(PY) -m pytest -q -ra --durations=30 -n 2 --dist loadfile --no-loadscope-reorder

# The suite beside two CPU-bound busy processes (tests/busy.py): it must stay green on a
# loaded machine.
test-busy: lint
	$(PY) tests/busy.py

bench: $(STAMP)
	$(PY) -m moepec bench size
	$(PY) -m moepec bench overhead

# The benchmarks' speed checks (timing: not in `make test`), on an idle machine, before
# every submission that touches moepec/ram/, store/ or recovery/: the snapshot into shared
# memory and into in-process buffers at >= 80% of a memcpy of the same bytes, the persist
# at >= 80% of a plain fsync'd write of the same bytes, the stitched restore at <= 1.0x a
# full dcp.load at 64 and 128 experts; each within BENCH_TOLERANCE (docs/testing.md).
BENCH_TOLERANCE ?= 0.05
# Both parts run (a failed check of the first does not skip the second); fails if either did.
bench-check: $(STAMP)
	@rc=0; \
	$(PY) -m moepec --log-level WARNING bench overhead --methods none moepec-pec \
	  moepec-pec-shm --check $(BENCH_TOLERANCE) --out runs/bench/check-overhead.json || rc=1; \
	$(PY) -m moepec --log-level WARNING bench restore --experts 64 128 --repeats 5 \
	  --check $(BENCH_TOLERANCE) --out runs/bench/check-restore.json || rc=1; \
	exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info
