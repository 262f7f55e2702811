# One command each on a fresh machine: `make test` and `make demo` create .venv and install into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
FMNIST := /usr/share/datasets/fashion-mnist

.PHONY: test demo lint describe fmnist clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch and torchvision are pinned to the releases this workplace keeps on disk.
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# The embedded dataset: Debian's dataset-fashion-mnist (idx files, no download at run time).
fmnist:
	@if [ ! -f $(FMNIST)/train-images-idx3-ubyte.gz ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q dataset-fashion-mnist; \
	  else sudo apt-get update -q && sudo apt-get install -y -q dataset-fashion-mnist; fi; \
	fi

test: $(VENV)/.installed fmnist
	$(PY) -m pytest -q

demo: $(VENV)/.installed fmnist
	$(PY) -m train --config configs/fmnist_extrapolation.yaml

describe: $(VENV)/.installed
	$(PY) -m vispos describe

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) runs .pytest_cache
