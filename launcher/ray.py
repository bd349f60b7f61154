"""The merger's ranks as Ray actors on a Ray cluster: the one at `--address`/$RAY_ADDRESS, or a local one that
lives as long as the launcher. One rank per placement-group bundle, spread over the nodes as far as they allow
(strategy SPREAD); each actor runs its rank as `python -m merger` with torchrun's environment
(`launcher.ray_rank`), and the launcher watches them with the same rules as `launcher local`
(`launcher.supervise`). Ray is imported here only, and only when this mode runs: `pip install 'merger[ray]'`.

Where rank 0 lands is Ray's choice; its actor names a free port on its node, and that node's address and port
are every rank's MASTER_ADDR/PORT. With --gpus-per-rank each bundle holds GPUs, the merger runs with
`--device cuda`, and the ranks of a node see the GPUs of that node's ranks in local-rank order, so LOCAL_RANK
picks a rank's own GPU as under torchrun.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
import time
from collections import defaultdict

from .paths import python_path
from .rank_env import rank_vars
from .ray_rank import RankProcess
from .supervise import supervise

MISSING = "launcher: error: the ray launcher needs Ray: pip install 'merger[ray]'"
PLACE_NOTICE_S = 10.0
CONNECT_TIMEOUT_S = 10.0
NO_TOKEN = ("the Ray cluster at {address} requires an auth token ({why}): set RAY_AUTH_MODE=token and "
            "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token) to the cluster's token")


class RemoteRank:
    """A rank in its actor, seen as subprocess.Popen sees a process, for `supervise`; each poll also passes on
    what the rank wrote since the last one."""

    def __init__(self, rank: int, actor):
        self.rank, self.actor, self.returncode = rank, actor, None

    def poll(self) -> int | None:
        import ray

        if self.returncode is None:
            try:
                out, err, self.returncode = ray.get(self.actor.poll.remote())
            except ray.exceptions.RayActorError as e:  # its node or worker died; the merger died with it
                print(f"launcher: error: rank {self.rank}'s Ray actor died ({type(e).__name__})", file=sys.stderr)
                self.returncode = 1
                return 1
            for stream, data in ((sys.stdout, out), (sys.stderr, err)):
                if data:
                    stream.buffer.write(data)
                    stream.flush()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.actor.send_signal.remote(sig)  # not waited for: a dead actor has nothing left to stop

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.1)
        return self.returncode


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _error(message: str) -> int:
    print(f"launcher: error: {message}", file=sys.stderr)
    return 1


def _unreachable(address: str) -> str | None:
    """Why nothing answers at a `host:port` address (`ray://host:port` too), or None when something does or the
    address is of another form (`auto`). Ray itself would retry an address that never answers for many minutes."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _refuses_us(address: str) -> bool:
    """Whether the GCS at a `host:port` address turns away this process's auth token (none, or a wrong one). Ray
    itself retries such a connection for 20 s and then says only that it could not connect; its log says
    `InvalidAuthToken`. One GetClusterId call with the token Ray would send answers it: gRPC's UNAUTHENTICATED."""
    import grpc
    from ray._private.authentication.grpc_authentication_client_interceptor import (
        _get_authentication_metadata_tuple)

    _, colon, port = address.rpartition(":")
    if not colon or not port.isdigit():  # ray://, auto: Ray's own errors say what is wrong
        return False
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")
        try:
            call(b"", timeout=CONNECT_TIMEOUT_S, metadata=_get_authentication_metadata_tuple())
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.UNAUTHENTICATED
    return False


def _connect(ray, address: str | None, cpus: float, nproc: int) -> None:
    """Join the cluster at `address`, or start a local one just big enough for the ranks. Actors import this
    copy of `launcher` and `merger`, as the Slurm tasks do: the same path must hold it on every node."""
    runtime_env = {"env_vars": {"PYTHONPATH": python_path(os.environ.get("PYTHONPATH"))}}
    common = dict(runtime_env=runtime_env, log_to_driver=False, logging_level=logging.ERROR)
    if address:
        ray.init(address=address, **common)
    else:
        # "local": a new cluster even where one started by `ray start` runs on this machine, which ray.init()
        # would join instead.
        ray.init(address="local", num_cpus=math.ceil(cpus * nproc), include_dashboard=False, **common)


def _spelled(bundle: dict[str, float]) -> str:
    return " and ".join(f"{count:g} {name}" for name, count in bundle.items())


