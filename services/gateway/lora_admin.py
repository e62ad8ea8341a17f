"""Loading and unloading LoRA adapters at run time (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter), and the models list with them.

These change what the server runs, so they are never open: they need the gateway's API key
even where nothing else does (without --api-key they answer 403). A load reaches every worker
of every scheduler group, each checking the adapter against its model; a refusal names the
reason and leaves the loaded adapters as they were."""
from __future__ import annotations

import time

from kvrelay.common.log import get_logger
from kvrelay.gateway.errors import GatewayError

log = get_logger(__name__)


def require_admin_key(api_key: str | None) -> None:
    if not api_key:
        raise GatewayError("permission", "loading and unloading LoRA adapters needs the "
                                         "gateway to run with --api-key")


async def load_adapter(core, name: str, path: str) -> str:
    if name == core.model_name:
        raise GatewayError("invalid_request", f"`{name}` is the base model's name", "lora_name")
    await core.load_adapter(name, path)
    log.info("lora adapter loaded", lora=name)
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_adapter(core, name: str) -> str:
    await core.unload_adapter(name)
    log.info("lora adapter unloaded", lora=name)
    return f"Success: LoRA adapter '{name}' removed successfully."


def model_cards(core, served: str) -> list[dict]:
    """The base model, then each adapter with the base as its parent (OpenAI's model objects
    with vLLM's root/parent/max_model_len)."""
    created = int(time.time())
    card = {"object": "model", "created": created, "owned_by": "kvrelay",
            "max_model_len": core.max_model_len}
    return [{"id": served, **card, "root": served, "parent": None}] + [
        {"id": name, **card, "root": name, "parent": served} for name in core.adapter_names]
