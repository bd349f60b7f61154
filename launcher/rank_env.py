"""The environment torchrun gives each rank (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), for
launchers that start merger's ranks themselves: forked on this machine (`launcher.local`) or in a Ray actor."""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path

from .paths import python_path


# Where free ports are drawn from: below the kernel's ephemeral range, from FIRST_PORT up.
FIRST_PORT = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DRAWS = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `host` now: where rank 0 will host torch.distributed's store.

    Drawn from below the kernel's ephemeral range. A port the kernel picked (a bind to port 0) stays free only until
    it hands that port to the next connection or listener of any process on the host, gloo's among them, while the
    ranks take seconds to start: rank 0 then cannot listen (EADDRINUSE), and another rank may join a stranger's store
    and wait in it. A port below the range is taken only by a bind that names it; drawn at random (not from
    `random`, which a test runner seeds alike in every worker), two launchers draw the same one rarely."""
    draw = random.SystemRandom()
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the kernel's pick
        low = FIRST_PORT
    for _ in range(DRAWS if low > FIRST_PORT else 0):
        port = draw.randrange(FIRST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # taken
                continue
            return port
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
