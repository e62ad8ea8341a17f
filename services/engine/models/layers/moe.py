"""A sparse mixture-of-experts block (Mixtral, Qwen3-MoE): a float32 router picks each token's
top-k experts, the experts' gated MLPs run grouped by expert (kernels/moe_dispatch.py: one
matmul per active expert on CPU, a grouped Triton GEMM on CUDA), and their outputs are summed
with the routing weights."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.kernels.moe_dispatch import fused_moe
from kvrelay.kernels.moe_routing import select_experts
from kvrelay.kernels.moe_weights import ExpertWeights
from kvrelay.engine.models.arch import MoESpec


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, spec: MoESpec, activation: str) -> None:
        super().__init__()
        self.spec = spec
        self.activation = activation
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False)  # the router
        num_held = spec.num_experts if spec.local_experts is None else len(spec.local_experts)
        # every held expert's gate and up rows fused (gate first), and its down projection
        self.experts = ExpertWeights(
            torch.empty(num_held, 2 * spec.intermediate_size, hidden_size),
            torch.empty(num_held, hidden_size, spec.intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, hidden]
        # The router in float32 whatever the model's dtype: a bf16 score can flip which
        # experts a token gets where two are close.
        router_logits = F.linear(x.float(), self.gate.weight.float())  # [T, E]
        weights, ids = select_experts(router_logits, self.spec.top_k, self.spec.renormalize)
        if self.spec.local_experts is not None:
            return self._held_experts_share(x, weights, ids)
        return fused_moe(x, self.experts, weights, ids, self.activation)

    def _held_experts_share(self, x: torch.Tensor, weights: torch.Tensor,
                            ids: torch.Tensor) -> torch.Tensor:
        """Expert parallel: the part of each token's sum that this rank's experts make (each
        routed (token, slot) pair whose expert is held here, as a batch of one slot each);
        the ranks' parts are summed by the all-reduce after the layer's MLP."""
        held = self.spec.local_experts
        local_ids = ids - held.start  # [T, k]
        tokens, slots = ((local_ids >= 0) & (local_ids < len(held))).nonzero(as_tuple=True)
        share = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, hidden]
        if tokens.numel():
            products = fused_moe(x[tokens], self.experts, weights[tokens, slots].unsqueeze(1),
                                 local_ids[tokens, slots].unsqueeze(1), self.activation)
            share.index_add_(0, tokens, products.float())
        return share.to(x.dtype)