def _room(ray, bundle: dict[str, float]) -> int:
    """How many bundles the cluster's live nodes could hold if they were idle."""
    room = 0
    for node in ray.nodes():
        if node["Alive"]:
            have = node["Resources"]
            room += min(int(have.get(k, 0) // v) for k, v in bundle.items())
    return room


def _place(ray, nproc: int, bundle: dict[str, float]):
    """A ready placement group of `nproc` bundles, spread over the nodes; None when the cluster is too small."""
    from ray.util.placement_group import placement_group

    if (room := _room(ray, bundle)) < nproc:
        _error(f"the Ray cluster has room for {room} rank(s) of {_spelled(bundle)}, not {nproc}")
        return None
    group = placement_group([bundle] * nproc, strategy="SPREAD")  # SPREAD packs what does not spread
    if not ray.wait([group.ready()], timeout=PLACE_NOTICE_S)[0]:
        print(f"launcher: waiting for the Ray cluster to free {nproc} bundles of {_spelled(bundle)}", flush=True)
        ray.get(group.ready())
    return group


def _start_ranks(ray, group, nproc: int, gpus: int, cpus: float, merger_args: list[str]) -> list[RemoteRank]:
    from ray.util.placement_group import placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor_class = ray.remote(RankProcess)
    actors = [actor_class.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=r)).remote() for r in range(nproc)]
    node_of = placement_group_table(group)["bundles_to_node_id"]
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    master = address[node_of[0]]
    port = ray.get(actors[0].free_port.remote(master))
    on_node = defaultdict(list)  # node -> its ranks, in rank order: their local ranks
    for r in range(nproc):
        on_node[node_of[r]].append(r)
    gpus_of = ray.get([a.gpus.remote() for a in actors]) if gpus else None
    starts = []
    for r, actor in enumerate(actors):
        peers = on_node[node_of[r]]
        variables = rank_vars(r, nproc, master, port, peers.index(r), len(peers))
        if gpus_of:  # the node's ranks' first GPUs, by local rank: LOCAL_RANK indexes them
            variables["CUDA_VISIBLE_DEVICES"] = ",".join(gpus_of[p][0] for p in peers)
        starts.append(actor.start.remote(merger_args, variables, os.getcwd()))
    ray.get(starts)
    return [RemoteRank(r, a) for r, a in enumerate(actors)]


def run_ray(nproc: int, gpus: int, cpus: float, address: str | None, merger_args: list[str]) -> int:
    """Run the merger on `nproc` ranks of a Ray cluster; return the first non-zero exit status, else 0."""
    if nproc < 1 or gpus < 0 or cpus <= 0:
        print("launcher: error: --nproc must be at least 1, --gpus-per-rank at least 0 and --cpus-per-rank more "
              "than 0", file=sys.stderr)
        return 2
    try:
        import ray
    except ImportError:
        print(MISSING, file=sys.stderr)
        return 1
    merger_args = [*merger_args, "--device", "cuda" if gpus else "cpu"]
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    if address and (why := _unreachable(address)):
        return _error(f"could not reach the Ray cluster at {address}: {why}")
    none_found = NO_TOKEN.format(address=address, why="RAY_AUTH_MODE=token, but none was found")
    try:  # AuthenticationError: RAY_AUTH_MODE=token, but no token in any of its places (Ray's check, or ours)
        if address and _refuses_us(address):
            return _error(NO_TOKEN.format(address=address, why="it turned away this process's: none, or a wrong one"))
    except ray.exceptions.AuthenticationError:
        return _error(none_found)
    try:
        try:
            _connect(ray, address, cpus, nproc)
        except ray.exceptions.AuthenticationError:
            return _error(none_found)
        except (ConnectionError, RuntimeError, ValueError) as e:
            where = f"reach the Ray cluster at {address}" if address else "start a local Ray cluster"
            return _error(f"could not {where}: {_first_line(e)}")
        group = _place(ray, nproc, bundle)
        if group is None:
            return 1
        return supervise(_start_ranks(ray, group, nproc, gpus, cpus, merger_args))
    except KeyboardInterrupt:  # before the ranks started; once they run, supervise passes Ctrl-C on
        return 130
    except ray.exceptions.RayError as e:  # an actor that could not start (its runtime environment, its node)
        return _error(f"Ray could not start the ranks: {_first_line(e)}")
    finally:
        ray.shutdown()  # ends the actors (and a local cluster); the placement group goes with the job
