"""POST /v1/embeddings: each input's embedding, the model's final hidden states pooled as the
gateway's --pooling says (the last token's, or the mean of all) and L2-normalized, computed on
the workers like a prompt (engine/pooling.py)."""
from __future__ import annotations

import base64

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.gateway.errors import invalid
from kvrelay.gateway.openai_completions import prompt_token_ids
from kvrelay.gateway.openai_limits import num_prompts
from kvrelay.gateway.openai_protocol import EmbeddingRequest
from kvrelay.gateway.openai_serving import (collect_choices, generation_model, lora_name,
                                             unless_disconnected)


async def create_embedding(core, http_request: Request, body: EmbeddingRequest,
                           client_request_id: str):
    model = await generation_model(core, body.model)
    core.limits.check_prompts(num_prompts(body.input), "input")
    prompts = await prompt_token_ids(core, body.input, client_request_id, "input")
    core.limits.check_prompt_tokens(prompts, "input")
    vectors = await embed(core, http_request, prompts, client_request_id, body.priority,
                          lora_name(core, model))
    if body.dimensions is not None and body.dimensions != len(vectors[0]):
        raise invalid(f"dimensions: this model's embeddings have {len(vectors[0])} dimensions "
                      "and cannot be shortened", "dimensions")
    data = [{"object": "embedding", "index": index,
             "embedding": _encoded(vector, body.encoding_format)}
            for index, vector in enumerate(vectors)]
    num_tokens = sum(map(len, prompts))
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


async def embed(core, http_request: Request | None, prompts: list[list[int]],
                client_request_id: str, priority: int = 0,
                lora: str = "") -> list[tuple[float, ...]]:
    """Each prompt's vector (both front ends); http_request: watched for the client leaving."""
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=core.pooling)
    group = await core.generate(client_request_id, prompts, params, priority, lora)
    with group:
        work = collect_choices(group, 1)
        choices = await (unless_disconnected(http_request, work) if http_request else work)
    return [choice.embedding for choice in choices]


def _encoded(vector: tuple[float, ...], encoding_format: str):
    if encoding_format == "float":
        return list(vector)
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
