# The two entry points of the README: `make demo` and `make test`.
# Both create .venv on first use and install the project with its dependencies.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test install bench zoo clean

# setup.py builds the C modules (dispatcher/*.c): a C compiler and the Python
# headers are needed, as on the stock machine (gcc, python3-dev).
$(STAMP): pyproject.toml setup.py $(wildcard dispatcher/*.c dispatcher/devices/sim/*.c)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[all,dev,windtunnel,ray]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/paella demo

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

bench: $(STAMP)
	$(BIN)/python -m paella.benchmarks.bench_sim

# The experiments read the zoo from $PAELLA_ZOO_DIR (default ~/.cache/paella/zoo).
ZOO_DIR ?= $(or $(PAELLA_ZOO_DIR),$(HOME)/.cache/paella/zoo)
zoo: $(STAMP)
	$(BIN)/paella compile --zoo -o $(ZOO_DIR)

clean:
	rm -rf $(VENV) build *.egg-info
