"""No prompt or output text reaches any service's log by default: requests that carry a marker
(served ones, streamed, on both APIs, and ones that fail in the gateway, the tokenizer or the
scheduler) leave neither the marker, nor the outputs, nor the prompt's token ids in the log of
any service of the stack. A gateway started with --log-request-text logs them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest

from kvrelay.api.kvrelay.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.grpc_api import generate
from tests.e2e.stack import RunningStack, free_port_block

REPO = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0, "max_tokens": 24}


def marker() -> str:
    return f"Quokka{uuid.uuid4().hex[:10]}Marmalade"


def forms(text: str) -> set[str]:
    """How a text can appear in a log line: as it is, or JSON-escaped (structlog's JSON)."""
    return {text, json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1]}


def id_forms(token_ids: list[int]) -> set[str]:
    head = token_ids[:8]
    return {", ".join(map(str, head)), ",".join(map(str, head))}


def send_requests(stack: RunningStack, http: httpx.Client, text: str) -> tuple[list[str],
                                                                                list[int]]:
    """Served and failing requests carrying `text`; returns the outputs and the prompt's ids."""
    outputs = []
    chat = http.post("/chat/completions", json={**GREEDY, "messages": [
        {"role": "system", "content": f"Remember {text}."},
        {"role": "user", "content": f"Say {text} twice."}]})
    assert chat.status_code == 200, chat.text
    outputs.append(chat.json()["choices"][0]["message"]["content"])
    with http.stream("POST", "/completions", json={**GREEDY, "prompt": f"{text} is a",
                                                   "stream": True}) as stream:
        assert stream.status_code == 200
        events = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: {")]
    outputs.append("".join(event["choices"][0]["text"] for event in events if event["choices"]))
    result = generate(stack.grpc_address, generation_pb2.GenerateRequest(
        prompt=f"The word {text} means", params=common_pb2.SamplingParams(**GREEDY)))
    outputs.append(result.text[0])
    tokenized = http.post(f"{stack.rest_url}/tokenize", json={"prompt": f"{text} {text}"})
    assert tokenized.status_code == 200
    failing = [  # refused by the gateway, by the tokenizer's template, by the scheduler
        {"messages": [{"role": "user", "content": "x"}], "model": text},
        {"prompt": text, "stop": [text] * 100},
        {"prompt": text, "guided_regex": f"{text}(", "max_tokens": 4},
        {"prompt": f"{text} " * 4000, "max_tokens": 4},  # beyond the model's context
        {"prompt": [10**6], "max_tokens": 4, "user": "u"},
    ]
    for body in failing:
        response = http.post("/completions", json=body)
        assert response.status_code == 400, response.text
    with grpc.insecure_channel(stack.grpc_address) as channel:
        with pytest.raises(grpc.RpcError):
            list(generation_pb2_grpc.GenerationStub(channel).Generate(
                generation_pb2.GenerateRequest(prompt=text, model=text), timeout=30))
    long_outputs = [output for output in outputs if len(output.strip()) >= 16]
    assert long_outputs, outputs  # texts long enough not to appear in a log by chance
    return long_outputs, tokenized.json()["tokens"]


def read_logs(paths: list[Path]) -> dict[str, str]:
    time.sleep(1.0)  # the services write their lines unbuffered; give the last ones a moment
    return {path.name: path.read_text(errors="replace") for path in paths}


@pytest.fixture(scope="module")
def http(pd_stack):
    with httpx.Client(base_url=pd_stack.base_url, timeout=120, trust_env=False) as client:
        yield client


def test_no_prompt_or_output_text_in_any_log(pd_stack, http):
    text = marker()
    outputs, prompt_ids = send_requests(pd_stack, http, text)
    logs = read_logs(sorted(pd_stack.log_dir.glob("*.log")))
    assert {"gateway.log", "tokenizer.log", "scheduler.log"} <= set(logs), list(logs)
    assert any(name.startswith(("prefill", "decode")) for name in logs), list(logs)
    for name, content in logs.items():
        for needle in forms(text) | {form for output in outputs for form in forms(output)} \
                | id_forms(prompt_ids):
            assert needle not in content, (name, needle)


def test_the_flag_logs_prompts_and_outputs_in_the_gateway(pd_stack, tmp_path):
    log_path = tmp_path / "gateway.log"
    url, process = start_debug_gateway(pd_stack, log_path)
    try:
        text = marker()
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as client:
            reply = client.post("/v1/chat/completions", json={**GREEDY, "messages": [
                {"role": "user", "content": f"Say {text}."}]})
            assert reply.status_code == 200, reply.text
        output = reply.json()["choices"][0]["message"]["content"]
    finally:
        stop(process)
    content = log_path.read_text(errors="replace")
    assert any(form in content for form in forms(text)), content[-2000:]
    assert any(form in content for form in forms(output)), content[-2000:]
    assert '"request text"' in content and '"output text"' in content


def start_debug_gateway(stack: RunningStack, log_path: Path) -> tuple[str, subprocess.Popen]:
    """A second gateway on the stack's tokenizer and scheduler, with --log-request-text."""
    port = free_port_block(2)
    command = [sys.executable, "-m", "kvrelay.cli", "gateway", "--host", "127.0.0.1",
               "--port", str(port), "--grpc-port", str(port + 1), "--metrics-port", "0",
               "--tokenizer-address", stack.service("tokenizer")["address"],
               "--scheduler-address", stack.service("scheduler")["address"],
               "--log-request-text", *tls_flags(stack)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env={**env, "PYTHONUNBUFFERED": "1"},
                                   stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            raise RuntimeError(f"debug gateway not ready:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.25)
    return url, process


def tls_flags(stack: RunningStack) -> list[str]:
    tls_dir = stack.state.get("tls_dir")
    if not tls_dir:
        return []
    return ["--tls-ca", f"{tls_dir}/ca.pem", "--tls-cert", f"{tls_dir}/gateway.pem",
            "--tls-key", f"{tls_dir}/gateway-key.pem"]


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200
    except httpx.TransportError:
        return False


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
