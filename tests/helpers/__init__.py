"""What the tests share that is not a fixture: running merger and the writers as processes (processes.py),
in-process merges (in_process.py), comparing outputs (weights.py), files on disk (files.py), and the helper
modules and scripts particular tests use (one module each, named for what it holds)."""
