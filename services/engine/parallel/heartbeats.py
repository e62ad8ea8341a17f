"""How a pipeline's leader learns that another host's stages are gone while it sits idle.

On one host the leader watches its followers' processes (followers.watch_followers); another
host's are out of its sight, and a send or receive only fails inside the next step. So each
other host, once its stages have joined the group, bumps a count in the rendezvous store every
PERIOD_S from a thread of its own, and the leader's watcher declares the group broken when a
host's count has stood still for the group's timeout: a host that died, stopped, or lost the
network. A host that restarts cannot join a running group, so it never beats: the leader gives
up on it, restarts, and the host joins the fresh rendezvous.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

PERIOD_S = 1.0


def beats_key(node_rank: int) -> str:
    return f"kvrelay/pipeline/beats/{node_rank}"


def _client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A store client of the thread's own (one client per thread)."""
    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def start_beating(host: str, port: int, node_rank: int,
                  timeout_s: float) -> threading.Event:
    """Another host, joined: beat until the returned event is set (its stages are leaving) or
    the store goes (the leader is gone; the stages then fail on their own)."""
    store = _client(host, port, timeout_s)
    stopping = threading.Event()

    def beat() -> None:
        try:
            while not stopping.is_set():
                store.add(beats_key(node_rank), 1)
                stopping.wait(PERIOD_S)
        except RuntimeError:  # the store is gone
            return
    threading.Thread(target=beat, name="pp-heartbeat", daemon=True).start()
    return stopping


def watch_beats(host: str, port: int, nodes: range, timeout_s: float,
                on_silence) -> threading.Event:
    """Leader: call on_silence(node_rank) from a daemon thread when a host of `nodes` has not
    beaten for timeout_s; set the returned event to stop watching (a deliberate stop)."""
    stopping = threading.Event()
    store = _client(host, port, timeout_s)

    def watch() -> None:
        started = time.monotonic()
        last = {node: (store.add(beats_key(node), 0), started) for node in nodes}
        while not stopping.wait(PERIOD_S):
            now = time.monotonic()
            for node, (count, since) in last.items():
                current = store.add(beats_key(node), 0)
                if current != count:
                    last[node] = (current, now)
                elif now - since > timeout_s and not stopping.is_set():
                    on_silence(node)
                    return
    threading.Thread(target=watch, name="pp-watch", daemon=True).start()
    return stopping
