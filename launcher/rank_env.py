"""The environment torchrun gives each rank (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), for
launchers that start merger's ranks themselves: forked on this machine (`launcher.local`) or in a Ray actor."""
from __future__ import annotations

import os
import socket

from .paths import python_path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `host` now: where rank 0 will host torch.distributed's store."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_vars(rank: int, world: int, master_addr: str, port: int, local_rank: int, local_world: int
              ) -> dict[str, str]:
    return dict(MASTER_ADDR=master_addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_world))


def rank_env(variables: dict[str, str]) -> dict[str, str]:
    """This process's environment with a rank's variables, and this copy of the code first on PYTHONPATH."""
    env = dict(os.environ, **variables)
    env["PYTHONPATH"] = python_path(env.get("PYTHONPATH"))
    return env
