"""docker-compose.yml for real: the image built here (deploy/build-offline-image.sh), the stack
started with `docker compose up` under its own project name and mutual TLS on every internal
hop, and checked from outside through the gateway's published port only:

- greedy chat completions equal a local `kvrelay up` stack's (float32 on both sides), the
  compose stack's prefill worker a tensor-parallel group of 3 ranks in its container (the
  default model's 9 query and 3 KV heads split three ways, pages resharded to the one-rank
  decode workers), each decode worker a pipeline of 2 stages;
- `--scale decode-worker=2` adds a worker that registers by itself and takes work;
- a decode worker's process SIGKILLed: Docker restarts its container (restart: unless-stopped),
  streams in flight finish with the text of an uninterrupted run, the restarted worker registers
  again, and every block is free afterwards;
- `docker compose down -v` leaves no container, network or volume of the project.

It prints the image's size, the build's time and the time from `up` to the first token.
Runs with `make compose-test` (KVRELAY_COMPOSE=1); needs root or a running Docker engine.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.stack import free_port_block, start_stack, stop_and_check
from tests.prompts import USER_MESSAGES

REPO = Path(__file__).resolve().parents[2]
PROJECT = "kvrelay-compose-test"
TAG = "compose-test"  # KVRELAY_TAG: the image is kvrelay:compose-test
IMAGE = f"kvrelay:{TAG}"
DTYPE = "float32"  # the containers' and the reference stack's
MAX_TOKENS = 24
PREFILL_RANKS = 3
DECODE_STAGES = 2  # each decode worker a pipeline of 2 stages in its container
# run inside the prefill container: its processes that are a group's other ranks (not this
# script, whose own command line names what it looks for)
COUNT_RANKS_SCRIPT = ("import os; print(sum(b'spawn_main' in open(f'/proc/{p}/cmdline', 'rb')"
                      ".read() for p in os.listdir('/proc') if p.isdigit() and "
                      "int(p) != os.getpid()))")
PROMPTS = USER_MESSAGES[:3]
BUILD_TIMEOUT_S = 3600  # a first build with the vfs storage driver
READY_TIMEOUT_S = 900  # up to the first answer: kernels compile, models load, workers register
HEAL_TIMEOUT_S = 300
DOCKERD_LOG = Path("/var/log/kvrelay-dockerd.log")
# Containers run as this user (Dockerfile); compose mounts the key files with the host's owner.
CONTAINER_UID = 10001

STATS_SCRIPT = """
import json, os, grpc
from kvrelay.api.kvrelay.v1 import scheduler_pb2, scheduler_pb2_grpc
from kvrelay.common.tls import TlsFiles, channel_credentials, target_options
paths = [os.environ.get("KVRELAY_TLS_" + name) for name in ("CA", "CERT", "KEY")]
if all(paths):
    channel = grpc.secure_channel("scheduler:50052", channel_credentials(TlsFiles(*paths)),
                                  options=target_options("scheduler"))
else:
    channel = grpc.insecure_channel("scheduler:50052")
reply = scheduler_pb2_grpc.SchedulerStub(channel).Stats(scheduler_pb2.StatsRequest(), timeout=5)
print(json.dumps({"ready": reply.ready, "num_running": reply.num_running,
                  "num_waiting": reply.num_waiting,
                  "workers": [{"worker_id": w.worker_id, "role": scheduler_pb2.WorkerRole.Name(w.role),
                               "num_blocks": w.num_blocks, "num_free_blocks": w.num_free_blocks,
                               "num_running": w.num_running} for w in reply.workers]}))
"""


# ---- shell helpers ------------------------------------------------------------------------------
def sh(command: list[str], timeout: float = 600, check: bool = True, env: dict | None = None,
       **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, **kwargs)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited with {done.returncode}:\n"
                             f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


def docker_running() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


def ensure_dockerd() -> None:
    """A Docker engine: the one running, else dockerd started here (root only), left running
    for the next run. DOCKERD_FLAGS: its flags (vfs works where overlayfs cannot be mounted)."""
    if shutil.which("docker") is None:
        pytest.fail("no docker CLI (Debian: apt-get install docker.io)")
    if docker_running():
        return
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        pytest.fail("no Docker engine running, and dockerd cannot be started here")
    flags = os.environ.get("DOCKERD_FLAGS", "--storage-driver=vfs").split()
    with open(DOCKERD_LOG, "ab") as log:
        subprocess.Popen(["dockerd", *flags], stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 90
    while not docker_running():
        assert time.monotonic() < deadline, DOCKERD_LOG.read_text(errors="replace")[-3000:]
        time.sleep(1)


def compose_command() -> list[str]:
    """`docker compose` (the v2 plugin) where it exists, else `docker-compose`."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True,
                      timeout=60).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("neither `docker compose` nor `docker-compose` (Debian: apt-get install "
                "docker-compose)")


