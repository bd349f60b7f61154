"""The process that tests/helpers/warm_merger.py forks merger processes from: it imports merger as `python -m
merger` does (torch included) once, then forks one child per request, each running `merger ARGS` in its own
environment, folder and output files, and reports each child's exit status. It is single-threaded at every
fork, as `launcher local`'s parent is when it forks its ranks.

Requests arrive on a SOCK_SEQPACKET socket (its fd number is argv[1]), one JSON message each with the child's
stdout and stderr fds attached; replies are JSON messages: {"id", "pid"} once forked, {"pid", "code"} once it
has exited (`code` as Popen.returncode: the exit status, or minus the signal). An empty read means the tests'
process is gone, and so is this one.
"""
from __future__ import annotations

import json
import os
import select
import socket
import sys
import tempfile
import traceback

REAP_EVERY_S = 0.02  # how often exited children are looked for between requests


def _run_child(request: dict, out: int, err: int, channel: socket.socket, command):
    """In the forked child: become `python -m merger ARGS` started in request's folder and environment."""
    try:
        channel.close()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # found again from this environment's TMPDIR, as a fresh process finds it
        sys.path[0] = request["cwd"]  # `python -m` puts the folder it starts in first
        sys.argv = [request["argv0"], *request["args"]]
        command(request["args"])  # ends the process with merger's exit status
    except SystemExit as e:  # argparse's --help, --version and its own usage errors end this way
        os._exit(_exit_status(e.code))
    except BaseException:  # as Python ends on an uncaught exception: its traceback, status 1
        traceback.print_exc()
        os._exit(_exit_status(1))


def _exit_status(code) -> int:
    """The status Python exits with for SystemExit(code), its streams flushed first (os._exit does not)."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return 0 if code is None else code if isinstance(code, int) else 1


def serve(channel: socket.socket, command) -> None:
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([channel], [], [], REAP_EVERY_S)
        if ready:
            message, fds, _, _ = socket.recv_fds(channel, 1 << 20, 2)
            if not message:
                return
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(request, *fds, channel, command)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            channel.send(json.dumps({"id": request["id"], "pid": pid}).encode())
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                channel.send(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def main() -> None:
    channel = socket.socket(fileno=int(sys.argv[1]))
    from merger.cli import command, load_library

    load_library()  # as `merger` does before a merge, and `launcher local` before it forks its ranks
    serve(channel, command)


if __name__ == "__main__":
    main()
