# make demo: set up, write a small real FSDP2 checkpoint, merge it with torchrun, load it and generate.
# make test: set up and run the test suite. Both install everything they need into .venv.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed
DEMO := demo_out

.PHONY: setup test demo bench clean

setup: $(VENV_STAMP)

# torch is pinned to the CPU build that lies on this machine's disk; a bare `torch` would pull CUDA wheels.
$(VENV_STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: setup
	$(PY) -m pytest -q tests

demo: setup
	rm -rf $(DEMO)
	.venv/bin/torchrun --nproc_per_node 2 tests/writers/fsdp_checkpoint.py --arch llama --hidden 64 --layers 2 \
		--out $(DEMO)/global_step_1/actor --reference $(DEMO)/reference
	.venv/bin/torchrun --nproc_per_node 2 -m merger merge --local_dir $(DEMO)/global_step_1/actor \
		--target_dir $(DEMO)/merged
	$(PY) -m merger test --local_dir $(DEMO)/global_step_1/actor --test_hf_dir $(DEMO)/reference
	$(PY) examples/generate.py $(DEMO)/merged

bench: setup
	$(PY) benchmarks/run.py

clean:
	rm -rf .venv $(DEMO) bench_out
