"""What every peer script shares: where peers live, their venvs, and waiting for a server.

Peers are installed under ~/.cache/kvrelay-peers (or --home / KVRELAY_PEERS_HOME), one folder
and one virtual environment each, never into the project's .venv: their dependencies (another
transformers, a C++ build) must not change what kvrelay itself runs on.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_HOME = Path.home() / ".cache" / "kvrelay-peers"


def peers_home(home: str | Path | None = None) -> Path:
    path = Path(home or os.environ.get("KVRELAY_PEERS_HOME") or DEFAULT_HOME).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def ensure_venv(folder: Path) -> Path:
    """The venv's python, creating the venv once (idempotent)."""
    python = folder / "venv" / "bin" / "python"
    if not python.exists():
        run([sys.executable, "-m", "venv", str(folder / "venv")])
        run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    return python


def run(command: list[str], **kwargs) -> None:
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, **kwargs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_serving(process: subprocess.Popen, url: str, timeout_s: float,
                       log_path: Path | None = None) -> None:
    """Poll url until it answers 200; raise if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            last = log_tail(log_path, 1) if log_path else ""
            raise RuntimeError(f"exited with {process.returncode} before serving"
                               + (f": {last} (log: {log_path})" if log_path else ""))
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass  # not listening yet, or still loading (llama-server answers 503)
        time.sleep(0.5)
    raise RuntimeError(f"not serving {url} after {timeout_s:.0f} s")


def stop(process: subprocess.Popen, grace_s: float = 30) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def default_gguf() -> Path:
    # The same file kvrelay serves by default (found without importing the wheel).
    from kvrelay.engine.model_loader import default_gguf_path
    return default_gguf_path()


@dataclass
class Server:
    """A started peer: what `kvrelay bench serve` needs to reach it, and what to record."""
    name: str
    process: subprocess.Popen
    base_url: str
    backend: str        # `kvrelay bench serve --backend`: how it takes ignore_eos
    command: list[str]
    info: dict = field(default_factory=dict)  # version, dtype, threads
    # Prometheus endpoints with its spec_decode counters (`bench serve --metrics-url`)
    metrics_urls: list[str] = field(default_factory=list)


def start_process(command: list[str], log_path: Path, env: dict | None = None):
    """Start a server with its output in a log file (a full pipe would stall it)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})


def log_tail(log_path: Path, lines: int = 15) -> str:
    if not log_path.exists():
        return ""
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


def install_or_serve(description: str, default_port: int, install, versions, serve_command,
                     serve_env) -> None:
    """The command line of a peer that runs as a server from its own venv: `install` prints
    the venv's python and versions; `serve` runs the server in the foreground, on the default
    model or on `--model DIR` (a Hugging Face directory)."""
    import argparse
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("action", choices=["install", "serve"])
    parser.add_argument("--home", default=None)
    parser.add_argument("--port", type=int, default=default_port)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None,
                        help="a Hugging Face model directory (default: the default model's)")
    args = parser.parse_args()
    python = install(args.home)
    if args.action == "install":
        print(python, versions(python))
        return
    command = serve_command(python, args.port, args.dtype, args.home,
                            args.model.resolve() if args.model else None)
    sys.exit(subprocess.call(command, env={**os.environ, **serve_env(args.threads)}))
