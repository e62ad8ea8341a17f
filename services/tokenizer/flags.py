"""`kvrelay tokenizer`'s flags, apart from its entry module so that `kvrelay up` and the
configuration docs read them without starting anything."""
from __future__ import annotations

import argparse

from kvrelay.common.flags import add_flag
from kvrelay.common.tls import add_tls_flags
from kvrelay.tokenizer.tool_render import FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--host", default="0.0.0.0", help="address to bind")
    add_flag(parser, "--port", type=int, default=50051, help="gRPC port")
    add_flag(parser, "--metrics-port", type=int, default=9101,
             help="Prometheus port (0: off)")
    add_flag(parser, "--model", default=None,
             help="model directory, .gguf file or cached HF repo id (default: SmolLM2-135M)")
    add_flag(parser, "--chat-template", default=None,
             help="a Jinja chat template file to use instead of the model's own (one with "
                  "Hermes-style tool support makes tool calls use it: services/tokenizer/"
                  "tool_render.py)")
    add_flag(parser, "--tool-call-parser", default="auto", choices=("auto", *FORMATS),
             help="how the model writes tool calls, vLLM's names (auto: read from the chat "
                  "template: [TOOL_CALLS] mistral, a {\"name\", \"parameters\"} object "
                  "llama3_json, <tool_call> blocks hermes; kvrelay's own format for templates "
                  "without tool support)")
    add_tls_flags(parser)
    add_flag(parser, "--log-level", default="info", help="debug, info, warning, error")
