"""Engine configuration: one validated dataclass, built from keyword arguments."""
from __future__ import annotations

from dataclasses import dataclass, fields

from kvrelay.engine.parallel.partition import parse_partition
from kvrelay.engine.spec.config import SpeculativeConfig
from kvrelay.kernels.kv_code_names import canonical as canonical_kv_cache_dtype

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("fcfs", "priority")
GRAMMAR_BACKENDS = ("llguidance", "xgrammar")  # structured/compiler.py builds each
MAX_LORA_RANK = 512  # vLLM's largest too


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct, Q4_1 GGUF)
    dtype: str = "auto"  # auto: bfloat16 where the hardware has fast bf16 matmuls, else float32
    device: str = "auto"  # auto: cuda when available, else cpu
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes for K and V of all layers
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    # The KV cache's element: "auto" (the model's dtype), or 8-bit codes with a float32 scale per
    # (token, kv head) row, "int8", "fp8_e4m3" (vLLM's "fp8") or "fp8_e5m2": about half the
    # bytes of bf16, so twice the tokens in the same memory (kernels/kv_quant.py).
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # While sequences decode, a prompt with more tokens left than this is prefilled in chunks
    # of long_prefill_chunk_size tokens (0: the threshold), fewer further into the prompt, and
    # at most max_long_partial_prefills of them advance per step, so a long prompt cannot
    # stretch every decoding sequence's step. 0: a prompt may take the whole budget.
    long_prefill_token_threshold: int = 0
    long_prefill_chunk_size: int = 0
    max_long_partial_prefills: int = 1
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_threads: int | None = None  # torch intra-op threads; None: all cores
    # Steps of at most this many tokens multiply the checkpoint's own 4-bit weights (a GGUF
    # source's Q4_0/Q4_1/Q4_K matmuls, a GPTQ/AWQ checkpoint; bf16 on CPU): they are bound by
    # reading the weights. The native
    # AVX512-BF16 kernel where it builds (the head too), else torch's int4 kernel
    # (models/small_steps.py). A bf16 checkpoint without 4-bit blocks runs those steps on the
    # native kernel's bf16 tiles, a second copy of its layer weights. 0: never.
    int4_max_tokens: int = 4
    # Steps above those (and above q4a8_max_tokens where that kernel runs) up to this many
    # tokens run on AMX tiles (kernels/native_amx.py: the 4-bit weights widened in L1, the head
    # in bf16) where the CPU has AMX-BF16; oneDNN above, where it is faster. 0: never.
    amx_max_tokens: int = 64
    # Where the CPU has AVX512-VNNI, the layers' steps above
    # int4_max_tokens up to this many tokens multiply the 4-bit weights on integer dot products,
    # the activations coded as two int8 per value per 32 values (~15 bits: finer than bf16;
    # kernels/native_q4a8.py). 0: never (oneDNN).
    q4a8_max_tokens: int = 11
    # There, every layer step (prefill included) on that kernel with the activations coded
    # once, as int8 per 32 values (llama.cpp's Q8 activations): 1.3-1.5x the bf16 matmuls at
    # 64 rows and more at few, at a cost in accuracy (BENCHMARKS.md). Off by default.
    int8_activations: bool = False
    seed: int = 0  # for unseeded sampling
    structured_outputs_backend: str = "llguidance"  # or "xgrammar" (structured/compiler.py)
    # Speculative decoding (spec/config.py): a SpeculativeConfig, or its dict or JSON text as
    # vLLM's --speculative-config takes it. None: off.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # LoRA adapters (engine/lora/): up to max_loras of them in one step (resident in the
    # model's slots), each of rank <= max_lora_rank; lora_modules names adapters to load at
    # start, {name: PEFT directory}. Off: no adapter can be loaded, and no cost.
    # Tensor parallelism (engine/parallel/): the model's layers split over this many ranks,
    # each a process with its share of the cores (torch.distributed: gloo on CPU, NCCL on
    # CUDA); 1: one process.
    tensor_parallel_size: int = 1
    # Under tensor parallelism, a mixture-of-experts model's experts whole on each rank (E / N
    # each, vLLM's enable_expert_parallel) instead of every expert split by its columns.
    enable_expert_parallel: bool = False
    # Pipeline parallelism (engine/parallel/pipeline.py): the layers split into this many
    # contiguous stages, each a process with its share of the cores; pp_layer_partition gives
    # each stage's layer count ("11,19"), else the split balances the weights a decode row
    # reads (parallel/partition.py).
    pipeline_parallel_size: int = 1
    pp_layer_partition: str | None = None
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    lora_modules: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not 1 <= self.block_size <= 256 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two <= 256, got {self.block_size}")
        for name in ("kv_cache_memory", "max_num_batched_tokens", "max_num_seqs",
                     "max_long_partial_prefills", "max_loras", "max_lora_rank",
                     "tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError("tensor and pipeline parallelism together are not served yet: "
                             "set one of tensor_parallel_size, pipeline_parallel_size to 1")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("enable_expert_parallel splits experts across the ranks of "
                             "tensor_parallel_size > 1")
        parse_partition(self.pp_layer_partition)  # ValueError: not counts
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        for name in ("long_prefill_token_threshold", "long_prefill_chunk_size",
                     "int4_max_tokens", "amx_max_tokens", "q4a8_max_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        self.kv_cache_dtype = canonical_kv_cache_dtype(self.kv_cache_dtype)
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.structured_outputs_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {GRAMMAR_BACKENDS}, "
                             f"got {self.structured_outputs_backend!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be <= {MAX_LORA_RANK}, got "
                             f"{self.max_lora_rank}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora=True")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**kwargs)
