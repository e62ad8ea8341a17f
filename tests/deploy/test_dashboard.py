"""The Grafana dashboard queries only metrics and labels the code defines, through the
provisioned datasource, and covers what the issue asks for."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.deploy import cli_facts

REPO = cli_facts.REPO
DASHBOARD = REPO / "deploy/grafana/dashboards/kvrelay.json"
METRIC = re.compile(r"kvrelay:[A-Za-z0-9_:]+")
# Labels Prometheus itself adds to every series (`le` only to histogram buckets: in the series).
TARGET_LABELS = {"job", "instance"}


def queries(dashboard: dict) -> list[dict]:
    return [target for panel in dashboard["panels"] for target in panel["targets"]]


def query_problems(expr: str, legend: str = "") -> list[str]:
    """Unknown metrics, and grouping or legend labels that none of the query's metrics carry."""
    series = cli_facts.metric_series()
    names = METRIC.findall(expr)
    problems = [f"{name}: no such metric in the code" for name in names if name not in series]
    if not names:
        problems.append(f"{expr}: queries no kvrelay metric")
    labels = TARGET_LABELS.union(*(series.get(name, set()) for name in names))
    used = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        used |= {label.strip() for label in group.split(",") if label.strip()}
    used |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
    used |= set(re.findall(r"(\w+)\s*=~?\s*\"", expr))  # label matchers
    problems += [f"{expr}: label {label} is on none of its metrics"
                 for label in sorted(used - labels)]
    return problems


def test_every_query_uses_real_metrics_and_labels():
    dashboard = json.loads(DASHBOARD.read_text())
    problems = [problem for target in queries(dashboard)
                for problem in query_problems(target["expr"], target.get("legendFormat", ""))]
    assert problems == []


@pytest.mark.parametrize("expr, legend, expected", [
    ("rate(kvrelay:generation_tokens[1m])", "", "no such metric"),  # a counter without _total
    ("kvrelay:time_to_first_token_seconds", "", "no such metric"),  # a histogram without _bucket
    ("sum by (worker) (kvrelay:kv_transfer_bytes_total)", "", "label worker"),
    ("kvrelay:kv_cache_usage_perc", "{{transport}}", "label transport"),
    ("up", "", "queries no kvrelay metric"),
])
def test_query_check_catches(expr, legend, expected):
    assert any(expected in problem for problem in query_problems(expr, legend))


@pytest.mark.parametrize("module", ["kvrelay.gateway.metrics",
                                    "kvrelay.scheduler.scheduler_metrics"])
def test_metric_scan_agrees_with_prometheus_client(module):
    """The AST scan names series exactly as prometheus_client exposes them. Each light metric
    module is imported in a child process (the gateway and the scheduler both define
    generation_tokens, so one registry cannot hold both); unlabeled metrics have samples."""
    script = (f"import json, {module}\n"
              "from kvrelay.common.metrics import REGISTRY\n"
              "print(json.dumps([s.name for f in REGISTRY.collect() for s in f.samples]))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    exposed = {name for name in json.loads(done.stdout) if not name.endswith("_created")}
    assert len(exposed) > 5
    assert exposed <= cli_facts.metric_series().keys()


def test_jobs_and_datasource_exist():
    dashboard = json.loads(DASHBOARD.read_text())
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    sources = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = sources["datasources"][0]["uid"]
    for target in queries(dashboard):
        assert set(re.findall(r'job="([^"]+)"', target["expr"])) <= jobs, target["expr"]
        assert target["datasource"]["uid"] == uid
    assert all(panel["datasource"]["uid"] == uid for panel in dashboard["panels"])
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def test_dashboard_covers_the_issue():
    """Throughput, TTFT, ITL, queue time, running/waiting, KV usage and KV transfers."""
    text = " ".join(target["expr"] for target in queries(json.loads(DASHBOARD.read_text())))
    for metric in ("generation_tokens_total", "time_to_first_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                   "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "kv_transfer_bytes_total", "kv_transfer_seconds_bucket",
                   "kv_transfer_failures_total"):
        assert f"kvrelay:{metric}" in text, metric
