# `make test` and `make train` work on a fresh machine: they build .venv with the pinned stack first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stack-installed
TORCHAX := $(shell sed -n 's/.*"\(torchax==[^"]*\)".*/\1/p' setup.py)
export PJRT_DEVICE ?= CPU

.PHONY: test train slow install typecheck doctests

install: $(STAMP)

# torch_xla's wheel ships an old torchax/ that imports flax: the pinned torchax is force-reinstalled
# after it so the distribution's files win, then checked.
$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --force-reinstall --no-deps $(TORCHAX)
	$(PY) -c "import torchax, torch_xla, jax; print('stack:', 'torchax', torchax.__version__, 'jax', jax.__version__)"
	touch $@

# mypy, the test suite and every docstring example of the package, as ten processes run two at
# a time (one per core): XLA:CPU keeps compiled programs mapped, and one process compiling the
# whole suite ran past the kernel's memory-map limit (vm.max_map_count 65530: "LLVM compilation
# error: Cannot allocate memory", then a crash). Each group prints its output when it ends, and
# every group runs (-k) so that one run shows every failure.
TEST_GROUPS := a-b c-e f-h i-k l-o p-r s t-z
test: $(STAMP)
	$(MAKE) --no-print-directory -k -j2 --output-sync=target typecheck doctests \
		$(addprefix tests-,$(TEST_GROUPS))

typecheck: $(STAMP)
	$(PY) -m mypy

doctests: $(STAMP)
	$(PY) -m pytest -q --doctest-modules torch_xla_jaxbridge

# test files by their first letter: tests-a-b runs test/test_[a-b]*.py
tests-%: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(sort $(wildcard test/test_[$*]*.py))

slow: $(STAMP)
	$(PY) -m pytest -q -m slow test

train: $(STAMP)
	$(PY) -m torch_xla_jaxbridge.recipes.train
