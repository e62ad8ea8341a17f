"""Structured output, how often the answer is usable: every JSON schema of the test corpus
(tests/structured_schemas.py, 50 shapes users send: flat and nested objects, arrays with
bounds, enums, anyOf, $ref, patterns, formats) as one chat request with response_format
json_schema, greedy, max_tokens 200, through each system in turn.

    python -m benchmarks.structured_battery [--systems kvrelay-pd,vllm-cpu] [--out DIR]

Per system: how many answers are complete (finish_reason stop) and valid JSON that the schema
accepts, how many ran to max_tokens, how many were refused. A report, not a target: on a 135M
model the model decides most of it (a greedy string can loop until max_tokens whatever the
grammar allows); the systems differ in their grammar engines and JSON whitespace defaults
(kvrelay compact, vLLM any)."""
from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks import compare
from benchmarks.peers.common import stop
from benchmarks.summary import markdown_table
from tests.structured_schemas import SCHEMAS, validate

MAX_TOKENS = 200


def ask(client: httpx.Client, model: str, title: str, schema: dict) -> dict:
    response = client.post("/v1/chat/completions", json={
        "model": model, "temperature": 0, "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": f"Give an example of {title}, as JSON."}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "answer", "schema": schema}}})
    if response.status_code != 200:
        return {"title": title, "outcome": "refused", "detail": response.text[:200]}
    choice = response.json()["choices"][0]
    text = choice["message"]["content"] or ""
    if choice["finish_reason"] != "stop":
        return {"title": title, "outcome": "max_tokens", "text": text}
    try:
        validate(json.loads(text), schema)
    except Exception as exc:  # noqa: BLE001 - any parse or schema failure is the outcome
        return {"title": title, "outcome": "invalid", "text": text, "detail": str(exc)[:200]}
    return {"title": title, "outcome": "valid", "text": text}


def measure(system: str, args) -> dict:
    out = args.out / system
    compare_args = compare.parse_args(["--systems", system, "--out", str(out), "--dtype",
                                       args.dtype, "--threads", str(args.threads),
                                       "--no-update"] + (["--home", args.home] if args.home
                                                         else []))
    server = compare.launch(system, compare_args, compare.free_port_block(), out)
    try:
        with httpx.Client(base_url=server.base_url, timeout=600.0, trust_env=False) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            with ThreadPoolExecutor(args.concurrency) as pool:
                answers = list(pool.map(lambda case: ask(client, model, *case), SCHEMAS))
    finally:
        stop(server.process, grace_s=60)
    return {"system": server.name, "command": server.command, "answers": answers}


def report(results: list[dict]) -> str:
    rows = []
    for result in results:
        outcomes = [answer["outcome"] for answer in result["answers"]]
        total = len(outcomes)
        rows.append([result["system"], f"{outcomes.count('valid')} / {total} "
                     f"({100 * outcomes.count('valid') / total:.0f}%)",
                     outcomes.count("max_tokens"), outcomes.count("invalid"),
                     outcomes.count("refused")])
    return markdown_table(["system", "valid and complete", "ran to max_tokens",
                           "complete but invalid", "refused (400)"], rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="kvrelay-pd,vllm-cpu")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--home", default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-results/structured-battery"))
    args = parser.parse_args(argv)
    results = [measure(system, args) for system in args.systems.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    table = report(results)
    (args.out / "report.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
