# `make test` and `make train` work on a fresh machine: they build .venv with the pinned stack first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stack-installed
TORCHAX := $(shell sed -n 's/.*"\(torchax==[^"]*\)".*/\1/p' setup.py)
export PJRT_DEVICE ?= CPU

.PHONY: test train slow install

install: $(STAMP)

# torch_xla's wheel ships an old torchax/ that imports flax: the pinned torchax is force-reinstalled
# after it so the distribution's files win, then checked.
$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --force-reinstall --no-deps $(TORCHAX)
	$(PY) -c "import torchax, torch_xla, jax; print('stack:', 'torchax', torchax.__version__, 'jax', jax.__version__)"
	touch $@

# the test suite and every docstring example of the package, in three processes: XLA:CPU keeps
# every compiled program mapped, and one process compiling the whole suite ran past the kernel's
# memory-map limit (vm.max_map_count 65530: "LLVM compilation error: Cannot allocate memory", then
# a crash)
TESTS_FIRST := $(sort $(wildcard test/test_[a-e]*.py))
TESTS_SECOND := $(sort $(wildcard test/test_[f-o]*.py))
TESTS_THIRD := $(sort $(wildcard test/test_[p-z]*.py))
test: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest -q -m "not slow" $(TESTS_FIRST)
	$(PY) -m pytest -q -m "not slow" $(TESTS_SECOND)
	$(PY) -m pytest -q -m "not slow" $(TESTS_THIRD) --doctest-modules torch_xla_jaxbridge

slow: $(STAMP)
	$(PY) -m pytest -q -m slow test

train: $(STAMP)
	$(PY) -m torch_xla_jaxbridge.recipes.train
