# One command each on a fresh machine: `make test` and `make demo` create .venv and install into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
FMNIST := /usr/share/datasets/fashion-mnist

# The oldest timm vispos declares (pyproject.toml), tested by `make test-min`; the oldest transformers the
# transformers adapter declares (the hf extra), tested by `make test-hf-min`.
TIMM_MIN := $(shell sed -n 's/^ *"timm>=\([0-9.]*\)".*/\1/p' pyproject.toml)
TRANSFORMERS_MIN := $(shell sed -n 's/^hf = \["transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)

.PHONY: timm-tests compiled-kernels test test-min test-hf-min wheel-check demo lint describe fmnist clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch and torchvision are pinned to the releases this workplace keeps on disk.
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e '.[train,test,dev]'
	touch $@

# The embedded dataset: Debian's dataset-fashion-mnist (idx files, no download at run time).
fmnist:
	@if [ ! -f $(FMNIST)/train-images-idx3-ubyte.gz ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q dataset-fashion-mnist; \
	  else sudo apt-get update -q && sudo apt-get install -y -q dataset-fashion-mnist; fi; \
	fi

# One pytest-xdist worker per core, each with its share of torch's threads (tests/conftest.py).
test: $(VENV)/.installed fmnist
	$(PY) -m pytest -q -n auto

# The timm floor: the whole suite in a virtual environment layered on $(VENV) (same torch) with
# timm==$(TIMM_MIN) of its own; nothing to do when $(VENV) has that timm already (make test ran at the floor).
test-min: $(VENV)/.installed fmnist
	@if [ "$$($(PY) -c 'import timm; print(timm.__version__)')" = "$(TIMM_MIN)" ]; then \
	  echo "timm $(TIMM_MIN), the floor, is the timm of $(VENV): make test runs the whole suite at the floor"; \
	else \
	  .ci/layered-venv $(VENV)-min $(PY) && \
	  $(VENV)-min/bin/python -m pip install --quiet "timm==$(TIMM_MIN)" && \
	  $(VENV)-min/bin/python -c "import timm; assert timm.__version__ == '$(TIMM_MIN)', timm.__version__" && \
	  $(VENV)-min/bin/python -m pytest -q -n auto -p no:cacheprovider; \
	fi

# The transformers floor: the adapter's tests in a virtual environment layered on $(VENV) with
# transformers==$(TRANSFORMERS_MIN) of its own.
test-hf-min: $(VENV)/.installed
	.ci/layered-venv $(VENV)-hf-min $(PY)
	$(VENV)-hf-min/bin/python -m pip install --quiet "transformers==$(TRANSFORMERS_MIN)"
	$(VENV)-hf-min/bin/python -c "import transformers as t; assert t.__version__.startswith('$(TRANSFORMERS_MIN).'), t.__version__"
	$(VENV)-hf-min/bin/python -m pytest -q -n auto -p no:cacheprovider tests/test_hf_*.py

# The wheel holds vispos only, and README's quick start runs from it in a clean environment (torch reused).
wheel-check: $(VENV)/.installed
	rm -rf dist && mkdir dist
	$(PY) -m pip wheel -v --no-deps --wheel-dir dist . >dist/build.log 2>&1 || (cat dist/build.log; exit 1)
	@if grep -i deprecat dist/build.log; then echo "the wheel build warns of deprecations (above)"; exit 1; fi
	.ci/layered-venv $(VENV)-wheel $(PY)
	$(VENV)-wheel/bin/python -m pip install --quiet dist/vispos-*.whl
	cd dist && ../$(VENV)-wheel/bin/python ../.ci/wheel_check.py vispos-*.whl ../README.md

demo: $(VENV)/.installed fmnist
	$(PY) -m train --config configs/fmnist_extrapolation.yaml

describe: $(VENV)/.installed
	$(PY) -m vispos describe

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) $(VENV)-min $(VENV)-wheel dist runs .pytest_cache

# The compiled path of every 2D scheme (inductor, fullgraph, dynamic shapes; inference and training, a 2-block
# ViT-S): fails when a scheme adds more generated kernels than its budget or recompiles at a new size. The test
# suite checks a representative pair (tests/test_compiled_kernels.py); this covers them all (slow on a CPU).
compiled-kernels: $(VENV)/.installed
	$(PY) -m benchmarks.compiled_work --size 64 --batch 2 --check

# timm's own model tests (tests/test_models.py of a pytorch-image-models checkout at TIMM_SRC, unmodified) on
# patched Swin, Swin V2, BEiT, relpos ViT, ViT and Eva models: benchmarks/timm_suite/plugin.py.
VISPOS_SCHEME ?= inherit
# torchscript tests are left out: vispos does not support torch.jit.script (docs/patching.md).
TIMM_K ?= (test_model_forward or test_model_forward_fx or test_model_forward_intermediates) and not torchscript \
  and (swin_tiny or swinv2_tiny or beit_base_patch16_224 or vit_relpos_small or vit_tiny_patch16_224 or eva02_tiny)
# -P and importlib imports: the checkout gives its tests only, timm itself is the one installed in $(VENV).
timm-tests:
	cd $(TIMM_SRC) && VISPOS_SCHEME=$(VISPOS_SCHEME) PYTHONPATH=$(CURDIR) $(abspath $(PY)) -P -m pytest -q \
	  --import-mode=importlib -p benchmarks.timm_suite.plugin tests/test_models.py -k "$(TIMM_K)"
