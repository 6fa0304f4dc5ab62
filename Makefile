# `make demo` and `make test` set everything up on a fresh machine (Python 3.11+
# and make are all they need): a virtual environment in .venv with ddtop
# installed in editable mode, torch and torchvision from pip.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
WORLD_SIZE ?= 8
# pytest-xdist: a module's tests on one worker (its module fixtures start once).
# make test runs the suite on 2 workers (the in-process tier too), then, alone, the
# few tests marked `timing` whose assertions are measured durations a loaded machine
# would stretch (docs/development.md#checks). PYTEST_WORKERS=0: all serially.
PYTEST_WORKERS ?= 2
PYTEST_FAST_WORKERS ?= 2
XDIST = -n $(1) --dist loadfile --no-loadscope-reorder

.PHONY: help install demo test test-fast pytest-fast lint typecheck pytest fuzz bench compat clean

help:
	@echo "make demo       set up .venv, then train 8 ranks on the built-in dataset and watch them in ddtop"
	@echo "make test       set up .venv, then run ruff, mypy and the test suite"
	@echo "make test-fast  ruff, mypy and the in-process tests only (under a minute): while editing"
	@echo "                 (pytest workers: PYTEST_FAST_WORKERS=2 for test-fast, PYTEST_WORKERS=2 for test; 0: serial)"
	@echo "make fuzz       the decoders' property-based fuzzing, long (20,000 examples each; make test runs 110)"
	@echo "make bench      benchmarks: start-up, a rank's garbage collector, start-up hook, telemetry, dashboard, own scripts, collectives, a desync named, the Flight Recorder, a bundle of evidence, a straggler's host readings, framework callbacks, FSDP2 scripts, comm timing, sockets, strategies, faults, TensorBoard files, Prometheus metrics and scrape times, a browser's first table, a rank on the wire, a big job's summary, the rank map, a hub at 1,024 to 16,384 ranks (bench/)"
	@echo "make compat     the process tests against torch's oldest and newest, in venvs of their own (.compat/; GBs; COMPAT_TORCH=\"2.13.0 2.15.0\")"
	@echo "make clean      remove .venv and caches (runs/ is kept)"

$(STAMP): pyproject.toml setup.py
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "ddtop needs Python 3.11 or newer; run make with PYTHON=python3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing ddtop with torch and torchvision into $(VENV) (several GB, a minute or two)..."
	$(BIN)/python -m pip install --progress-bar off -e '.[train,test]'
	touch $(STAMP)

install: $(STAMP)

# In a terminal: a detached 8-rank run and the dashboard on it (q leaves the run
# going). Without one (CI, a pipe): the same run in the foreground, headless.
demo: $(STAMP)
	@if [ -t 0 ] && [ -t 1 ]; then \
		$(BIN)/ddtrain start --world-size $(WORLD_SIZE) && \
		echo "opening ddtop: q detaches (the run goes on), x stops the run, ? for help" && \
		sleep 1 && $(BIN)/ddtop; \
		echo "re-attach: $(BIN)/ddtop    status: $(BIN)/ddtrain status    stop: $(BIN)/ddtrain stop"; \
	else \
		$(BIN)/ddtrain start --foreground --headless --world-size $(WORLD_SIZE); \
	fi

lint: $(STAMP)
	$(BIN)/ruff check .

