"""`python -m launcher slurm|local|ray [options] -- merge <merger args>`."""
import sys

from .cli import main

sys.exit(main())
