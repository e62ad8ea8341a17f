"""Two hosts on one machine: this network namespace and a second one joined by a veth pair, each
end with its own address. A process in the second namespace reaches the first only over that
link (its loopback is its own), so a pipeline whose stages run in both talks over the link."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class TwoHosts:
    namespace: str  # the second host's network namespace
    here: str  # this host's address on the link
    there: str  # the second host's

    def run_there(self, argv: list[str], log_path, env: dict[str, str]) -> subprocess.Popen:
        with open(log_path, "wb") as log:
            return subprocess.Popen(["ip", "netns", "exec", self.namespace, *argv], env=env,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)

    def connections_there(self) -> str:
        """The second host's established TCP connections (`ss`)."""
        return subprocess.run(["ip", "netns", "exec", self.namespace, "ss", "-tn", "state",
                               "established"], capture_output=True, text=True,
                              check=True).stdout


def two_hosts():
    """Yields TwoHosts, or skips where this machine cannot make namespaces (needs root and
    iproute2); the namespace and link go when the generator closes (the `hosts` fixture)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two hosts need root and iproute2 (ip netns) to make a network namespace")
    tag = f"{os.getpid() % 100000}"
    namespace, near, far = f"kvrelay-h{tag}", f"kvr{tag}a", f"kvr{tag}b"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    hosts = TwoHosts(namespace, f"{subnet}.1", f"{subnet}.2")
    steps = [["ip", "netns", "add", namespace],
             ["ip", "link", "add", near, "type", "veth", "peer", "name", far],
             ["ip", "link", "set", far, "netns", namespace],
             ["ip", "addr", "add", f"{hosts.here}/24", "dev", near],
             ["ip", "link", "set", near, "up"],
             ["ip", "netns", "exec", namespace, "ip", "addr", "add", f"{hosts.there}/24", "dev",
              far],
             ["ip", "netns", "exec", namespace, "ip", "link", "set", far, "up"],
             ["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up"]]
    try:
        for step in steps:
            made = subprocess.run(step, capture_output=True, text=True)
            if made.returncode != 0:
                pytest.skip(f"cannot make a second network namespace: {' '.join(step)}: "
                            f"{made.stderr.strip()}")
        yield hosts
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", near], capture_output=True)


def rendezvous_address(host: str) -> str:
    """HOST:PORT with a port free on `host` (node 0's rendezvous)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"{host}:{sock.getsockname()[1]}"


def start_node_one(hosts: TwoHosts, address: str, log_path, timeout_s: str) -> subprocess.Popen:
    """`kvrelay worker --node-rank 1` of a 2-stage pipeline, on the second host."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return hosts.run_there([
        sys.executable, "-m", "kvrelay.cli", "worker", "--nnodes", "2", "--node-rank", "1",
        "--pipeline-parallel-size", "2", "--dist-init-address", address,
        "--tensor-parallel-timeout", timeout_s], log_path, env)
