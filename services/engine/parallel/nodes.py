"""Which hosts a worker's pipeline spans, as torchrun users know it: `nnodes` hosts, each
running a run of consecutive stages (node 0 the first, with the leader), meeting at node 0's
rendezvous (`--dist-init-address host:port`, a TCPStore the leader opens).

On one host the stages meet on a free loopback port and wait for steps in shared memory; across
hosts every stage waits on the rendezvous store instead (store_doorbell.py), and gloo must talk
over the interface that reaches node 0, not the loopback its hostname may resolve to: the
interface is found from the route to node 0 (GLOO_SOCKET_IFNAME, where set, wins).
"""
from __future__ import annotations

import array
import fcntl
import os
import socket
import struct
from dataclasses import dataclass

SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"  # gloo's own variable, read when a group forms


@dataclass(frozen=True)
class NodePlacement:
    nnodes: int = 1
    node_rank: int = 0
    init_address: str | None = None  # "host:port" of node 0's rendezvous (several hosts)

    @property
    def multi_host(self) -> bool:
        return self.nnodes > 1

    @property
    def is_leader_node(self) -> bool:
        return self.node_rank == 0

    def stages_here(self, num_stages: int) -> range:
        """The stages this host runs (consecutive, the same count on every host)."""
        per_node = num_stages // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def host_port(self) -> tuple[str, int]:
        host, _, port = self.init_address.rpartition(":")
        return host.strip("[]"), int(port)

    def check(self, num_stages: int, tensor_parallel_size: int) -> None:
        """ValueError where the flags cannot place a pipeline on these hosts."""
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if not self.multi_host:
            if self.init_address:
                raise ValueError("--dist-init-address is node 0's rendezvous for --nnodes > 1 "
                                 "(one host's stages meet on a port of their own)")
            return
        if tensor_parallel_size > 1:
            raise ValueError("--nnodes > 1 splits a pipeline's stages across hosts; a "
                             "tensor-parallel group stays on one host (its ranks share memory)")
        if num_stages % self.nnodes:
            raise ValueError(f"--pipeline-parallel-size {num_stages} must be a multiple of "
                             f"--nnodes {self.nnodes} (each host runs as many stages)")
        if not self.init_address:
            raise ValueError("--nnodes > 1 needs --dist-init-address HOST:PORT, node 0's "
                             "rendezvous, reachable from every host")
        host, _, port = self.init_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--dist-init-address must be HOST:PORT, got {self.init_address!r}")

    def init_method(self) -> str:
        """The rendezvous every stage joins: node 0's address, or on one host a free local
        port."""
        if self.multi_host:
            host, port = self.host_port()
            return f"tcp://{_bracketed(host)}:{port}"
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{sock.getsockname()[1]}"

    def choose_gloo_interface(self) -> None:
        """Across hosts, gloo's connections on the interface that routes to node 0."""
        # the literal name: tests/test_env_switches.py tells other programs' variables by it
        if self.multi_host and not os.environ.get("GLOO_SOCKET_IFNAME"):
            interface = interface_towards(self.host_port()[0])
            if interface is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = interface


def interface_towards(host: str) -> str | None:
    """The name of the interface this host would reach `host` through (IPv4), or None where
    it cannot be told (gloo then picks its own)."""
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # no packet is sent: this only picks the route
            local = probe.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return name
    return None


def _ipv4_of(interface: str) -> str | None:
    request = array.array("B", struct.pack("256s", interface.encode()[:15]))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(request.tobytes()[20:24])


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host
