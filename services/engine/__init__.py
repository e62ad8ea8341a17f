"""The in-process engine core: config, requests, block pool, scheduler, model runner, sampler,
and the offline API (`LLM`). No gRPC in here; the services wrap it."""
from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.outputs import CompletionOutput, Logprob, RequestOutput
from services.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput",
           "Logprob"]