# mypy cannot follow the editable install's import hook, so it checks a tree
# of links that spells the installed names (ddtop.training -> training/, ...,
# ddtop -> api/).
# Its cache is kept beside the tree (.mypy_cache), so a second run checks only what changed.
typecheck: $(STAMP)
	rm -rf .typecheck && mkdir -p .typecheck/ddtop
	for part in core training daemon dashboard; do ln -s ../../$$part .typecheck/ddtop/$$part; done
	for module in api/*.py; do ln -s ../../$$module .typecheck/ddtop/$${module#api/}; done
	cd .typecheck && ../$(BIN)/mypy --config-file ../pyproject.toml --cache-dir ../.mypy_cache -p ddtop

pytest: $(STAMP)
	$(BIN)/python -m pytest $(call XDIST,$(PYTEST_WORKERS)) -m "not timing"
	$(BIN)/python -m pytest -m timing

test: lint typecheck pytest

# The edit loop's tier: no test that starts a process (tests/conftest.py enforces the mark),
# nor one marked slow (the 16,384-rank map driven key by key: 19 s alone; heartbeats
# timed a second apart).
# ruff and mypy run beside the tests (their output kept whole, each after it ends).
test-fast: $(STAMP)
	@$(MAKE) --no-print-directory -j3 --output-sync=target lint typecheck pytest-fast

pytest-fast: $(STAMP)
	DDTOP_FUZZ_EXAMPLES=25 $(BIN)/python -m pytest -q -m "not processes and not slow" -p no:cacheprovider \
		$(call XDIST,$(PYTEST_FAST_WORKERS))

# The fuzzing that make test runs in seconds, at length: every decoder of what the
# daemon receives, 20,000 examples each from the fixed seed (tests/test_fuzz.py).
fuzz: $(STAMP)
	DDTOP_FUZZ_EXAMPLES=20000 $(BIN)/python -m pytest tests/test_fuzz.py -q

bench: $(STAMP)
	$(BIN)/python bench/startup.py
	$(BIN)/python bench/gcfreeze.py
	$(BIN)/python bench/starthook.py
	$(BIN)/python bench/telemetry.py
	$(BIN)/python bench/dashboard.py
	$(BIN)/python bench/own_script.py
	$(BIN)/python bench/collectives.py
	$(BIN)/python bench/desync.py
	$(BIN)/python bench/flightrec.py
	$(BIN)/python bench/evidence.py
	$(BIN)/python bench/hostreadings.py
	$(BIN)/python bench/frameworks.py
	$(BIN)/python bench/fsdp2.py
	$(BIN)/python bench/comm_timing.py
	$(BIN)/python bench/sockets.py
	$(BIN)/python bench/strategies.py
	$(BIN)/python bench/faults.py
	$(BIN)/python bench/tensorboard_files.py
	$(BIN)/python bench/metrics.py
	$(BIN)/python bench/scrapes.py
	$(BIN)/python bench/serve_page.py
	$(BIN)/python bench/rank_wire.py
	$(BIN)/python bench/summary.py
	$(BIN)/python bench/rankmap.py
	$(BIN)/python bench/hub.py
	$(BIN)/python bench/hubscale.py

# torch's oldest release that pyproject claims and the newest, each in a venv of its own
# (.compat/torch-<version>/, ddtop installed as make test installs it; one already there
# with that torch is reused), then the tests that start processes (-m processes, on
# make test's xdist workers, its `timing` tests alone after) against each; a table at the
# end. Not part of make test. These machines cap pip at torch<=2.14.1 through a
# constraints file named in pip's global configuration; compat/run.py lifts it for the
# pip commands of its own venvs only, with PIP_CONSTRAINT=/dev/null (an empty
# PIP_CONSTRAINT= is ignored by pip, so the cap would stay). PyPI's torch wheels pull
# NVIDIA's CUDA libraries: several GB a venv. COMPAT_TESTS: some test files instead of
# the whole tier (docs/development.md#torchs-oldest-and-newest).
COMPAT_TORCH ?= 2.13.0 2.15.0
COMPAT_TESTS ?=
compat:
	$(PYTHON) compat/run.py --python $(PYTHON) --torch "$(COMPAT_TORCH)" \
		--xdist "$(call XDIST,$(PYTEST_WORKERS))" $(COMPAT_TESTS)

clean:
	rm -rf $(VENV) .typecheck .mypy_cache .ruff_cache .pytest_cache *.egg-info
