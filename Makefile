# The two commands the README promises: `make demo` and `make test`, both from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
GPUS ?= 2

.PHONY: demo test test-fast test-cluster wheel-check test-min test-extras-min bench bench-cluster bench-sessions bench-session-faults bench-cluster-session-faults bench-live-view screenshots clean

# Bytecode is written as modules are first imported, by the first process that imports them, not compiled ahead
# (compiling all 13,709 modules of the environment at install takes 36 s of one core). Where PYTHONDONTWRITEBYTECODE
# is set, as on this machine, no process would write it, and every kernel, fork server and rank would compile
# torch's modules again (3.5 s of CPU each): the commands here clear it.
export PYTHONDONTWRITEBYTECODE :=

# uv installs: it unpacks wheels on every core (20 s for torch's CUDA build and the rest, against pip's 44 s on one)
# and links them from its cache on later installs (3 s); .ci/uv_options.py hands it pip's configured indexes,
# find-links and constraints, so that it installs what pip would on this machine; .ci/excludes.txt names what it
# leaves out, and why.
INSTALL = $(VENV)/bin/uv pip install --quiet --python $(PY) --excludes .ci/excludes.txt $$($(PY) .ci/uv_options.py $(PY))

$(VENV)/.installed: pyproject.toml .ci/excludes.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet 'uv>=0.9'
	$(INSTALL) -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	TAAS_DEVICE=$${TAAS_DEVICE:-cpu} TAAS_GPUS=$${TAAS_GPUS:-$(GPUS)} $(PY) examples/run_demo.py

# Lint and format (pyproject.toml's [tool.ruff]; `ruff format` and `ruff check --fix` mend what they find), strict
# type checking of src/ (settings in pyproject.toml's [tool.mypy]), the layers between packages
# (pyproject.toml's [tool.importlinter]).
CHECKS = $(VENV)/bin/ruff check src tests benchmarks examples \
	&& $(VENV)/bin/ruff format --check src tests benchmarks examples \
	&& $(PY) -m mypy \
	&& $(VENV)/bin/lint-imports
PYTEST := TAAS_DEVICE=cpu $(PY) -m pytest -q -p no:cacheprovider
# The checks beside the tiers that start no kernel: mypy keeps one core busy for 20 s from a fresh clone, and
# those tiers leave part of the other idle. Fails when either fails.
CHECKS_AND_FAST_TIERS = ( $(CHECKS) ) & checks=$$!; \
	$(PYTEST) -n 2 tests/unit tests/integration; tiers=$$?; \
	wait $$checks && exit $$tiers
E2E_WORKERS ?= 6

# The tiers (docs/architecture.md#the-tests): the checks beside unit and integration on two workers, the
# kernel and browser tiers on E2E_WORKERS (each module in one worker, the modules that mostly wait paired
# with ones that compute: tests/conftest.py; on four workers, waits that met still left the two cores a fifth
# idle, on six they are busy throughout), then the tests whose assertions are about time, with nothing beside
# them. Everything on this machine with no Ray cluster: 15 to 18 minutes here from a fresh clone, the install
# included (the kernel tier alone 10 to 14, its two cores busy throughout: docs/performance.md#the-test-suites-time).
test: $(VENV)/.installed
	$(CHECKS_AND_FAST_TIERS)
	$(PYTEST) -n $(E2E_WORKERS) --dist loadfile -m "not timing and not cluster" tests/e2e
	$(PYTEST) -m timing tests/e2e

# Multi-node runs on real Ray clusters started on this machine (tests/e2e/cluster), on two workers, each with a
# cluster of its own, apart from the other tiers (Ray gives a node's raylet a fixed 30 s to register, which busy
# workers beside it can take): about nine and a half minutes here. CI runs it after
# `make test`; run it after changing anything under launch/cluster/ or what a cluster's nodes run.
test-cluster: $(VENV)/.installed
	$(PYTEST) -n 2 --dist loadfile -m "cluster and not timing" tests/e2e/cluster

# What to run after each edit: the checks beside the tiers that start no kernel and no cluster (pure functions,
# the state machine, the protocol, real supervisors and forks) on two workers: about a minute here.
test-fast: $(VENV)/.installed
	$(CHECKS_AND_FAST_TIERS)

# The built wheel as users install it: in a fresh environment with its declared dependencies only, its kernel
# registered and driven through a 2-rank cell, a fork-server cell, taas.register and %unload_ext
# (.ci/wheel_check.py; CI runs it after `make test`). Leaves nothing behind.
wheel-check: $(VENV)/.installed
	$(PY) .ci/wheel_check.py

# The dependency floors of pyproject.toml, tried: a temporary environment with each runtime dependency at its
# floor runs the test suite, less the tests of optional extras (.ci/test_min; TESTS=... to choose).
test-min:
	PYTHON=$(PYTHON) .ci/test_min

# The optional extras at their floors too (Ray, Lightning, torchvision and the examples' packages), running the
# tests of those extras: the cluster tier, Lightning and the example notebooks (.ci/test_min with EXTRAS;
# EXTRAS="ray lightning" leaves the examples out where torch's floor has no matching torchvision build).
EXTRAS ?= ray lightning examples
test-extras-min:
	PYTHON=$(PYTHON) EXTRAS="$(EXTRAS)" .ci/test_min

$(VENV)/.installed-bench: $(VENV)/.installed
	$(INSTALL) -e '.[bench]'
	touch $@

bench: $(VENV)/.installed-bench
	$(PY) benchmarks/launch.py

bench-cluster: $(VENV)/.installed-bench
	$(PY) benchmarks/cluster.py

bench-sessions: $(VENV)/.installed-bench
	$(PY) benchmarks/sessions.py

bench-session-faults: $(VENV)/.installed-bench
	$(PY) benchmarks/session_faults.py

# The same on a Ray cluster of two nodes started on this machine: a rank's death healed on its node, a resize by a
# node, against starting the session again.
bench-cluster-session-faults: $(VENV)/.installed-bench
	$(PY) benchmarks/cluster_session_faults.py

bench-live-view: $(VENV)/.installed-bench
	$(PY) benchmarks/live_view.py

# The live view's screenshots in docs/images, taken in JupyterLab by tests/e2e/browser (needs Debian's chromium).
screenshots: $(VENV)/.installed
	TAAS_DEVICE=cpu TAAS_SCREENSHOTS=docs/images $(PY) -m pytest -q -p no:cacheprovider tests/e2e/browser/test_browser_view.py

clean:
	rm -rf $(VENV) .demo build src/*.egg-info .mypy_cache