def make_certs(out: Path) -> bool:
    """`kvrelay certs` into `out`, the keys readable by the containers' user. False where this
    checkout has no `kvrelay certs` yet: then the stack runs in plaintext."""
    from kvrelay.cli import COMMANDS
    if "certs" not in COMMANDS or os.environ.get("KVRELAY_COMPOSE_TLS") == "0":
        for name in ("ca", "crl", *(f"{role}{suffix}" for role in
                                    ("gateway", "tokenizer", "scheduler", "worker")
                                    for suffix in ("", "-key"))):
            (out / f"{name}.pem").write_text("")  # compose still mounts every secret
        return False
    sh([sys.executable, "-m", "kvrelay.cli", "certs", "--out", str(out)], timeout=120)
    for key in out.glob("*-key.pem"):
        if os.geteuid() == 0:  # what the compose file's header tells an operator to do
            os.chown(key, CONTAINER_UID, CONTAINER_UID)
        else:
            key.chmod(0o644)  # throwaway keys of a test run
    return True


@dataclass
class Compose:
    command: list[str]
    env: dict[str, str]
    base_url: str
    log_dir: Path
    tls: bool
    timings: dict[str, float] = field(default_factory=dict)

    def __call__(self, *args: str, timeout: float = 600, check: bool = True):
        return sh([*self.command, "-p", PROJECT, *args], timeout=timeout, check=check,
                  env=self.env)

    def containers(self, service: str) -> list[str]:
        ids = self("ps", "-q", service).stdout.split()
        return sorted(ids)

    def container(self, service: str) -> str:
        (container,) = self.containers(service)
        return container

    def exec_python(self, service: str, code: str, timeout: float = 60) -> str:
        done = sh(["docker", "exec", self.container(service), "python", "-c", code],
                  timeout=timeout)
        return done.stdout

    def stats(self) -> dict:
        """The scheduler's Stats, asked from inside the gateway's container (with its
        certificate: the scheduler's port is published nowhere)."""
        return json.loads(self.exec_python("gateway", STATS_SCRIPT))

    def metric(self, container: str, port: int, name: str) -> float:
        """One unlabelled sample from a container's own /metrics (summed over labels)."""
        text = sh(["docker", "exec", container, "python", "-c",
                   f"import urllib.request; print(urllib.request.urlopen("
                   f"'http://127.0.0.1:{port}/metrics', timeout=10).read().decode())"],
                  timeout=60).stdout
        values = [float(match.group(2)) for match in re.finditer(
            rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)]
        return sum(values)

    def save_logs(self) -> str:
        done = self("logs", "--no-color", "--tail", "400", check=False, timeout=120)
        (self.log_dir / "compose.log").write_text(done.stdout + done.stderr)
        return done.stdout[-6000:]


def client(base_url: str, timeout: float = 180) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=timeout,
                         http_client=httpx.Client(trust_env=False, timeout=timeout))


