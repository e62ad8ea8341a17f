"""Another host's heartbeats in the rendezvous store, as the leader's watcher reads them: a host
that beats keeps its group; one that falls silent is reported within the timeout."""
from __future__ import annotations

import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from kvrelay.engine.parallel.heartbeats import start_beating, watch_beats

TIMEOUT_S = 2.5


def _store() -> tuple[dist.TCPStore, int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30),
                         wait_for_workers=False), port


def test_a_beating_host_is_kept_and_a_silent_one_reported():
    master, port = _store()
    start_beating("127.0.0.1", port, 1, TIMEOUT_S)  # node 1 beats; node 2 never does
    silent, reported = threading.Event(), []

    def on_silence(node: int) -> None:
        reported.append(node)
        silent.set()
    stop = watch_beats("127.0.0.1", port, range(1, 3), TIMEOUT_S, on_silence)
    assert silent.wait(TIMEOUT_S + 3)
    assert reported == [2]
    stop.set()
    del master


def test_a_deliberate_stop_reports_nothing():
    master, port = _store()
    reported = []
    stop = watch_beats("127.0.0.1", port, range(1, 2), TIMEOUT_S, reported.append)
    stop.set()
    threading.Event().wait(TIMEOUT_S + 1.5)
    assert reported == []
    del master
