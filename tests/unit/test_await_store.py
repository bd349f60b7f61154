"""A rank other than 0 waits for rank 0's store before it joins the group (engine/dist.py await_store).

The oracle is torch's own TCPStore, the server rank 0 starts: await_store must return only once it listens, and
soon after; a store it has touched must still serve torch's clients; with no store it gives up at its timeout.
"""
import datetime
import socket
import threading
import time

import pytest
import torch.distributed as dist

from merger.engine.dist import await_store

pytestmark = pytest.mark.unit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store_in_half_a_second(port: int, stores: list, started: list) -> threading.Thread:
    """Rank 0, starting torch's store on `port` half a second from now; `started` gets the time it listened."""
    def start_store():
        time.sleep(0.5)
        stores.append(dist.TCPStore("127.0.0.1", port, 2, True, datetime.timedelta(seconds=10), wait_for_workers=False))
        started.append(time.monotonic())

    rank0 = threading.Thread(target=start_store)
    rank0.start()
    return rank0


def test_returns_once_the_store_listens_and_the_store_still_serves():
    port, started, stores = _free_port(), [], []
    rank0 = _store_in_half_a_second(port, stores, started)
    await_store("127.0.0.1", port, timeout_s=20)
    returned = time.monotonic()
    rank0.join()
    # The server listens inside the TCPStore constructor, just before `started` is taken.
    assert returned >= started[0] - 0.25
    assert returned - started[0] < 2.0
    client = dist.TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=10))
    stores[0].set("from rank 0", "up")
    assert client.get("from rank 0") == b"up"


def test_gives_up_at_its_timeout_when_nothing_listens():
    port = _free_port()
    t = time.monotonic()
    await_store("127.0.0.1", port, timeout_s=0.3)
    assert 0.25 <= time.monotonic() - t < 2.0


def test_a_connection_to_itself_is_not_the_store(monkeypatch):
    """A poll that TCP connects to itself (the port free, taken as the poll's own end: the kernel's walk through
    its ports reaches it) is no store: await_store waits on, and torch's store then listens on that port."""
    port, started, stores, real = _free_port(), [], [], socket.create_connection

    def first_to_itself(address, timeout=None):
        if stores or started:
            return real(address, timeout=timeout)
        probe = socket.socket()
        probe.bind(address)
        probe.connect(address)  # a simultaneous open with itself, as the kernel's own choice of port gives it
        started.append(None)
        return probe

    monkeypatch.setattr(socket, "create_connection", first_to_itself)
    rank0 = _store_in_half_a_second(port, stores, started)
    await_store("127.0.0.1", port, timeout_s=20)
    returned = time.monotonic()
    rank0.join()
    assert stores, "torch's store could not listen on the port"
    assert returned >= started[-1] - 0.25
