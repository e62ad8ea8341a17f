"""kvrelay itself as a system of the comparison: `kvrelay up` in either topology.

    python -m benchmarks.peers.kvrelay_stack --topology pd --port 18400   # (for a manual look)

Started from the project's own environment (it is the system under test), on a block of free
ports, and waited for through the state file that `kvrelay up` writes once every service is
healthy.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.peers.common import Server, log_tail, start_process

REPO = Path(__file__).resolve().parents[2]


def up_command(topology: str, port: int, log_dir: Path, dtype: str | None,
               threads: int | None, up_flags: list[str] = (),
               model: Path | None = None) -> list[str]:
    # REST on port, public gRPC on port+1, internal services from port+2 on.
    command = [sys.executable, "-m", "kvrelay.cli", "up", "--topology", topology,
               "--port", str(port), "--grpc-port", str(port + 1), "--base-port", str(port + 2),
               "--log-dir", str(log_dir), "--state-file", str(log_dir / "state.json")]
    if dtype:
        command += ["--dtype", dtype]
    if threads:
        command += ["--threads-per-worker", str(threads)]
    if model:
        command += ["--model", str(model)]
    return command + list(up_flags)


def version() -> str:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    import torch
    return f"kvrelay {commit or 'unknown'}, torch {torch.__version__}"


def resolved_dtype(dtype: str | None) -> str:
    from kvrelay.engine.hardware import resolve_dtype
    return str(resolve_dtype(dtype or "auto", "cpu")).removeprefix("torch.")


def launch(topology: str, port: int, log_dir: Path, dtype: str | None = None,
           threads: int | None = None, timeout_s: float = 600,
           up_flags: list[str] = (), model: Path | None = None) -> Server:
    """`kvrelay up` serving the default model, or the Hugging Face directory `model`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    state_file = log_dir / "state.json"
    state_file.unlink(missing_ok=True)
    command = up_command(topology, port, log_dir, dtype, threads, up_flags, model)
    process = start_process(command, log_dir / "up.log", {"HF_HUB_OFFLINE": "1"})
    name = " ".join([f"kvrelay {topology}", *up_flags])
    server = Server(name, process, f"http://127.0.0.1:{port}", "openai",
                    command, {"version": version(), "dtype": resolved_dtype(dtype),
                              "threads": f"{threads or 'default'} per worker"})
    _wait_ready(process, state_file, timeout_s, log_dir)
    services = json.loads(state_file.read_text()).get("services", {})
    server.metrics_urls = [entry["metrics_url"] for entry in services.values()
                           if entry.get("kind") == "scheduler" and entry.get("metrics_url")]
    return server


def _wait_ready(process, state_file: Path, timeout_s: float, log_dir: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvrelay up exited with {process.returncode}:\n"
                               + log_tail(log_dir / "up.log"))
        if state_file.exists():
            try:
                status = json.loads(state_file.read_text()).get("status")
            except ValueError:
                status = None  # caught mid-write
            if status == "ready":
                return
            if status == "failed":
                raise RuntimeError("kvrelay up failed:\n" + log_tail(log_dir / "up.log"))
        time.sleep(1)
    raise RuntimeError(f"kvrelay up not ready after {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", choices=["pd", "colocated"], default="pd")
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--log-dir", type=Path, default=Path("bench-results/kvrelay-up"))
    args = parser.parse_args()
    sys.exit(subprocess.call(up_command(args.topology, args.port, args.log_dir, None, None)))


if __name__ == "__main__":
    main()