def chat(api: openai.OpenAI, model: str, message: str) -> tuple[str, str, int]:
    reply = api.chat.completions.create(model=model, temperature=0, max_tokens=MAX_TOKENS,
                                        messages=[{"role": "user", "content": message}])
    choice = reply.choices[0]
    return choice.message.content, choice.finish_reason, reply.usage.completion_tokens


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
            last = exc
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s (last: {last!r})")


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image(report) -> dict:
    ensure_dockerd()
    started = time.monotonic()
    if os.environ.get("KVRELAY_COMPOSE_BUILD") != "0":  # 0: test the kvrelay:compose-test there is
        sh(["deploy/build-offline-image.sh", IMAGE], timeout=BUILD_TIMEOUT_S)
    build_s = time.monotonic() - started
    size = int(sh(["docker", "image", "inspect", "-f", "{{.Size}}", IMAGE]).stdout)
    report(f"image {IMAGE}: {size / 1e9:.2f} GB ({size / 2**30:.2f} GiB), "
           f"built (or found cached) in {build_s:.0f}s")
    return {"size": size, "build_s": build_s}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, tuple[str, str, int]]:
    """Greedy answers of a local `kvrelay up` (PD, KV over gRPC, float32): what the containers
    must reproduce. Run before the compose stack, not beside it: two cores."""
    stack = start_stack("pd", tmp_path_factory.mktemp("reference-stack"),
                        "--kv-transport", "grpc")
    try:
        api = client(stack.base_url)
        model = api.models.list().data[0].id
        answers = {message: chat(api, model, message) for message in PROMPTS}
    finally:
        stop_and_check(stack)
    return answers


@pytest.fixture(scope="module")
def compose(image, reference, tmp_path_factory, report) -> Compose:
    log_dir = tmp_path_factory.mktemp("compose")
    certs = log_dir / "certs"
    certs.mkdir()
    tls = make_certs(certs)
    port = free_port_block(2)
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVRELAY_")}
    env.update(KVRELAY_TAG=TAG, KVRELAY_CERTS_DIR=str(certs), DTYPE=DTYPE, WORKER_THREADS="1",
               PREFILL_TENSOR_PARALLEL_SIZE=str(PREFILL_RANKS),
               DECODE_PIPELINE_PARALLEL_SIZE=str(DECODE_STAGES),
               PUBLISH_HOST="127.0.0.1", GATEWAY_PORT=str(port),
               GATEWAY_GRPC_PORT=str(port + 1), LOG_LEVEL="info",
               # docker-compose 1.x gives each engine call 60 s, and with the vfs storage
               # driver creating a container copies the whole image (minutes on a busy disk).
               COMPOSE_HTTP_TIMEOUT="900")
    if not tls:
        env.update({f"KVRELAY_TLS_{name}": "" for name in ("CA", "CRL", "CERT", "KEY")})
    stack = Compose(compose_command(), env, f"http://127.0.0.1:{port}/v1", log_dir, tls)
    stack("down", "-v", "--remove-orphans", timeout=300, check=False)  # a previous run's
    report(f"{' '.join(stack.command)} -p {PROJECT} up -d (TLS {'on' if tls else 'OFF'}), "
           f"gateway on 127.0.0.1:{port}")
    try:
        started = time.monotonic()
        stack("up", "-d", "--no-build", timeout=READY_TIMEOUT_S)
        stack.timings["up_returned_s"] = time.monotonic() - started
        api = client(stack.base_url)
        model = wait_for(lambda: api.models.list().data[0].id, READY_TIMEOUT_S,
                         "the gateway lists a model", interval_s=0.5)
        first_token = wait_for(lambda: _first_token_s(api, model, started), READY_TIMEOUT_S,
                               "a first streamed token", interval_s=0.5)
        stack.timings["first_token_s"] = first_token
        report(f"`up` returned after {stack.timings['up_returned_s']:.0f}s; first token "
               f"{first_token:.1f}s after `up` started")
        yield stack
    except BaseException:
        report("compose logs (tail):\n" + stack.save_logs())
        raise
    finally:
        stack.save_logs()
        stack("down", "-v", "--remove-orphans", timeout=300, check=False)
        label = f"label=com.docker.compose.project={PROJECT}"
        left = {kind: sh(["docker", *command, "--filter", label], check=False).stdout.split()
                for kind, command in (("containers", ["ps", "-aq"]),
                                      ("volumes", ["volume", "ls", "-q"]),
                                      ("networks", ["network", "ls", "-q"]))}
        assert not any(left.values()), f"`down -v` left {left}"


