"""`kvrelay gateway`'s flags, apart from its entry module so that `kvrelay up` and the
configuration docs read them without starting anything."""
from __future__ import annotations

import argparse

from kvrelay.common.flags import add_flag
from kvrelay.common.tls import add_tls_flags
from kvrelay.gateway.limits import add_limit_flags
from kvrelay.gateway.public_tls import add_public_tls_flags
from kvrelay.engine.step_results import POOLINGS
from kvrelay.gateway.reasoning import add_reasoning_flags
from kvrelay.gateway.responses_store import add_store_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--host", default="0.0.0.0", help="address to bind (REST and gRPC)")
    add_flag(parser, "--port", type=int, default=8000, help="OpenAI REST port")
    add_flag(parser, "--grpc-port", type=int, default=50050, help="public gRPC API port")
    add_flag(parser, "--tokenizer-address", default="127.0.0.1:50051",
             help="host:port of the tokenizer service")
    add_flag(parser, "--scheduler-address", default="127.0.0.1:50052",
             help="host:port of the scheduler; comma-separated for several scheduler groups "
                  "(each request goes to the least loaded)")
    add_flag(parser, "--served-model-name", default=None,
             help="model name clients use (default: the scheduler's model)")
    add_flag(parser, "--api-key", default=None,
             help="require 'Authorization: Bearer <key>' (REST) / authorization metadata (gRPC)")
    add_flag(parser, "--gateway-id", default=None,
             help="this gateway's id at the scheduler (default: random)")
    add_flag(parser, "--submit-wait-timeout", type=float, default=10.0,
             help="seconds a new request waits for a ready scheduler group (one restarting, "
                  "or whose workers are) before the 503; 0: answer at once")
    add_flag(parser, "--request-timeout", type=float, default=0.0,
             help="seconds a request may run; past it, what it has not finished is aborted and "
                  "it ends with a timeout error (504; an SSE error event once streaming; gRPC "
                  "DEADLINE_EXCEEDED). 0: no deadline")
    add_flag(parser, "--tokenizer-wait-timeout", type=float, default=30.0,
             help="seconds the requests in flight wait for a lost tokenizer (its Detokenize "
                  "stream broke) to come back; it gets their detokenizer states again and their "
                  "streams go on. Past it they end with an error and are aborted (> 0)")
    add_limit_flags(parser)  # what one request may ask for (limits.py)
    add_store_flags(parser)  # what /v1/responses keeps (responses_store.py)
    add_reasoning_flags(parser)
    add_flag(parser, "--pooling", default="last", choices=POOLINGS,
             help="how /v1/embeddings pools the model's final hidden states: the last token's "
                  "(decoder embedding models are trained so) or the mean of every token's")
    add_flag(parser, "--log-request-text", action="store_true",
             help="log prompts, outputs and their token ids (debugging; off: they are the "
                  "users' data)")
    add_flag(parser, "--metrics-port", type=int, default=9100,
             help="Prometheus /metrics and /health, off the public ports (0: off)")
    add_tls_flags(parser)
    add_public_tls_flags(parser)
    add_flag(parser, "--log-level", default="info", help="debug, info, warning, error")
