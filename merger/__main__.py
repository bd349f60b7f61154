"""`python -m merger`."""
import gc
import os
from typing import Callable, NoReturn


def load_command() -> Callable[..., NoReturn]:
    """merger's command (cli.command), imported the way a merge process should import it; `launcher local` calls
    this once and forks its ranks from the result, so they start with torch imported."""
    # merger does no linear algebra: without this, numpy's OpenBLAS starts a thread per core that spins on its own
    # while torch imports (torchrun sets OMP_NUM_THREADS, which OpenBLAS also reads; a plain run does not).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # Importing torch makes a few hundred thousand long-lived objects, and the cyclic collector would walk them
    # over and over while they load (0.3-0.5 s of a 5 s merge on a 2-core machine). It stays off while merger
    # imports; then those objects move to the permanent generation, so later collections skip them.
    gc.disable()
    from .cli import command

    gc.freeze()
    gc.enable()
    return command


if __name__ == "__main__":
    load_command()()
