"""Reading each served system's KV capacity (benchmarks/kv_capacity.py): kvrelay's gauge per
worker, vLLM's cache_config_info, llama-server's /props, each from a real HTTP server here."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks import kv_capacity

KVRELAY_METRICS = """# HELP kvrelay:kv_cache_capacity_tokens Tokens of KV a worker's cache holds
# TYPE kvrelay:kv_cache_capacity_tokens gauge
kvrelay:kv_cache_capacity_tokens{worker="prefill-0"} 16384.0
kvrelay:kv_cache_capacity_tokens{worker="decode-0"} 32768.0
kvrelay:kv_cache_usage_perc{worker="decode-0"} 0.5
"""
VLLM_METRICS = """# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="227",""" \
    """num_cpu_blocks="None"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""
LLAMA_PROPS = {"total_slots": 16, "default_generation_settings": {"n_ctx": 4096}}


def test_kvrelay_sums_its_workers_and_vllm_multiplies_blocks_by_their_size():
    assert kv_capacity.from_metrics(KVRELAY_METRICS) == 49152
    assert kv_capacity.from_metrics(VLLM_METRICS) == 227 * 128
    unsized = VLLM_METRICS.replace('num_gpu_blocks="227"', 'num_gpu_blocks="None"')
    assert kv_capacity.from_metrics(unsized) is None
    assert kv_capacity.from_metrics("vllm:num_requests_running 0.0\n") is None


def test_llama_props_are_slots_times_each_slots_context():
    assert kv_capacity.from_llama_props(LLAMA_PROPS) == 65536
    assert kv_capacity.from_llama_props({"total_slots": 16}) is None


@pytest.fixture
def server():
    """A local HTTP server answering /metrics and /props with what `pages` holds."""
    pages: dict[str, tuple[int, str]] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            status, body = pages.get(self.path, (404, "not found"))
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):  # quiet
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", pages
    httpd.shutdown()
    httpd.server_close()


def test_read_tries_the_metrics_then_props(server):
    base_url, pages = server
    pages["/metrics"] = (200, VLLM_METRICS)
    assert kv_capacity.read(base_url, [f"{base_url}/metrics"]) == 227 * 128
    pages["/metrics"] = (501, '{"error": "no metrics"}')
    pages["/props"] = (200, json.dumps(LLAMA_PROPS))
    assert kv_capacity.read(base_url, [f"{base_url}/metrics"]) == 65536
    del pages["/props"]
    assert kv_capacity.read(base_url, []) is None
    assert kv_capacity.read("http://127.0.0.1:9", ["http://127.0.0.1:9/metrics"],
                            timeout_s=2) is None  # nothing listens: no reading, no error


def test_usage_reads_each_cache_in_tokens_of_its_capacity():
    kvrelay = KVRELAY_METRICS + ('kvrelay:kv_cache_usage_perc{worker="prefill-0"} 0.0\n'
                                 'kvrelay:num_requests_running{worker="decode-0"} 3.0\n')
    decode, prefill = kv_capacity.usage(kvrelay)
    assert (decode.name, decode.capacity_tokens, decode.running) == ("decode-0", 32768, 3)
    assert decode.held_tokens == 16384 and decode.block_size is None
    assert prefill.held_tokens == 0 and prefill.running == 0
    vllm = VLLM_METRICS.replace("num_requests_running{engine=\"0\",model_name=\"m\"} 0.0",
                                "num_requests_running{engine=\"0\",model_name=\"m\"} 2.0")
    assert kv_capacity.usage(vllm) == []  # no usage gauge: nothing to say
    vllm += 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    (engine,) = kv_capacity.usage(vllm)
    assert (engine.capacity_tokens, engine.block_size, engine.running) == (227 * 128, 128, 2)
    assert engine.num_blocks == 227
    assert engine.held_tokens == 227 * 128 / 4
