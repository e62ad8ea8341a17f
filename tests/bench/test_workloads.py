"""The standard workloads: deterministic by seed, the right shapes and arrival rates."""
from __future__ import annotations

import hashlib
import json

import pytest

from benchmarks import workloads as legacy
from kvrelay.bench import workloads
from kvrelay.bench.prompts import chat64, shared_prefix


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def test_chat64_and_shared_prefix_keep_their_prompts():
    # The numbers in BENCHMARKS.md were measured on exactly these prompts.
    assert _digest(chat64()) == "6bf7de8107aaf5ab"
    assert _digest(shared_prefix()) == "6222f27154dd0acb"
    assert legacy.chat64() == chat64() and legacy.shared_prefix() == shared_prefix()


@pytest.mark.parametrize("name", ["chat-64", "shared-prefix", "long+short"])
def test_workloads_are_deterministic_by_seed(name):
    first, again = workloads.build(name, seed=3), workloads.build(name, seed=3)
    other = workloads.build(name, seed=4)
    assert first == again
    assert [r.messages for r in first] != [r.messages for r in other]


def test_chat64_is_64_greedy_requests_at_once():
    requests = workloads.build("chat-64")
    assert len(requests) == 64
    assert {r.max_tokens for r in requests} == {128}
    assert {r.arrival_s for r in requests} == {0.0}
    assert [r.messages for r in requests] == chat64()


def test_poisson_arrivals_have_the_mean_rate():
    arrivals = workloads.poisson_arrivals(20_000, rate=5.0, seed=1)
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 5.0, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    mean = sum(gaps) / len(gaps)
    std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert std == pytest.approx(mean, rel=0.05)


def test_poisson_workload_is_chat64_on_a_schedule():
    requests = workloads.build("poisson", seed=0, rate=2.0)
    assert [r.messages for r in requests] == chat64()
    assert [r.arrival_s for r in requests] == workloads.poisson_arrivals(64, 2.0, 0)
    assert workloads.poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="--rate"):
        workloads.build("poisson")
    with pytest.raises(ValueError):
        workloads.poisson_arrivals(3, 0.0)


def test_poisson_can_send_more_requests_than_chat64_holds():
    requests = workloads.build("poisson", seed=0, rate=8.0, num_requests=200)
    assert len(requests) == 200
    assert [r.messages for r in requests[:64]] == chat64()  # the first 64 are chat-64's own
    assert len({json.dumps(r.messages) for r in requests}) == 200  # and the rest are new
    assert [r.arrival_s for r in requests] == workloads.poisson_arrivals(200, 8.0, 0)
    with pytest.raises(ValueError, match="poisson workload only"):
        workloads.build("chat-64", num_requests=100)
    for bad in (0, workloads.MAX_POISSON_REQUESTS + 1):
        with pytest.raises(ValueError, match="--num-requests must be"):
            workloads.build("poisson", rate=1.0, num_requests=bad)


def test_long_short_puts_four_long_prompts_among_32_short():
    requests = workloads.build("long+short", seed=0)
    shorts = [r for r in requests if r.tag == "short"]
    longs = [r for r in requests if r.tag == "long"]
    assert len(shorts) == 32 and len(longs) == 4
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    # Each long prompt arrives among the short ones, not before or after all of them.
    for long in longs:
        assert shorts[0].arrival_s < long.arrival_s < shorts[-1].arrival_s
    # ~3,000 tokens at ~14 tokens a sentence: over 10,000 characters.
    assert all(len(r.messages[0]["content"]) > 10_000 for r in longs)
    assert all(len(r.messages[0]["content"]) < 2_000 for r in shorts)
    # Without the long ones the short requests are the very same, at the same times.
    without = workloads.build("long+short", seed=0, include_long=False)
    assert without == shorts


def test_shared_prefix_shares_one_system_prompt():
    requests = workloads.build("shared-prefix")
    assert len(requests) == 64
    assert len({r.messages[0]["content"] for r in requests}) == 1
    assert len({r.messages[1]["content"] for r in requests}) == 64


def test_a_rate_spreads_any_workload_and_max_tokens_overrides():
    requests = workloads.build("shared-prefix", rate=4.0, max_tokens=8)
    assert requests[-1].arrival_s > 0
    assert {r.max_tokens for r in requests} == {8}


def test_jsonl_lines(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        "",
        json.dumps({"prompt": "Once upon a time", "max_tokens": 7, "top_p": 0.5}),
    ]) + "\n")
    first, second = workloads.load_jsonl(path)
    assert first.messages == [{"role": "user", "content": "hi"}] and first.prompt is None
    assert first.max_tokens == 128 and first.extra == {}
    assert second.prompt == "Once upon a time" and second.max_tokens == 7
    assert second.extra == {"top_p": 0.5}
    overridden = workloads.build("jsonl", jsonl=str(path), max_tokens=3)
    assert [r.max_tokens for r in overridden] == [3, 3]


@pytest.mark.parametrize("line, message", [
    ("not json", "prompts.jsonl:2"),
    ('["a list"]', "JSON object"),
    ('{"max_tokens": 3}', "either messages or a prompt"),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "either"),
    ('{"messages": []}', "non-empty list"),
    ('{"prompt": 5}', "string"),
    ('{"prompt": "a", "max_tokens": "many"}', "integer"),
    ('{"prompt": "a", "max_tokens": 0}', "max_tokens"),
])
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        workloads.load_jsonl(path)


def test_empty_jsonl_and_unknown_workload(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        workloads.load_jsonl(path)
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.build("chat-65")
    with pytest.raises(ValueError, match="--jsonl"):
        workloads.build("jsonl")
