# make demo: set up, write a small real FSDP2 checkpoint, merge it with torchrun, load it and generate.
# make test: set up and run the test suite. Both install everything they need into .venv (VENV).
# make test MARK=EXPR: one slice of it, by marker (unit, slow, infra, interpreter: docs/development.md, "Test groups").
#   CI's second interpreter runs `make test MARK=interpreter PYTHON=/usr/bin/python3 VENV=.venv-debian`.
# make unit: only the unit tests (marked `unit`, in tests/unit): the engine on synthetic checkpoints, in seconds.
# make bench-scale: plan (inspect) a synthesized 671B-shaped DCP checkpoint at FRACTIONS of its size, metadata only
#   (SCALE_FLAGS="--format torch_dist": the same model as Megatron-LM's torch_dist save).
# Another interpreter gets its own venv: make test PYTHON=/usr/bin/python3 VENV=.venv-debian
# make azurite: the Azure Blob emulator the az:// tests start (npm's azurite, into .azurite/); skipped without npm.
# make writers312: the venv of the test writers that need Python >= 3.12 (megatron-core 0.19), shared by every VENV.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
VENV_STAMP := $(VENV)/.installed
DEMO := demo_out

# Python writes the bytecode it compiles, whatever the environment says (machines like CI's set
# PYTHONDONTWRITEBYTECODE=1): the venvs are installed without it (pip's --no-compile: minutes less per venv), and the
# suite starts about a thousand processes, each of which would otherwise compile torch's and merger's sources anew.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup writers312 azurite test unit demo bench bench-scale clean

setup: $(VENV_STAMP)

# torch is pinned to the CPU build that lies on this machine's disk; a bare `torch` would pull CUDA wheels.
# llmcompressor writes the NVFP4 release a test checks merger against (its model_free_ptq); it goes in without its
# dependencies, which pin transformers <= 5.17: FORMATS.md verified it with transformers 5.24 and compressed-tensors
# 0.20, which the test extras pin. merger itself never imports it.
$(VENV_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --upgrade pip
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[test]'
	$(PY) -m pip install -q --no-compile --no-deps llmcompressor==0.14.0.1
	touch $@

# megatron-core 0.17 and later (DeepSeek Sparse Attention) need Python >= 3.12: tests/writers/megatron_dsa.py runs
# from this venv, whatever VENV is. Without a 3.12 it is not built and those tests skip. Which 3.12 the machine has is
# decided in one place, tests/helpers/python_of_version.py (pyenv's 3.12.x through $PYENV_ROOT or ~/.pyenv, else
# python3.12 on PATH), which the tests ask too.
WRITERS312 := .venv-writers312
PYTHON312 ?= $(shell $(PYTHON) tests/helpers/python_of_version.py 3.12)

writers312: $(WRITERS312)/.installed

# requirements312-nodeps.txt goes in without its packages' dependencies (Megatron-Bridge pins transformers <= 5.12.1;
# the writers import only the modules that run here on 5.24: shared/FORMATS.md).
$(WRITERS312)/.installed: tests/writers/requirements312.txt tests/writers/requirements312-nodeps.txt
	@if [ -z "$(PYTHON312)" ]; then echo "make: no Python 3.12 (python3.12 or pyenv's 3.12.x): $(WRITERS312) not built, the megatron-core 0.19 tests skip"; \
	else set -e; $(PYTHON312) -m venv $(WRITERS312); $(WRITERS312)/bin/python -m pip install -q --no-compile -r $<; \
	$(WRITERS312)/bin/python -m pip install -q --no-compile --no-deps -r tests/writers/requirements312-nodeps.txt; touch $@; fi

# tests/test_object_storage.py reads az:// from Azurite, an npm package: installed into .azurite/ (about a minute,
# most of it npm fetching its dependencies), once. Without node and npm it is not, and the az:// tests skip.
AZURITE_VERSION := 3.37.0
azurite: .azurite/.installed-$(AZURITE_VERSION)

.azurite/.installed-$(AZURITE_VERSION):
	@if ! command -v npm >/dev/null || ! command -v node >/dev/null; then echo "make: no node and npm: Azurite not installed, the az:// tests skip"; \
	else set -e; rm -rf .azurite; npm install --prefix .azurite --no-audit --no-fund --silent azurite@$(AZURITE_VERSION); touch $@; fi

# The suite runs on one pytest-xdist worker per core (WORKERS=1 for one process). --dist loadfile keeps each module
# on one worker, so its module fixtures and its service (the Slurm cluster, the Ray cluster) start once. (xdist 3.8's
# loadgroup does not group under pytest 9.2, whose nodeid no longer reads the _nodeid xdist sets.)
WORKERS ?= auto
MARK ?=
# The two venvs are installed side by side, one per core (pip unpacks on one), and Azurite beside them: npm mostly
# waits on the network.
test:
	@$(MAKE) --no-print-directory -j3 setup writers312 azurite
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile $(if $(MARK),-m "$(MARK)") tests

unit: setup
	$(PY) -m pytest -q -m unit tests/unit

demo: setup
	rm -rf $(DEMO)
	$(VENV)/bin/torchrun --nproc_per_node 2 -m tests.writers.fsdp_checkpoint --arch llama --hidden 64 --layers 2 \
		--out $(DEMO)/global_step_1/actor --reference $(DEMO)/reference
	$(VENV)/bin/torchrun --nproc_per_node 2 -m merger merge --local_dir $(DEMO)/global_step_1/actor \
		--target_dir $(DEMO)/merged
	$(PY) -m merger test --local_dir $(DEMO)/global_step_1/actor --test_hf_dir $(DEMO)/reference
	$(PY) examples/generate.py $(DEMO)/merged

# make bench SIZES=16GB: checkpoints of those sizes (or layer counts: SIZES=7,19), BENCH_FLAGS for run.py's others.
SIZES ?= 7,19
BENCH_FLAGS ?=
bench: setup
	$(PY) benchmarks/run.py --sizes $(SIZES) $(BENCH_FLAGS)

# Planning from metadata alone at fractions of a 671B DCP checkpoint (sparse files under /tmp): FRACTIONS=1/8,1/4,1/2,1
FRACTIONS ?= 1/8
SCALE_FLAGS ?=
bench-scale: setup
	$(PY) benchmarks/scale.py --fractions $(FRACTIONS) $(SCALE_FLAGS)

clean:
	rm -rf .venv .venv-* $(VENV) $(DEMO) bench_out .test-cache .azurite
