"""`python -m launcher ray`: merges on a local Ray cluster that the launcher itself starts (ray.init() in its
process, kept on 127.0.0.1 by RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, gone when the launcher ends; never `ray stop`,
which would end every Ray process on the machine), and on a token-auth head node the module starts with `ray start
--head --block` and ends by its process group. The oracle is the model's own save_pretrained output."""
from __future__ import annotations

import contextlib
import os
import secrets
import socket
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.in_process import single_error_line
from tests.helpers.paths import ROOT
from tests.helpers.processes import free_port, subprocess_env
from tests.helpers.reliability import SMALL, WORLD, lost_line
from tests.helpers.weights import assert_same_weights

pytest.importorskip("ray", reason="the ray launcher's tests need Ray: pip install 'merger[ray]'")
pytestmark = [pytest.mark.infra, pytest.mark.slow]

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
RAY_ENV_OFF = ["RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"]  # nor the caller's token


def _ray_env() -> dict:
    env = subprocess_env(RAY_ENV)
    for key in RAY_ENV_OFF:
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def checkpoint(fsdp_checkpoint):
    """Big enough (6 layers, SMALL's many batches) that a rank can be killed in the middle of its merge."""
    return fsdp_checkpoint("llama", WORLD, extra=("--layers", "6", "--hidden", "64"))


def launcher_ray(*args) -> list[str]:
    return [sys.executable, "-m", "launcher", "ray", "--nproc", str(WORLD), "--", *map(str, args)]


def test_launcher_ray_merges_on_a_local_cluster(checkpoint, tmp_path):
    actor, reference = checkpoint
    proc = subprocess.run(launcher_ray("merge", "--local_dir", actor, "--target_dir", tmp_path / "out"), cwd=ROOT,
                          env=_ray_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert f"{WORLD} merge ranks" in proc.stderr, proc.stderr  # one group of WORLD ranks, not WORLD single merges
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)


def test_launcher_ray_bad_input_is_one_line(tmp_path):
    missing = tmp_path / "no_such_actor"
    proc = subprocess.run(launcher_ray("merge", "--local_dir", missing, "--target_dir", tmp_path / "out"), cwd=ROOT,
                          env=_ray_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == os.EX_NOINPUT, proc.stderr
    assert str(missing) in single_error_line(proc.stderr) and "Traceback" not in proc.stderr, proc.stderr


def _rank_pid(rank: int, target: Path) -> int | None:
    """The pid of the `python -m merger` process of merge rank `rank` writing `target` (under Ray it is no child
    of the launcher: its actor's worker is a child of Ray's raylet)."""
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            if cmdline[1:3] == [b"-m", b"merger"] and str(target).encode() in cmdline:
                if f"RANK={rank}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                    return int(proc.name)
    return None


def test_launcher_ray_ends_the_job_when_a_rank_is_killed(checkpoint, tmp_path):
    # As test_lost_ranks.py's test_rank_killed_during_an_exchange: once the staging folder exists, rank 1 is
    # stopped (its peer goes on into the next collective and waits there), then killed.
    actor = checkpoint[0]
    out, stage = tmp_path / "out", tmp_path / ".out.merger-partial"
    launcher = subprocess.Popen(launcher_ray("merge", "--local_dir", actor, "--target_dir", out, *SMALL), cwd=ROOT,
                                env=_ray_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (stage.exists() and (victim := _rank_pid(1, out))):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.05)
    os.kill(victim, signal.SIGSTOP)
    time.sleep(1)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    _, err = launcher.communicate(timeout=60)
    assert time.monotonic() - killed < 15 and launcher.returncode != 0, err
    assert [line for line in err.splitlines() if line.startswith("merger: error:")] == [lost_line(1, victim)], err
    assert not out.exists() and not stage.exists()


def test_launcher_ray_refuses_an_address_where_nothing_answers(capsys):
    from launcher.cli import main

    address = f"127.0.0.1:{free_port()}"
    assert main(["ray", "--address", address, "--", "merge", "--local_dir", "ckpt", "--target_dir", "out"]) == 1
    assert capsys.readouterr().err == f"launcher: error: could not reach the Ray cluster at {address}: " \
                                      f"Connection refused\n"


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    """A head node with token auth, as `ray start --head` makes one (--block: its processes are this process
    group's, ended with it); yields its address and token."""
    token, port = secrets.token_hex(16), free_port()
    env = {**_ray_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                             "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", str(WORLD),
                             "--ray-client-server-port", str(free_port()), "--include-dashboard", "false",
                             "--disable-usage-stats", "--temp-dir", str(tmp_path_factory.mktemp("ray"))],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert head.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", token
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # Ray's processes end their own way; what is left after 10 s is killed
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait()


def test_launcher_ray_joins_a_token_auth_cluster_with_its_token(checkpoint, token_cluster, tmp_path):
    (actor, reference), (address, token) = checkpoint, token_cluster
    env = {**_ray_env(), "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    proc = subprocess.run(launcher_ray("merge", "--local_dir", actor, "--target_dir", tmp_path / "out"), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert_same_weights(tmp_path / "out", reference, torch.bfloat16)


@pytest.mark.parametrize("auth", [{}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-token"},
                                  {"RAY_AUTH_MODE": "token", "HOME": "{empty}"}],
                         ids=["no-token", "wrong-token", "token-mode-no-token-anywhere"])
def test_launcher_ray_says_a_token_auth_cluster_wants_its_token(token_cluster, auth, tmp_path):
    # Ray alone would retry for 20 s and then say only that it could not connect; the subprocess timeout is far
    # below what that plus a merge would take. "{empty}": a home without ~/.ray/auth_token, the last place Ray
    # looks for a token (after RAY_AUTH_TOKEN and RAY_AUTH_TOKEN_PATH, which _ray_env removes), whatever the
    # home of the user running the tests holds.
    address = token_cluster[0]
    (tmp_path / "home").mkdir()
    auth = {key: value.replace("{empty}", str(tmp_path / "home")) for key, value in auth.items()}
    proc = subprocess.run(launcher_ray("merge", "--local_dir", tmp_path, "--target_dir", tmp_path / "out"), cwd=ROOT,
                          env={**_ray_env(), "RAY_ADDRESS": address, **auth}, capture_output=True, text=True,
                          timeout=15)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0].startswith(f"launcher: error: the Ray cluster at {address} requires an auth token"), errors
    assert "RAY_AUTH_TOKEN" in errors[0], errors
    if "HOME" in auth:  # said as what it is, where Ray's own check raised out of ours with a traceback before
        assert "(RAY_AUTH_MODE=token, but none was found)" in errors[0], errors
