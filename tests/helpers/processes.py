"""merger and the test writers as real processes: one, a torchrun gloo group, or the plain env:// ranks that
Slurm tasks and `launcher local` start. Every process runs from the repository's root with it on PYTHONPATH,
so `tests.helpers` and `tests.writers` import there as they do in the tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from launcher.rank_env import free_port  # the tests draw their ports as the launchers do
from tests.helpers import warm_merger
from tests.helpers.hung import DUMP_WAIT_S, TimedOut, end_for_stacks
from tests.helpers.paths import HELPERS, ROOT
from tests.helpers.written_cache import write_through_cache

PAUSED_MERGER = HELPERS / "paused_merger.py"
THREADS_AFTER_MERGE = HELPERS / "threads_after_merge.py"


def subprocess_env(extra: dict | None = None) -> dict:
    """The test environment plus `extra`; a PYTHONPATH given there goes in front of the test one."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    # The training libraries' torch.compile'd functions (megatron-core's fused kernels, torchtitan's flex attention)
    # run eagerly: the same functions, without dynamo tracing them in every rank and inductor compiling C++ for a
    # CPU that runs each once. merger itself compiles nothing.
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a process past its test's timeout shows its stacks (hung.py)
    env["PYTHONWARNINGS"] = "ignore"
    for key, value in (extra or {}).items():
        env[key] = value + os.pathsep + env[key] if key == "PYTHONPATH" else value
    return env


def merger_entry(env: dict | None) -> list[str]:
    """How to start merger: `-m merger`, or the paused_merger.py script when the environment asks for a pause."""
    return [str(PAUSED_MERGER)] if env and "MERGER_TEST_PAUSE_AFTER_BATCH" in env else ["-m", "merger"]


def torchrun_cmd(nproc: int, python: str = sys.executable) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port())]


def run(cmd: list[str], timeout: float = 300, check: bool = True, env: dict | None = None,
        preexec_fn=None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, cwd=cwd, env=subprocess_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=preexec_fn)
    return checked(cmd, wait_ranks([proc], cmd, timeout), check)


def checked(cmd: list, proc: subprocess.CompletedProcess, check: bool) -> subprocess.CompletedProcess:
    """`proc`, or with `check` an AssertionError saying what it printed if it failed."""
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n--- stdout\n{proc.stdout}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run_merger(*args, nproc: int = 1, check: bool = True, timeout: float = 300, env: dict | None = None,
               preexec_fn=None, cwd: Path = ROOT, torchrun: bool = False) -> subprocess.CompletedProcess:
    """`python -m merger ARGS` as one process, or as `nproc` gloo ranks, in folder `cwd`: plain env:// ranks, as
    Slurm tasks and `launcher local` start them, or under torchrun where torchrun is the point (`torchrun=True`:
    its agent, its report, its SIGTERM). A torchrun agent is one more Python start-up that imports torch, about
    2 s of CPU for each multi-rank merge of the suite. Forked warm where its start-up is not the point
    (warm_merger.py says where). The ranks' stdout and stderr come back in rank order, their exit status is the first
    failure's."""
    cmd = [sys.executable, *merger_entry(env), *map(str, args)]
    if not torchrun and preexec_fn is None and merger_entry(env) == ["-m", "merger"]:
        port = free_port()
        envs = [subprocess_env(env if nproc == 1 else rank_env(env, r, nproc, port)) for r in range(nproc)]
        if forker := warm_merger.forker_for(envs[0]):
            return checked(cmd, warm_merger.run_group(forker, cmd, [str(a) for a in args], envs, cwd, timeout), check)
    if nproc > 1 and not torchrun:
        procs = start_ranks(*args, nproc=nproc, env=env, preexec_fn=preexec_fn, cwd=cwd)
        return checked(cmd, wait_ranks(procs, cmd, timeout), check)
    prefix = [sys.executable] if nproc == 1 else torchrun_cmd(nproc)
    return run(prefix + [*merger_entry(env), *map(str, args)], timeout=timeout, check=check, env=env,
               preexec_fn=preexec_fn, cwd=cwd)


