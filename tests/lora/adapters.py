"""Random LoRA adapters made with peft on the default model, saved in the PEFT format.

peft initialises B to zero (an adapter that changes nothing); these draw A and B at random at a
scale that changes the model's greedy tokens without wrecking it, so parity means something."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    targets: tuple[str, ...]
    alpha: float = 16.0
    rslora: bool = False
    layers: tuple[int, ...] | None = None  # None: every layer
    seed: int = 0


def make_adapter(base_model, spec: AdapterSpec, directory: Path):
    """Save an adapter for `base_model` (left unchanged) into `directory`; returns the peft
    model that holds it (float32, eval), the reference."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                        use_rslora=spec.rslora, lora_dropout=0.0,
                        layers_to_transform=list(spec.layers) if spec.layers else None)
    model = get_peft_model(copy.deepcopy(base_model), config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                fan_in = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=generator) * fan_in ** -0.5
                            * (0.5 if "lora_B" in name else 1.0))
    model.save_pretrained(str(directory))
    return model.eval()
