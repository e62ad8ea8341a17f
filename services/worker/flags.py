"""`kvrelay worker`'s flags, apart from its entry module so that `kvrelay up` and the
configuration docs read them without loading torch."""
from __future__ import annotations

import argparse

from kvrelay.common.flags import add_flag
from kvrelay.common.lora_flags import add_enable_lora, add_max_loras
from kvrelay.common.tls import add_tls_flags
from kvrelay.kernels import kv_code_names
from kvrelay.worker import kv_budget

ROLE_NAMES = ("both", "decode", "prefill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--role", choices=ROLE_NAMES, default="both")
    add_flag(parser, "--host", default="0.0.0.0")
    add_flag(parser, "--port", type=int, default=50060, help="Worker + KvTransfer gRPC port")
    add_flag(parser, "--advertise-address", default=None,
             help="host:port the scheduler and other workers dial (default 127.0.0.1:PORT)")
    add_flag(parser, "--kv-advertise-address", default=None,
             help="host:port other workers push KV pages to over gRPC, where that traffic "
                  "takes another network or path (default: --advertise-address)")
    add_flag(parser, "--metrics-port", type=int, default=9110, help="0: no metrics endpoint")
    add_flag(parser, "--scheduler-address", default="127.0.0.1:50052")
    add_flag(parser, "--worker-id", default=None, help="default: role-hostname-random")
    add_flag(parser, "--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    add_flag(parser, "--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    add_flag(parser, "--device", choices=["auto", "cpu", "cuda"], default="auto")
    add_flag(parser, "--kv-cache-memory", type=_kv_memory, default=kv_budget.AUTO,
             help="KV cache size in bytes, with a unit if wanted (4GiB, 512MiB), or auto: "
                  "--kv-cache-memory-fraction of the memory the worker sees (its container's "
                  "limit, else the machine's RAM), at most what is free at start less 2 GiB. "
                  "Unset, vLLM's VLLM_CPU_KVCACHE_SPACE (GiB) is honoured. The worker logs the "
                  "size and its token capacity at start")
    add_flag(parser, "--kv-cache-memory-fraction", type=_fraction,
             default=kv_budget.DEFAULT_FRACTION,
             help="auto's share of the memory, per worker (kvrelay up runs two on one host)")
    add_flag(parser, "--num-kv-blocks", type=int, default=None, help="overrides kv-cache-memory")
    add_flag(parser, "--kv-cache-dtype", choices=kv_code_names.CHOICES, default="auto",
             help="the KV cache's element: auto (the model's dtype), or 8-bit codes with a "
                  "float32 scale per token and kv head: int8, fp8_e4m3 (fp8, fp8_e4m3fn: vLLM's "
                  "names) or fp8_e5m2, about half of bf16's bytes, so about twice the tokens in "
                  "--kv-cache-memory. Every worker of a group must use the same")
    add_flag(parser, "--int4-max-tokens", type=int, default=4,
             help="steps of at most this many tokens multiply the checkpoint's own 4-bit "
                  "weights (GGUF Q4_0/Q4_1, bf16 on CPU) on the native AVX512-BF16 kernel, a "
                  "quarter of the bytes; a bf16 checkpoint's on the same kernel from a second "
                  "copy of its layer weights (0: never)")
    add_flag(parser, "--amx-max-tokens", type=int, default=64,
             help="steps above --int4-max-tokens and up to this many tokens run on AMX tiles "
                  "(the 4-bit weights widened in cache; the head in bf16) where the CPU has "
                  "AMX-BF16 (0: never)")
    add_flag(parser, "--q4a8-max-tokens", type=int, default=11,
             help="where the CPU has AVX512-VNNI, steps above "
                  "--int4-max-tokens up to this many tokens multiply the 4-bit weights on "
                  "integer dot products, activations coded finer than bf16 (0: never)")
    add_flag(parser, "--int8-activations", action="store_true", default=False,
             help="there, every layer step (prefill included) on that kernel with activations "
                  "coded as int8 per 32 values, as llama.cpp does: faster, less accurate")
    add_flag(parser, "--block-size", type=int, default=16)
    add_flag(parser, "--tensor-parallel-size", "-tp", type=int, default=1,
             help="ranks of this worker's tensor-parallel group on this host (CPU): the "
                  "worker starts N-1 more processes, each holding 1/N of every layer's weights "
                  "and its share of the KV heads, on --num-threads threads each (default: "
                  "its share of the cores); the scheduler sees one worker")
    add_flag(parser, "--enable-expert-parallel", action="store_true", default=False,
             help="with --tensor-parallel-size N, a mixture-of-experts model's experts whole "
                  "on each rank (E / N each; the router and attention as before) instead of "
                  "every expert split by its columns")
    add_flag(parser, "--pipeline-parallel-size", "-pp", type=int, default=1,
             help="stages of this worker's pipeline on this host (CPU): the worker starts "
                  "N-1 more processes, each holding a contiguous run of the layers and their KV "
                  "cache, on --num-threads threads each (default: its share of the cores); "
                  "steps of different sequences are in flight in different stages at once; "
                  "the scheduler sees one worker")
    add_flag(parser, "--pp-layer-partition", default=None,
             help="each pipeline stage's layer count, comma-separated (\"13,17\"); default: "
                  "balanced by the weights a token goes through, the first stage holding the "
                  "head")
    add_flag(parser, "--nnodes", type=int, default=1,
             help="hosts this worker's pipeline spans, each running as many consecutive stages "
                  "(--pipeline-parallel-size / N); every host runs `kvrelay worker` with the "
                  "same --nnodes, --pipeline-parallel-size and --dist-init-address")
    add_flag(parser, "--node-rank", type=int, default=0,
             help="this host's place among --nnodes: 0 runs the first stages and the leader "
                  "(it registers with the scheduler and serves steps; its flags choose the "
                  "model and settings), the others run their stages for it (their --model, "
                  "if given, only where this host keeps the same checkpoint)")
    add_flag(parser, "--dist-init-address", default=None,
             help="HOST:PORT of node 0's rendezvous (a torch.distributed TCPStore it opens), "
                  "reachable from every host; gloo then connects the stages on ports of its "
                  "own over the interface that routes there (GLOO_SOCKET_IFNAME overrides)")
    add_flag(parser, "--tensor-parallel-timeout", type=float, default=30.0,
             help="seconds a rank or pipeline stage may lag inside a step before its group is "
                  "declared broken (the worker exits and is restarted; its requests are "
                  "re-prefilled)")
    add_enable_lora(parser)
    add_max_loras(parser)
    add_flag(parser, "--max-lora-rank", type=int, default=16,
             help="the largest LoRA rank an adapter may have (its slots are this wide)")
    add_flag(parser, "--no-warmup", action="store_true", default=False,
             help="register as soon as the model is loaded, without first running each step "
                  "shape of the role once (bf16 on CPU; services/worker/warmup.py)")
    add_flag(parser, "--max-model-len", type=int, default=None)
    add_flag(parser, "--num-threads", type=int, default=None, help="torch threads")
    add_flag(parser, "--kv-transports", default="grpc,shm",
             help="comma list of KV transports this worker can use (grpc, shm)")
    add_flag(parser, "--layerwise-kv-push", choices=["auto", "on", "off"], default="auto",
             help="push KV pages layer by layer during the forward pass (auto: on CUDA only)")
    add_flag(parser, "--kv-transfer-timeout", type=float, default=30.0, help="seconds")
    add_flag(parser, "--shm-dir", default="/dev/shm",
             help="where a decode worker maps its KV cache for the shm transport")
    add_flag(parser, "--drain-timeout", type=float, default=60.0, help="seconds")
    add_tls_flags(parser)
    add_flag(parser, "--log-level", default="info")


def _kv_memory(text: str) -> int | str:
    try:
        return kv_budget.parse_kv_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(text: str) -> float:
    try:
        return kv_budget.parse_fraction(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
