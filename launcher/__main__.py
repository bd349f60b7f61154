"""`python -m launcher slurm|local [options] -- merge <merger args>`."""
import sys

from .cli import main

sys.exit(main())
