# One command each on a fresh machine: `make test` and `make demo` create .venv and install into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
FMNIST := /usr/share/datasets/fashion-mnist

# The oldest timm vispos declares (pyproject.toml), tested by `make test-min`; the oldest transformers the
# transformers adapter declares (the hf extra), tested by `make test-hf-min`; the oldest diffusers the diffusers
# adapter declares (the diffusers extra), tested by `make test-diffusers-min`.
TIMM_MIN := $(shell sed -n 's/^ *"timm>=\([0-9.]*\)".*/\1/p' pyproject.toml)
TRANSFORMERS_MIN := $(shell sed -n 's/^hf = \["transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
DIFFUSERS_MIN := $(shell sed -n 's/^diffusers = \["diffusers>=\([0-9.]*\)".*/\1/p' pyproject.toml)

.PHONY: hf-suite timm-tests suites-ci compiled-kernels test test-slow test-min test-hf-min test-diffusers-min wheel-check demo lint describe fmnist clean

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

# The diffusers floor: the adapter's tests in a virtual environment layered on $(VENV) with
# diffusers==$(DIFFUSERS_MIN) of its own.
test-diffusers-min: $(VENV)/.installed
	.ci/layered-venv $(VENV)-diffusers-min $(PY)
	$(VENV)-diffusers-min/bin/python -m pip install --quiet "diffusers==$(DIFFUSERS_MIN)"
	$(VENV)-diffusers-min/bin/python -c "import diffusers as d; assert d.__version__.startswith('$(DIFFUSERS_MIN).'), d.__version__"
	$(VENV)-diffusers-min/bin/python -m pytest -q -n auto -p no:cacheprovider tests/test_diffusers_*.py

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
	rm -rf $(VENV) $(VENV)-min $(VENV)-hf-min $(VENV)-diffusers-min $(VENV)-wheel dist runs .pytest_cache

# The compiled path of every 2D scheme (inductor, fullgraph, dynamic shapes; inference, and training for the
# rotations and the masks; a 2-block ViT): fails when a scheme adds more generated kernels than its budget, differs
# from eager or recompiles at a new size (tests/test_compiled_schemes.py, marked `compiled`, which the test suite
# leaves out; the suite checks a representative pair, tests/test_compiled_kernels.py). The table of
# docs/performance.md: `$(PY) -m benchmarks.compiled_work --size 64 --batch 2`.
# The slow checks make test leaves out (a CI step): exports at dynamic sizes, DDP / FSDP in several processes, the
# GPU check's dry runs, inductor's kernel budget per scheme.
test-slow: $(VENV)/.installed fmnist
	$(PY) -m pytest -q -n auto -p no:cacheprovider -m slow

compiled-kernels: $(VENV)/.installed
	$(PY) -m pytest -q -n auto -p no:cacheprovider -m compiled tests/test_compiled_schemes.py tests/test_compiled_resample.py

# The hosts' own test suites on vispos-patched models, each test unpatched, with the model's own positions
# inherited and with a replacing scheme; the tests come from the sdist of the installed release (fetched by pip
# into .cache/ at the first run, never into the repository: benchmarks/suite_sources.py). Each prints per family
# and scheme passed / failed / skipped unpatched and patched, and fails on a test passing unpatched only that is
# not listed with its reason. `make suites-ci` runs the named subset CI runs; the targets below run the whole.
# They run in any interpreter that has vispos's dependencies (`make timm-tests PY=/path/to/python`); only with
# $(VENV)'s own python do they build $(VENV) first.
SUITE_VENV := $(if $(filter $(abspath $(VENV)/bin/python),$(abspath $(PY))),$(VENV)/.installed)
# the interpreter as a path that holds after `cd` (a bare name is looked up on PATH)
PY_CMD := $(if $(findstring /,$(PY)),$(abspath $(PY)),$(PY))
# transformers: tests/test_modeling_common.py's ModelTesterMixin on every supported family (benchmarks/hf_suite/).
HF_SUITE_K ?=
# the subset CI runs: ViT (a learned table), DINOv3 (RoPE) and Qwen2-VL's tower (packed frames), without the 24
# dtype / padding variants of the eager-vs-sdpa comparison
HF_SUITE_CI_K := (Test_vit__ or Test_dinov3__ or Test_qwen2_vl__) and not eager_matches_sdpa_inference
hf-suite: $(SUITE_VENV)
	$(PY) -m pytest -q -p no:xdist -p no:cacheprovider -p benchmarks.hf_suite.plugin -o addopts="" \
	  benchmarks/hf_suite/test_common.py $(if $(HF_SUITE_K),-k "$(HF_SUITE_K)")

# timm: tests/test_models.py on patched ViT, DeiT, Eva, Swin, Swin V2, Swin V2-CR, BEiT, relpos ViT and SAM models
# (benchmarks/timm_suite/plugin.py; -P and importlib imports: the sdist gives its tests only, timm itself is the
# installed one). VISPOS_SCHEMES and VISPOS_MODELS (comma-separated) narrow it.
TIMM_K ?=
# the subset CI runs: a ViT and an EVA-02 (RoPE), the forward and intermediates tests
TIMM_CI_MODELS := vit_tiny_patch16_224,eva02_tiny_patch14_224
TIMM_CI_K := (test_model_forward or test_model_forward_intermediates) and not torchscript and not fx
timm-tests: $(SUITE_VENV)
	cd $$($(PY) -m benchmarks.suite_sources timm) && PYTHONPATH=$(CURDIR) $(PY_CMD) -P -m pytest -q \
	  -p no:xdist -p no:cacheprovider --import-mode=importlib -p benchmarks.timm_suite.plugin -o addopts="" \
	  tests/test_models.py $(if $(TIMM_K),-k "$(TIMM_K)")

suites-ci: $(SUITE_VENV)
	$(MAKE) hf-suite HF_SUITE_K="$(HF_SUITE_CI_K)"
	VISPOS_MODELS=$(TIMM_CI_MODELS) $(MAKE) timm-tests TIMM_K="$(TIMM_CI_K)"
