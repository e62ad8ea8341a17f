"""kvrelay's public async Python client (gRPC):

    from kvrelay.client import KvrelayClient

    async with KvrelayClient("127.0.0.1:50050") as client:
        async for chunk in client.generate("The capital of France is", max_tokens=16):
            print(chunk.text, end="", flush=True)
"""
from kvrelay.client.client import KvrelayClient
from kvrelay.client.types import (Choice, Completion, GenerationChunk, KvrelayError, ModelInfo,
                                   SamplingOptions, TokenLogprob, Usage)

__all__ = ["KvrelayClient", "Choice", "Completion", "GenerationChunk", "KvrelayError",
           "ModelInfo", "SamplingOptions", "TokenLogprob", "Usage"]