def run_merger_leaving_no_thread(*args, nproc: int) -> subprocess.CompletedProcess:
    """Like run_merger under torchrun; then every rank must have returned from merger's main with only its main
    thread left, as the kernel lists the process's threads (tests/helpers/threads_after_merge.py)."""
    proc = run(torchrun_cmd(nproc) + [str(THREADS_AFTER_MERGE), *map(str, args)])
    reports = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                     key=lambda report: report["rank"])
    assert [report["rank"] for report in reports] == list(range(nproc)), proc.stdout
    for report in reports:
        assert report["after"] == report["before"] == ["python"], report
    return proc


def start_merger(*args, nproc: int = 1, env: dict | None = None) -> subprocess.Popen:
    """Like run_merger, but returns the running process (for tests that interrupt a merge)."""
    prefix = [sys.executable] if nproc == 1 else torchrun_cmd(nproc)
    return subprocess.Popen(prefix + [*merger_entry(env), *map(str, args)], cwd=ROOT, env=subprocess_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_group(command_of_rank, nproc: int, env: dict | None = None, preexec_fn=None, cwd: Path = ROOT
                ) -> list[subprocess.Popen]:
    """The `nproc` ranks of a plain env:// gloo group, rank r running `command_of_rank(r)`, as Slurm tasks or
    `launcher local` start them: no torchrun agent, rank 0 hosts the store."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        procs.append(subprocess.Popen(command_of_rank(rank), cwd=cwd, env=subprocess_env(rank_env(env, rank, nproc, port)),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=preexec_fn))
    return procs


def rank_env(env: dict | None, rank: int, nproc: int, port: int) -> dict:
    """`env` with what rank `rank` of an `nproc`-rank env:// group on the loopback reads."""
    return {**(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def start_ranks(*args, nproc: int, env: dict | None = None, wrap: dict | None = None,
                args_of_rank: dict | None = None, preexec_fn=None, cwd: Path = ROOT) -> list[subprocess.Popen]:
    """`python -m merger ARGS` as the ranks of a plain env:// group (start_group). `wrap` maps a rank to a command
    prefix (e.g. `unshare ...`), `args_of_rank` a rank to arguments of its own in place of ARGS."""
    def command(rank: int) -> list[str]:
        own = (args_of_rank or {}).get(rank, args)
        return [*(wrap or {}).get(rank, []), sys.executable, *merger_entry(env), *map(str, own)]

    return start_group(command, nproc, env, preexec_fn, cwd)


def wait_ranks(procs: list[subprocess.Popen], args, timeout: float = 120) -> subprocess.CompletedProcess:
    """Every rank waited for, their pipes drained side by side (a rank blocked on a full pipe would stall its peers
    in a collective); their stdout and stderr in rank order and the first failure's exit status. Past `timeout`,
    every rank dumps its stacks and is killed, and TimeoutExpired raised with them (hung.py)."""
    with ThreadPoolExecutor(len(procs)) as pool:
        waits = [pool.submit(p.communicate) for p in procs]
        if futures.wait(waits, timeout).not_done:
            ended = end_for_stacks([p.pid for p in procs], lambda: futures.wait(waits, DUMP_WAIT_S).not_done)
            raise TimedOut(args, timeout, [w.result()[1] if ended else "" for w in waits],
                           "".join(w.result()[0] for w in waits) if ended else None)
        outs = [w.result() for w in waits]
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(args, code, "".join(o for o, _ in outs), "".join(e for _, e in outs))


def writer_module(script: str) -> list[str]:
    """`-m tests.writers.NAME` for the writer `NAME.py`: the writers import one another as modules of
    tests.writers, so they run as modules, not as scripts."""
    return ["-m", f"tests.writers.{Path(script).stem}"]


def run_writer(script: str, *args, nproc: int = 1, env: dict | None = None, python: str = sys.executable,
               per_interpreter: bool = False) -> None:
    """The test writer tests/writers/SCRIPT as one process, or as `nproc` gloo ranks of a plain env:// group (the
    writers read their rank and world from the environment, as under torchrun, whose agent would only add a
    start-up), run by `python` (another venv's, for the writers tests/helpers/writers312.py runs); its output copied
    from the clone's cache of written checkpoints when that has it (tests/helpers/written_cache.py, which says what
    `per_interpreter` is for)."""
    command = [python, *writer_module(script), *map(str, args)]

    def write() -> subprocess.CompletedProcess:
        if nproc == 1:
            return run(command, env=env)
        return checked(command, wait_ranks(start_group(lambda rank: command, nproc, env), command, timeout=300), True)

    write_through_cache(script, args, nproc, env, python, per_interpreter, write)