def _first_token_s(api: openai.OpenAI, model: str, started: float) -> float | None:
    stream = api.chat.completions.create(
        model=model, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        messages=[{"role": "user", "content": PROMPTS[0]}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            elapsed = time.monotonic() - started
            stream.close()
            return elapsed
    return None


@pytest.fixture(scope="module")
def model(compose) -> str:
    return client(compose.base_url).models.list().data[0].id


# ---- tests --------------------------------------------------------------------------------------
def test_greedy_output_equals_the_local_stack(compose, model, reference, report):
    api = client(compose.base_url)
    for message, expected in reference.items():
        assert chat(api, model, message) == expected, message
    stats = compose.stats()
    roles = sorted(worker["role"] for worker in stats["workers"])
    assert stats["ready"] and roles == ["WORKER_ROLE_DECODE", "WORKER_ROLE_PREFILL"], stats
    # the prefill worker is one group of PREFILL_RANKS processes in its container
    logs = sh(["docker", "logs", compose.container("prefill-worker")])
    prefill_log = logs.stdout + logs.stderr
    assert f'"tensor_parallel_size": {PREFILL_RANKS}' in prefill_log, prefill_log[-2000:]
    ranks = sh(["docker", "exec", compose.container("prefill-worker"), "python", "-c",
                COUNT_RANKS_SCRIPT]).stdout
    assert int(ranks) == PREFILL_RANKS - 1, ranks
    stages = sh(["docker", "exec", compose.container("decode-worker"), "python", "-c",
                 COUNT_RANKS_SCRIPT]).stdout
    assert int(stages) == DECODE_STAGES - 1, stages
    # Every container's own healthcheck passes: the gRPC probes with each service's certificate,
    # the gateway's HTTP /health on its metrics port.
    def health() -> dict[str, str]:
        return {service: sh(["docker", "inspect", "-f", "{{.State.Health.Status}}",
                             compose.container(service)]).stdout.strip()
                for service in ("tokenizer", "scheduler", "prefill-worker", "decode-worker",
                                "gateway")}
    wait_for(lambda: set(health().values()) == {"healthy"}, 180,
             "every container healthy", interval_s=3)
    if compose.tls:
        # Internal hops speak mutual TLS only: the scheduler answered Stats above over the
        # gateway's certificate, and refuses the very same call in plaintext.
        plaintext = sh(["docker", "exec", compose.container("gateway"), "env", "-u",
                        "KVRELAY_TLS_CA", "-u", "KVRELAY_TLS_CERT", "-u", "KVRELAY_TLS_KEY",
                        "python", "-c", STATS_SCRIPT], check=False)
        assert plaintext.returncode != 0 and "StatusCode.UNAVAILABLE" in plaintext.stderr, \
            plaintext.stderr[-2000:]
    report(f"greedy parity with `kvrelay up` ({DTYPE}) on {len(reference)} prompts, the "
           f"prefill worker {PREFILL_RANKS} tensor-parallel ranks, decode workers "
           f"{DECODE_STAGES} pipeline stages; "
           f"TLS {'on' if compose.tls else 'OFF'}")


def _decode_workers(stats: dict) -> list[dict]:
    return [worker for worker in stats["workers"] if "DECODE" in worker["role"]]


def test_a_second_decode_worker_registers_and_takes_work(compose, model, reference,
                                                          report):
    compose("up", "-d", "--no-build", "--no-recreate", "--scale", "decode-worker=2",
            timeout=READY_TIMEOUT_S)
    containers = compose.containers("decode-worker")
    assert len(containers) == 2
    wait_for(lambda: len(_decode_workers(compose.stats())) == 2, READY_TIMEOUT_S,
             "the scheduler sees two decode workers", interval_s=2)
    before = {c: compose.metric(c, 9110, "kvrelay:worker_step_tokens_total") for c in containers}
    api = client(compose.base_url)
    # Concurrent requests, repeated until both workers have computed tokens: the scheduler
    # places each on the emptier decode worker.
    for _ in range(5):
        results: dict[int, tuple] = {}
        threads = [threading.Thread(target=lambda i=i, m=m: results.__setitem__(
            i, chat(api, model, m))) for i, m in enumerate(PROMPTS * 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        for i, message in enumerate(PROMPTS * 2):
            assert results.get(i) == reference[message], message  # either worker: same text
        after = {c: compose.metric(c, 9110, "kvrelay:worker_step_tokens_total")
                 for c in containers}
        if all(after[c] > before[c] for c in containers):
            break
    assert all(after[c] > before[c] for c in containers), (before, after)
    report("decode workers' computed tokens: " + ", ".join(
        f"{c[:12]} {after[c] - before[c]:.0f}" for c in containers))


class Stream(threading.Thread):
    """One greedy streaming chat request, recording its text, errors and whether it finished."""

    def __init__(self, base_url: str, model: str, message: str) -> None:
        super().__init__(daemon=True)
        self.api = client(base_url, timeout=HEAL_TIMEOUT_S)
        self.model, self.message = model, message
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self.failure: Exception | None = None
        self.streaming = threading.Event()

    def run(self) -> None:
        try:
            stream = self.api.chat.completions.create(
                model=self.model, temperature=0, max_tokens=MAX_TOKENS, stream=True,
                messages=[{"role": "user", "content": self.message}])
            for chunk in stream:
                if not chunk.choices:
                    continue
                if chunk.choices[0].delta.content:
                    self.pieces.append(chunk.choices[0].delta.content)
                    if len(self.pieces) >= 2:
                        self.streaming.set()
                self.finish_reason = chunk.choices[0].finish_reason or self.finish_reason
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc
        finally:
            self.streaming.set()


def test_a_killed_worker_is_restarted_and_the_stack_recovers(compose, model, reference,
                                                              report):
    containers = compose.containers("decode-worker")
    assert len(containers) == 2, "runs after the scale-up test"
    doomed = containers[0]
    restarts = int(sh(["docker", "inspect", "-f", "{{.RestartCount}}", doomed]).stdout)
    # A worker's id is decode-<hostname, the container's short id>-<random>: new at each start.
    hostname = sh(["docker", "inspect", "-f", "{{.Config.Hostname}}", doomed]).stdout.strip()
    (old_id,) = [w["worker_id"] for w in _decode_workers(compose.stats())
                 if w["worker_id"].startswith(f"decode-{hostname}-")]
    streams = [Stream(compose.base_url, model, message) for message in PROMPTS * 2]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.streaming.wait(120)
    # A crash, as the engine sees one: the container's main process SIGKILLed from outside.
    # (`docker kill` would not do: Docker counts it as stopping the container by hand, and a
    # container stopped by hand is not restarted, whatever its restart policy.)
    pid = int(sh(["docker", "inspect", "-f", "{{.State.Pid}}", doomed]).stdout)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    def restarted() -> bool:
        state = json.loads(sh(["docker", "inspect", "-f", "{{json .State}}", doomed]).stdout)
        count = int(sh(["docker", "inspect", "-f", "{{.RestartCount}}", doomed]).stdout)
        return state["Running"] and state["Pid"] != pid and count == restarts + 1

    wait_for(restarted, 120, "Docker restarts the killed container")
    for stream in streams:
        stream.join(HEAL_TIMEOUT_S)
    for stream in streams:
        assert not stream.is_alive() and stream.failure is None, stream.failure
        assert "".join(stream.pieces) == reference[stream.message][0], stream.message
        assert stream.finish_reason == reference[stream.message][1]

    def healed() -> dict | None:
        stats = compose.stats()
        ids = [w["worker_id"] for w in _decode_workers(stats)]
        reborn = [i for i in ids if i.startswith(f"decode-{hostname}-") and i != old_id]
        idle = all(w["num_free_blocks"] == w["num_blocks"] and not w["num_running"]
                   for w in stats["workers"])
        return stats if stats["ready"] and len(ids) == 2 and reborn and idle else None
    stats = wait_for(healed, HEAL_TIMEOUT_S, "two decode workers registered, every block free",
                     interval_s=2)
    healed_s = time.monotonic() - killed
    # Serving again, through the restarted worker as well as the other.
    api = client(compose.base_url)
    for message in PROMPTS * 2:
        assert chat(api, model, message) == reference[message], message
    wait_for(healed, 60, "every block free after the requests", interval_s=1)
    assert compose.containers("decode-worker") == containers  # restarted, not replaced
    report(f"killed decode worker {doomed[:12]} restarted and registered again after "
           f"{healed_s:.0f}s; {len(streams)} streams in flight finished with the reference "
           f"text; workers: " + ", ".join(f"{w['worker_id']} {w['num_free_blocks']}/"
                                          f"{w['num_blocks']} free" for w in stats["workers"]))
