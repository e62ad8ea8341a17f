"""`kvrelay bench`: serving benchmarks against any OpenAI-compatible server (`serve`) and the
in-process engine (`latency`, `throughput`), on the standard workloads (BENCHMARKS.md)."""
