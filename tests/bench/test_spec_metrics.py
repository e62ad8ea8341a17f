"""bench serve's reading of speculative decoding's counters (kvrelay's and vLLM's names) and
the grounded workload's prompts."""
from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from kvrelay.bench import spec_metrics
from kvrelay.bench.workloads import build

PAGES = {
    "/kvrelay": "kvrelay:spec_decode_num_drafts_total 10.0\n"
                "kvrelay:spec_decode_num_draft_tokens_total 40.0\n"
                "kvrelay:spec_decode_num_accepted_tokens_total 30.0\n"
                'kvrelay:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9.0\n',
    "/vllm": 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0\n'
             'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0\n'
             'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 6.0\n',
    "/none": "kvrelay:generation_tokens_total 5.0\n",
}


@pytest.fixture(scope="module")
def metrics_server():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = PAGES[self.path].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_counters_are_read_and_summed(metrics_server):
    kvrelay = asyncio.run(spec_metrics.scrape([f"{metrics_server}/kvrelay"]))
    assert kvrelay == {"drafts": 10.0, "draft_tokens": 40.0, "accepted_tokens": 30.0}
    both = asyncio.run(spec_metrics.scrape([f"{metrics_server}/kvrelay",
                                            f"{metrics_server}/vllm"]))
    assert both["accepted_tokens"] == 36.0
    assert asyncio.run(spec_metrics.scrape([f"{metrics_server}/none"])) is None


def test_acceptance_of_a_run():
    before = {"drafts": 10.0, "draft_tokens": 40.0, "accepted_tokens": 30.0}
    after = {"drafts": 20.0, "draft_tokens": 80.0, "accepted_tokens": 50.0}
    result = spec_metrics.acceptance(before, after)
    assert result["acceptance_rate"] == pytest.approx(0.5)
    assert result["mean_acceptance_length"] == pytest.approx(3.0)
    assert spec_metrics.acceptance(None, after) is None
    assert spec_metrics.acceptance(after, after)["acceptance_rate"] is None


def test_grounded_prompts_quote_standard_library_code_and_are_fixed_by_seed():
    first, again, other = build("grounded", 0), build("grounded", 0), build("grounded", 1)
    assert len(first) == 32
    assert [r.messages for r in first] == [r.messages for r in again]
    assert [r.messages for r in first] != [r.messages for r in other]
    assert all(r.messages[0]["content"].startswith("```python\n") for r in first)
