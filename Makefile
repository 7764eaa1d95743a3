# make test    -- create .venv if missing, install the project, run the test suite
# make report  -- create .venv if missing, install the project, run the scenario matrix into report/
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: test report lint bench clean

# the exact environment of constraints.txt (pyproject.toml holds the ranges users get; docs/install.md)
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[tf-cpu,torch,tensorboard,dev]'
	@touch $(STAMP)

# three workers on two cores: a third of the suite's test time is subprocesses (torchrun nodes,
# tfpar commands) that a worker waits on; the third worker's tests use that idle CPU
# (docs/benchmarks.md, "Three test workers on two cores")
test: $(STAMP)
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(PY) -m pytest -q -n $${TEST_WORKERS:-3} --dist loadfile --no-loadscope-reorder

report: $(STAMP)
	$(VENV)/bin/tfpar matrix --out report

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/bench_pool.py

clean:
	rm -rf $(VENV) report .pytest_cache .hypothesis
