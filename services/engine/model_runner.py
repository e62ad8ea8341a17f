"""Owns the weights and the KV cache; turns a scheduled step into one varlen forward pass."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvrelay.common.env_switches import PAD_STEPS, WIDEN_BF16_WEIGHTS
from kvrelay.kernels import kv_quant
from kvrelay.kernels.onednn_linear import onednn_packs_bf16
from kvrelay.kernels.metadata import build_attention_metadata
from kvrelay.kernels.native_cpu import paged_decode_op
from kvrelay.kernels.native_elementwise import elementwise_ops
from kvrelay.engine import pooling, prompt_logprobs, shared_pages
from kvrelay.engine.pooling import PoolRows
from kvrelay.engine.prompt_logprobs import PromptRows
from kvrelay.engine.step_results import Pooled, PromptLogprobs
from kvrelay.engine.kv_groups import KVGroupLayout
from kvrelay.engine.lora.slots import AdapterSlots
from kvrelay.engine.models import gguf_int4, gguf_q8_head, quant_schemes, small_steps
from kvrelay.engine.models.fp8_checkpoint import Fp8Checkpoint
from kvrelay.engine.models.int4_checkpoint import Int4Checkpoint
from kvrelay.engine.models.decoder import DecoderLM
from kvrelay.engine.models.no_init import skip_weight_init
from kvrelay.engine.models.registry import arch_spec, build_model
from kvrelay.engine.kv_pages import KvPages
from kvrelay.engine.parallel.group import TPGroup
from kvrelay.engine.parallel.group_kv import allocate_group_kv_cache
from kvrelay.engine.parallel.pipeline import PipelineStage, Sending, pack_header
from kvrelay.engine.parallel import stage_kv
from kvrelay.engine.parallel.shard import Sharder, group_kv_heads
from kvrelay.engine.parallel.staged_pages import KvWrites, StagedKvPages, write_own
from kvrelay.engine.models.packed_linear import onednn_min_rows, packing_supported
from kvrelay.engine.models.weights import iter_checkpoint, load_weights
from kvrelay.engine.step_padding import PAD_SLOT, PAD_TOKEN_ID, padded_rows

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepInput:
    """One step's flat batch; `sample_rows` maps logits rows back to the scheduled items.
    T may exceed the scheduled tokens (cu_seqlens_q[-1]) by pad rows (step_padding.py)."""
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mappings: list[torch.Tensor]  # per KV group: [T] int64, -1 on pad rows
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: list[torch.Tensor]  # per KV group: [B, max_blocks] int32
    # [S] int64: the last token of each sampling sequence; a speculative one's drafts too
    logits_indices: torch.Tensor
    sample_rows: list[int]  # [S] index into the scheduled list (repeated for drafts)
    max_seqlen_q: int
    max_seqlen_k: int
    # rows whose next token is a prompt token, for requests that ask for prompt logprobs:
    # [P] int64 flat rows, and per item which tokens they predict (prompt_logprobs.py)
    prompt_indices: torch.Tensor | None = None
    prompt_rows: list[PromptRows] = field(default_factory=list)
    # rows an embedding pools: [Q] int64 flat rows, and per item how many (pooling.py)
    pool_indices: torch.Tensor | None = None
    pool_rows: list[PoolRows] = field(default_factory=list)
    # [T] int32: each row's LoRA adapter id (0: the base), or None when no row has one
    token_adapters: np.ndarray | None = None


@dataclass(slots=True)
class StepResult:
    logits: torch.Tensor  # [S, vocab] float32, the sampled rows'
    prompt_logprobs: list[PromptLogprobs]
    pooled: list[Pooled]  # the embeddings the step finished


class ModelRunner:
    """`model_dir` None: random weights (benchmarks with a model's config but no checkpoint)."""

    def __init__(self, hf_config, model_dir: Path | None, dtype: torch.dtype, device: torch.device,
                 block_size: int, num_blocks: int | None,
                 kv_cache_memory: int | Callable[[], int],
                 kv_cache_path: str | None = None, int4_max_tokens: int = 0,
                 amx_max_tokens: int = 0, q4a8_max_tokens: int = 0,
                 int8_activations: bool = False, kv_cache_dtype: str = "auto",
                 tp: TPGroup = TPGroup(), pp: PipelineStage = PipelineStage(),
                 expert_parallel: bool = False) -> None:
        self.device = device
        # a MoE's experts whole on each rank of a tensor-parallel group (parallel/shard.py)
        self.expert_parallel = expert_parallel
        self.tp = tp  # this rank of a tensor-parallel group (parallel/)
        self.pp = pp  # this stage of a pipeline-parallel group (parallel/pipeline.py)
        if self.tp.size > 1:  # the 4-bit kernels read whole weights from the checkpoint's
            # blocks: a shard's small steps run on the gemv kernel's bf16 tiles of its own
            # weights (a pipeline stage's layers are whole: its steps take the 4-bit kernels)
            amx_max_tokens = q4a8_max_tokens = 0
            int8_activations = False
        self.dtype = dtype
        self.kv_format = kv_quant.parse(kv_cache_dtype)  # None: the model's dtype
        self.block_size = block_size
        self.int4_max_tokens = int4_max_tokens
        self.amx_max_tokens = amx_max_tokens
        self.q4a8_max_tokens = q4a8_max_tokens
        self.int8_activations = int8_activations
        self.uses_int4 = False  # the checkpoint's 4-bit weights run small steps
        self.int4_kernel: str | None = None  # which kernel multiplies them: "native", "torch"
        self.uses_amx = False  # AMX tiles run the steps just above those
        self.q8_head = False  # the head's small steps read the checkpoint's 8-bit blocks
        self.q4a8: str | None = None  # how the VNNI kernel codes activations, where it runs
        self.decode_stack = False  # the smallest decode steps' layers in one native call
        self.bf16_gemv = False  # a bf16 checkpoint's smallest steps on the gemv kernel's tiles
        self.quantization: str | None = None  # a GPTQ/AWQ/FP8 checkpoint's scheme, described
        self.model = self._load_model(hf_config, model_dir)
        self.lora: AdapterSlots | None = None  # enable_lora
        # Steps of this many rows or more reach oneDNN and are padded to a bucket; None: none.
        self.pad_from_rows = (onednn_min_rows(self.model.layers)
                              if PAD_STEPS.enabled() else None)
        self.num_kv_heads = self.model.spec.num_kv_heads  # this rank's
        self.head_dim = (getattr(hf_config, "head_dim", None)
                         or hf_config.hidden_size // hf_config.num_attention_heads)
        self.num_layers = hf_config.num_hidden_layers
        # a cache row (one token's kv head): head_dim values, or 8-bit codes and their scale
        self.kv_row_width = kv_quant.row_width(self.head_dim, self.kv_format)
        self.kv_cache_dtype = dtype if self.kv_format is None else self.kv_format.dtype
        # Layers in KV groups of equal size, one window each (kv_groups.py); without windows,
        # one group of every layer.
        self.kv_layout = KVGroupLayout.from_windows(self.model.layer_windows)
        self.slots_per_block = self.kv_layout.slots_per_block
        self.slots_done_after = self.kv_layout.slots_done_after()  # (KV pushes: kv_connector)
        log.info("%s", self.kv_layout.describe())
        self.num_blocks = self._agreed_num_blocks(num_blocks, kv_cache_memory)
        # [slots, 2 (K, V), num_blocks, block_size, kv_heads, row_width]: a block holds the
        # pages of `slots` layers (every layer without windows); layer l uses slot(l) through
        # its group's block table. A group's ranks hold their heads' shards of every block.
        shape = (self.slots_per_block, 2, self.num_blocks, block_size, self.num_kv_heads,
                 self.kv_row_width)
        # The pages of every KV head, as the KV connector moves them (None: a group without
        # a shared cache file, whose other ranks' pages this process cannot reach).
        self.kv_pages: KvPages | None = None
        if pp.size > 1:
            self.kv_cache, self.kv_caches, self.kv_pages = stage_kv.allocate(
                shape, self.kv_cache_dtype, device, kv_cache_path, pp, self.kv_layout)
        elif tp.size > 1 and kv_cache_path is not None:
            shards = allocate_group_kv_cache(shape, self.kv_cache_dtype, kv_cache_path,
                                             tp.rank, tp.size)
            self.kv_cache = shards[0]  # this rank's (the leader holds every rank's)
            if tp.is_leader:
                total_kv_heads = arch_spec(hf_config)[1].num_kv_heads
                self.kv_pages = KvPages(shards, group_kv_heads(total_kv_heads, tp.size))
        else:
            self.kv_cache = allocate_kv_cache(shape, self.kv_cache_dtype, device, kv_cache_path)
            if tp.size == 1:
                self.kv_pages = KvPages.whole(self.kv_cache)
        if pp.size == 1:
            self.kv_caches = [(self.kv_cache[slot][0], self.kv_cache[slot][1])
                              for slot in self.kv_layout.layer_slot]  # per layer
        if device.type == "cpu":
            paged_decode_op()  # build or load the native decode kernel now, not on step one

    def _agreed_num_blocks(self, num_blocks: int | None,
                           kv_cache_memory: int | Callable[[], int]) -> int:
        """--num-kv-blocks, or as many blocks as the budget holds. A group's budget covers every
        rank's shard and the leader's count holds for all (a count of their own would differ
        with each rank's free memory)."""
        if num_blocks is None and self.pp.hosts > 1:
            return self._blocks_every_host_holds(kv_cache_memory)
        if num_blocks is None and self.tp.is_leader:
            if callable(kv_cache_memory):
                kv_cache_memory = kv_cache_memory()  # sized from what is free, weights in
            num_blocks = max(1, kv_cache_memory // (self.bytes_per_block * self.tp.size))
        return self.group.broadcast_object(num_blocks)

    def _blocks_every_host_holds(self, kv_cache_memory: int | Callable[[], int]) -> int:
        """A pipeline across hosts: each stage sizes the cache from its own host's budget (its
        slots only; the host's stages share the budget), and the group takes the least."""
        if callable(kv_cache_memory):
            kv_cache_memory = kv_cache_memory()
        first, last = stage_kv.slot_run(self.kv_layout, self.pp.layers)
        stage_block_bytes = self.bytes_per_block * (last - first + 1) // self.slots_per_block
        return self.pp.least(max(1, kv_cache_memory
                                 // (stage_block_bytes * self.pp.stages_per_host)))

    @property
    def group(self):
        """The group of processes this runner leads or belongs to (a TPGroup of one when the
        model is whole here)."""
        return self.pp if self.pp.size > 1 else self.tp

    @property
    def split(self) -> bool:
        """The model is split across processes (tensor or pipeline parallel)."""
        return self.tp.size > 1 or self.pp.size > 1

    def enable_lora(self, max_loras: int, max_rank: int,
                    held_adapters: Callable[[], frozenset[int]] = frozenset) -> AdapterSlots:
        """Make the model's linears adaptable: `max_loras` slots of rank `max_rank`.
        held_adapters: the adapter ids of the owner's live sequences (kept resident)."""
        if self.split:
            raise ValueError("LoRA adapters under tensor or pipeline parallelism are not "
                             "served yet")
        self.lora = AdapterSlots(self.model, max_loras, max_rank, self.dtype, self.device,
                                 held_adapters)
        return self.lora

    @property
    def bytes_per_block(self) -> int:
        element_size = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        return (2 * self.slots_per_block * self.block_size * self.num_kv_heads
                * self.kv_row_width * element_size)

    @property
    def kv_cache_dtype_name(self) -> str:
        """What the cache holds, as registration, logs and metrics name it: "bfloat16",
        "fp8_e4m3", ..."""
        if self.kv_format is not None:
            return self.kv_format.name
        return str(self.dtype).removeprefix("torch.")

    def _load_model(self, hf_config, model_dir: Path | None) -> DecoderLM:
        with torch.device("meta"), skip_weight_init():
            model, rename = build_model(hf_config, self.tp, self.pp.layers,
                                        self.expert_parallel)
        if model_dir is None:
            # Random weights, made where they run (an 8B model's float32 copy on the host
            # would be 32 GB): for kernel and speed measurements with a real config.
            model = model.to_empty(device=self.device).to(self.dtype)
            randomize_weights_(model)
            quantized = None
        else:
            model = model.to_empty(device="cpu")
            quantized = self._quantized_checkpoint(hf_config, model_dir, rename)
            if quantized is not None and self.tp.size > 1:
                raise ValueError("tensor parallel: quantized checkpoints are not split across "
                                 "ranks yet (a pipeline's stages take them whole)")
            if self.tp.size > 1:
                tensors = sharded(hf_config, model_dir, rename, self.tp, self.expert_parallel)
            elif isinstance(quantized, Int4Checkpoint):  # a stage unpacks only its modules
                tensors = quantized.tensors(lambda module: stage_kv.held(module, model))
            else:
                tensors = None if quantized is None else quantized.tensors()
            if self.pp.size > 1:
                tensors = stage_kv.stage_tensors(tensors or iter_checkpoint(model_dir), rename,
                                                 model)
            load_weights(model, model_dir, rename, tensors)
        q4_blocks = self._q4_blocks(hf_config, model_dir, model, quantized)
        del quantized  # an int4 checkpoint's unpacked codes: the blocks hold what steps need
        q8_head = self._q8_head(model_dir, model) if q4_blocks else None
        model = model.to(device=self.device, dtype=self.dtype).eval()
        model.reset_rope_tables_()  # float32 whatever the dtype (meta-built buffers held none)
        model.rope_tables_to_(self.device)
        if packing_supported(self.device, self.dtype):
            # a bf16 checkpoint's small steps on the gemv kernel: its tiles before packing
            bf16_tiles = small_steps.bf16_layer_tiles(model) \
                if self.int4_max_tokens and not q4_blocks else {}
            model.pack_for_cpu_()
            if not onednn_packs_bf16() and WIDEN_BF16_WEIGHTS.enabled():
                log.info("bf16 GEMMs are emulated on this CPU (no AVX-512 or AVX-NE-CONVERT): "
                         "the large steps' weights are kept in float32 (packed_linear.py)")
            # bf16 only: in float32 the torch ops stay, so parity with HF is op for op.
            ops = elementwise_ops()
            if ops is not None:
                model.use_native_cpu_ops_(ops)
                for fallback in model.torch_fallbacks():
                    log.info("%s: %s on torch ops", hf_config.model_type, fallback)
            self._use_small_step_kernels(model, q4_blocks or {}, q8_head, bf16_tiles)
        return model

    def _use_small_step_kernels(self, model: DecoderLM, q4_blocks: dict,
                                q8_head, bf16_tiles: dict) -> None:
        """Steps of up to int4_max_tokens tokens on the 4-bit weights (else bf16 tiles), then
        up to amx_max_tokens on AMX tiles; oneDNN above (small_steps.py)."""
        kernels = small_steps.attach(model, q4_blocks, self.int4_max_tokens, self.amx_max_tokens,
                                     q8_head, self.q4a8_max_tokens, self.int8_activations,
                                     bf16_tiles)
        self.bf16_gemv = kernels.bf16_gemv
        self.int4_kernel = kernels.int4_kernel
        self.uses_int4 = kernels.int4_kernel is not None
        self.uses_amx = kernels.amx
        self.q8_head = kernels.q8_head
        self.q4a8 = kernels.q4a8
        self.decode_stack = kernels.decode_stack

    def _quantized_checkpoint(self, hf_config, model_dir: Path,
                              rename) -> Int4Checkpoint | Fp8Checkpoint | None:
        """A GPTQ/AWQ (int4_checkpoint.py) or FP8 (fp8_checkpoint.py) checkpoint's reader;
        None for plain weights."""
        scheme = quant_schemes.scheme_of(hf_config.to_dict(), model_dir)
        if scheme is None:
            return None
        self.quantization = scheme.describe()
        log.info("%s checkpoint: dequantized to %s at load", self.quantization,
                 str(self.dtype).removeprefix("torch."))
        if isinstance(scheme, quant_schemes.Fp8Scheme):
            return Fp8Checkpoint(model_dir, scheme)
        return Int4Checkpoint(model_dir, scheme, rename)

    def _q4_blocks(self, hf_config, model_dir: Path | None, model,
                   quantized: Int4Checkpoint | Fp8Checkpoint | None) -> dict | None:
        """The 4-bit matmul blocks of a GPTQ/AWQ checkpoint or of the GGUF source (checked
        against the loaded weights), where small steps can run on them: bf16 on CPU (the packed
        path), a Q4_0/Q4_1 source."""
        source = gguf_source(model_dir)
        if (not (self.int4_max_tokens or self.amx_max_tokens or self.q4a8_max_tokens
                 or self.int8_activations) or self.tp.size > 1
                or (source is None and not isinstance(quantized, Int4Checkpoint))
                or not packing_supported(self.device, self.dtype)):
            return None
        if isinstance(quantized, Int4Checkpoint):
            return quantized.layer_blocks(model.stage_layers)
        params = {name: param.detach() for name, param in model.named_parameters()}
        return gguf_int4.load_from_gguf(source, hf_config, params, model.stage_layers)

    def _q8_head(self, model_dir: Path | None, model):
        """The GGUF source's Q8_0 head (gguf_q8_head.py, checked against the loaded head), for
        the small steps' 8-bit kernel; None where the head is not Q8_0 or small steps are off."""
        source = gguf_source(model_dir)
        if not self.int4_max_tokens or source is None or self.tp.size > 1 \
                or not model.holds_ends:  # the head: a pipeline's first stage
            return None
        return gguf_q8_head.load_head_from_gguf(source, model.head_weight.detach())

    def prepare(self, scheduled) -> StepInput:
        """scheduled: list of ScheduledRequest, in batch order."""
        token_chunks, position_chunks = [], []
        num_groups = self.kv_layout.num_groups
        slot_chunks = [[] for _ in range(num_groups)]  # per group, per item
        cu_seqlens, seq_lens, logits_indices, sample_rows = [0], [], [], []
        prompt_indices, prompt_rows, pool_indices, pool_rows = [], [], [], []
        adapter_ids = [item.request.adapter_id for item in scheduled]
        block_tables = [np.zeros((len(scheduled), max(len(item.block_ids[group])
                                                      for item in scheduled)), dtype=np.int32)
                        for group in range(num_groups)]
        for row, item in enumerate(scheduled):
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            positions = np.arange(start, end, dtype=np.int64)
            for group in range(num_groups):
                block_ids = np.asarray(item.block_ids[group], dtype=np.int64)
                block_tables[group][row, :len(block_ids)] = block_ids
                slot_chunks[group].append(block_ids[positions // self.block_size]
                                          * self.block_size + positions % self.block_size)
            token_chunks.append(request.all_token_ids[start:end] + item.draft_token_ids)
            position_chunks.append(positions)
            cu_seqlens.append(cu_seqlens[-1] + item.num_new_tokens)
            seq_lens.append(end)
            if item.samples:
                # a speculative item samples after its last token and after every draft
                num_sampled = 1 + len(item.draft_token_ids)
                logits_indices.extend(range(cu_seqlens[-1] - num_sampled, cu_seqlens[-1]))
                sample_rows.extend([row] * num_sampled)
            rows = prompt_logprobs.prompt_rows(request, start, end)
            if rows is not None:
                first_row = cu_seqlens[-2]
                prompt_indices.extend(range(first_row, first_row + len(rows.target_ids)))
                prompt_rows.append(rows)
            pooled = pooling.pool_rows(request, start, end)
            if pooled is not None:
                first_row = cu_seqlens[-2] + pooled[0] - start
                pool_indices.extend(range(first_row, first_row + pooled[1].num_rows))
                pool_rows.append(pooled[1])
        step = self._to_step_input(token_chunks, position_chunks, slot_chunks, cu_seqlens,
                                   seq_lens, block_tables, logits_indices, sample_rows)
        if prompt_rows:
            step.prompt_indices = torch.tensor(prompt_indices, dtype=torch.int64,
                                               device=self.device)
            step.prompt_rows = prompt_rows
        if pool_rows:
            step.pool_indices = torch.tensor(pool_indices, dtype=torch.int64, device=self.device)
            step.pool_rows = pool_rows
        if any(adapter_ids):
            step.token_adapters = _token_adapters(adapter_ids, np.diff(cu_seqlens),
                                                  step.input_ids.shape[0])
        return step

    def _to_step_input(self, token_chunks, position_chunks, slot_chunks, cu_seqlens, seq_lens,
                       block_tables, logits_indices, sample_rows) -> StepInput:
        device = self.device
        flat_tokens = [token for chunk in token_chunks for token in chunk]
        num_pad = padded_rows(len(flat_tokens), self.pad_from_rows) - len(flat_tokens)
        if num_pad:
            flat_tokens += [PAD_TOKEN_ID] * num_pad
            position_chunks = [*position_chunks, np.zeros(num_pad, dtype=np.int64)]
            pad_slots = np.full(num_pad, PAD_SLOT, dtype=np.int64)
            slot_chunks = [[*chunks, pad_slots] for chunks in slot_chunks]
        query_lens = np.diff(cu_seqlens)
        return StepInput(
            input_ids=torch.tensor(flat_tokens, dtype=torch.int64, device=device),
            positions=torch.from_numpy(np.concatenate(position_chunks)).to(device),
            slot_mappings=[torch.from_numpy(np.concatenate(chunks)).to(device)
                           for chunks in slot_chunks],
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=[torch.from_numpy(table).to(device) for table in block_tables],
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
            sample_rows=sample_rows,
            max_seqlen_q=int(query_lens.max()),
            max_seqlen_k=max(seq_lens),
        )

    def execute(self, step: StepInput, on_layer_done=None) -> torch.Tensor:
        """Run the forward pass; return float32 logits [S, vocab] for the sampled rows."""
        return self.execute_step(step, on_layer_done).logits

    def execute_step(self, step: StepInput, on_layer_done=None) -> StepResult:
        """The forward pass: float32 logits [S, vocab] for the sampled rows, the prompt
        logprobs of the items that ask for them, the embeddings the step finishes."""
        return self.finish_step(self.start_step(step, on_layer_done))

    @torch.inference_mode()
    def start_step(self, step: StepInput, on_layer_done=None) -> PendingStep:
        """The step as far as this process takes it: whole, or through the first pipeline
        stage's layers (the later stages compute it meanwhile; finish_step collects it, and
        the next step may start before that)."""
        if self.tp.size > 1 and self.tp.is_leader:
            self.tp.post_step(step)  # every rank computes the step on its shard
        metas = self._layer_metas(step)
        rows = _output_rows(step)
        if self.lora is not None:
            self.lora.begin_step(step.token_adapters)
        elif step.token_adapters is not None:
            raise ValueError("a step with LoRA adapters on a runner without LoRA")
        try:
            residual, delta = self.model.run_layers(
                self.model.embed(step.input_ids), None, step.positions, self.kv_caches,
                *metas, on_layer_done)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        if self.pp.size > 1:
            sendings = self._send_staged_pages()  # the step reads them on later stages
            self.pp.doorbell.ring()
            sendings.append(self.pp.start_send(*_stage_message(step, residual, delta)))
            return PendingStep(step, on_layer_done=on_layer_done, sendings=sendings)
        return PendingStep(step, residual[rows], None if delta is None else delta[rows])

    @torch.inference_mode()
    def finish_step(self, pending: PendingStep) -> StepResult:
        """The step's outputs from the final norm's rows (from the last stage, or here)."""
        step = pending.step
        if pending.residual_rows is None:  # the last stage's, in the order steps started
            self.pp.doorbell.take_result()
            for sending in pending.sendings:
                self.pp.wait_sent(sending)
            _, _, tensors = self.pp.receive()
            pending.residual_rows, pending.delta_rows = (*tensors, None)[:2]
            if pending.on_layer_done is not None:  # the later stages' layers are stored
                for index in range(self.pp.layers.stop, self.num_layers):
                    pending.on_layer_done(index)
        hidden = self.model.final_norm(pending.residual_rows, pending.delta_rows)
        num_sampled = step.logits_indices.shape[0]
        num_prompt = 0 if step.prompt_indices is None else step.prompt_indices.shape[0]
        logits = self.model.logits_of(hidden[:num_sampled])
        scored = prompt_logprobs.compute(
            self.model.logits_of, hidden[num_sampled:num_sampled + num_prompt],
            step.prompt_rows) if step.prompt_rows else []
        pooled = pooling.pool(hidden[num_sampled + num_prompt:], step.pool_rows) \
            if step.pool_rows else []
        return StepResult(logits, scored, pooled)

    def result_ready(self, pending: PendingStep) -> bool:
        """Whether finish_step would find the step's rows here or on their way (not wait
        for a stage still computing it); steps are collected in the order they started."""
        return pending.residual_rows is not None or self.pp.doorbell.result_ready()

    def _send_staged_pages(self) -> list[Sending]:
        """Leader: the KV pages the connector wrote for the other stages' slots, sent down the
        pipeline (each stage writes its own: write_staged_pages)."""
        if not isinstance(self.kv_pages, StagedKvPages):
            return []
        message = self.kv_pages.take_pending()
        if message is None:
            return []
        writes, tensors = message
        self.pp.doorbell.ring()
        return [self.pp.start_send(pack_header(writes, tensors), tensors)]

    def write_staged_pages(self, writes: KvWrites, tensors: list[torch.Tensor]) -> None:
        """A later stage: the entries of its own slots into its cache, those of later stages'
        slots passed on."""
        layout = self.kv_layout
        first_slot = stage_kv.slot_run(layout, self.pp.layers)[0]
        later_slots = stage_kv.slots_held(layout, self.pp.every_stage_layers[self.pp.stage + 1:])
        onward = write_own(KvPages.whole(self.kv_cache), first_slot, writes, tensors,
                           later_slots)
        if not self.pp.is_last:
            self.pp.send(pack_header(*onward), onward[1])

    @torch.inference_mode()
    def run_stage(self, step: StepInput, header: bytes, tensors: list[torch.Tensor]) -> None:
        """A later pipeline stage: this stage's layers over the activations the stage before
        sent, passed on to the next stage (the same header: the same shapes), or from the
        last, the final norm's rows back to the leader."""
        residual, delta = (*tensors, None)[:2]
        residual, delta = self.model.run_layers(residual, delta, step.positions,
                                                self.kv_caches, *self._layer_metas(step))
        if not self.pp.is_last:
            self.pp.send(header, [tensor for tensor in (residual, delta) if tensor is not None])
            return
        rows = _output_rows(step)
        self.pp.doorbell.returning()  # before the send: it completes as the leader receives
        self.pp.send(*_stage_message(None, residual[rows],
                                     None if delta is None else delta[rows]))

    def _layer_metas(self, step: StepInput) -> tuple[list, list]:
        """Per model layer: its KV group's slot mapping and attention metadata. One metadata
        per group, with the group's window (layers of a window group see only the last W keys;
        the blocks before those may already be freed)."""
        group_metas = [build_attention_metadata(step.cu_seqlens_q, step.seq_lens, table,
                                                self.block_size, max_seqlen_q=step.max_seqlen_q,
                                                max_seqlen_k=step.max_seqlen_k,
                                                window=self.kv_layout.groups[group].window)
                       for group, table in enumerate(step.block_tables)]
        layer_groups = self.kv_layout.layer_group
        return ([step.slot_mappings[group] for group in layer_groups],
                [group_metas[group] for group in layer_groups])


@dataclass(slots=True)
class PendingStep:
    """A step started (start_step): the final norm's input rows once computed here, or None
    while the last pipeline stage still has them."""
    step: StepInput
    residual_rows: torch.Tensor | None = None  # [R, hidden]
    delta_rows: torch.Tensor | None = None  # [R, hidden], where the layers' adds are fused
    on_layer_done: Callable[[int], None] | None = None
    # its activations on the way to the next stage (after the KV pages the stages hold for
    # it, sent first where the connector wrote some: staged_pages.py)
    sendings: list[Sending] = field(default_factory=list)


def _output_rows(step: StepInput) -> torch.Tensor:
    """[R] int64: the rows the step samples, then those it scores, then those it pools."""
    if not (step.prompt_rows or step.pool_rows):
        return step.logits_indices
    parts = [step.logits_indices, step.prompt_indices, step.pool_indices]
    return torch.cat([part for part in parts if part is not None])


def _stage_message(value, residual: torch.Tensor, delta: torch.Tensor | None):
    tensors = [residual] if delta is None else [residual, delta]
    return pack_header(value, tensors), tensors


def sharded(hf_config, model_dir: Path, rename, tp: TPGroup, expert_parallel: bool):
    """The checkpoint's tensors cut to this rank's shard (parallel/shard.py), other ranks'
    experts left out under expert parallel."""
    sharder = Sharder(arch_spec(hf_config)[1], tp.rank, tp.size, expert_parallel)
    for name, tensor in iter_checkpoint(model_dir):
        piece = sharder(rename(name.removeprefix("model.")), tensor)
        if piece is not None:
            yield sharder.local_name(name), piece


def _token_adapters(adapter_ids: list[int], rows_per_item: np.ndarray,
                    num_rows: int) -> np.ndarray:
    """[num_rows] int32: each item's adapter id over its rows, 0 on the pad rows after."""
    per_row = np.repeat(np.asarray(adapter_ids, dtype=np.int32), rows_per_item)
    return np.pad(per_row, (0, num_rows - per_row.shape[0]))


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                      path: str | None) -> torch.Tensor:
    """Zeroed KV cache; with `path` (CPU only) it lives in a shared file that another process on
    this host can map, which is what the shared-memory KV transport writes into."""
    if path is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    if device.type != "cpu":
        raise ValueError("a shared-memory KV cache needs device cpu")
    num_bytes = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
    # its pages allocated now: a filesystem without room for them fails here, not with SIGBUS
    shared_pages.reserve(path, num_bytes)
    cache = torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
    shared_pages.populate(cache)  # and mapped now, not a fault at a time in the steps
    return cache.view(dtype).view(shape)


@torch.no_grad()
def randomize_weights_(model: torch.nn.Module, std: float = 0.02) -> None:
    """Norm weights 1, biases 0, every other weight N(0, std): activations stay in range."""
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std)


def gguf_source(model_dir: Path | None) -> str | None:
    """The .gguf file a converted model directory was made from (model_loader.py), if any."""
    marker = None if model_dir is None else model_dir / "kvrelay-source.json"
    if marker is None or not marker.is_file():
        return None
    source = json.loads(marker.read_text()).get("gguf")
    return source if source and Path(source).is_file() else None
