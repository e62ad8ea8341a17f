"""One error type for both front ends: each kind maps to an HTTP status with an OpenAI error
body, and to a gRPC status code."""
from __future__ import annotations

from dataclasses import fields

import grpc

from kvrelay.engine.sampling_params import SamplingParams

# kind -> (HTTP status, OpenAI error type, gRPC status code)
KINDS = {
    "invalid_request": (400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    "authentication": (401, "authentication_error", grpc.StatusCode.UNAUTHENTICATED),
    "permission": (403, "permission_error", grpc.StatusCode.PERMISSION_DENIED),
    "not_found": (404, "not_found_error", grpc.StatusCode.NOT_FOUND),
    # over --max-request-body-bytes (limits.py); gRPC's own answer to a message over its limit
    "too_large": (413, "invalid_request_error", grpc.StatusCode.RESOURCE_EXHAUSTED),
    "unavailable": (503, "service_unavailable", grpc.StatusCode.UNAVAILABLE),
    # too much work waits: 503 with Retry-After, RESOURCE_EXHAUSTED on the gRPC API
    "overloaded": (503, "service_unavailable", grpc.StatusCode.RESOURCE_EXHAUSTED),
    "internal": (500, "internal_server_error", grpc.StatusCode.INTERNAL),
    # ran past the gateway's --request-timeout: what it had was aborted
    "timeout": (504, "timeout_error", grpc.StatusCode.DEADLINE_EXCEEDED),
}

# Upstream gRPC codes that mean the caller's input was wrong, versus the service being down.
_INVALID_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                  grpc.StatusCode.FAILED_PRECONDITION}
_UNAVAILABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.CANCELLED}
RETRY_AFTER_S = 1  # what an overloaded answer tells the client to wait


class GatewayError(Exception):
    def __init__(self, kind: str, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code  # OpenAI's error code where it has one ("model_not_found")

    @property
    def http_status(self) -> int:
        return KINDS[self.kind][0]

    @property
    def retry_after_s(self) -> int | None:
        return RETRY_AFTER_S if self.kind == "overloaded" else None

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return KINDS[self.kind][2]

    def body(self) -> dict:
        status, error_type, _ = KINDS[self.kind]
        return {"error": {"message": self.message, "type": error_type, "param": self.param,
                          "code": self.code or status}}


def invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError("invalid_request", message, param)


def model_not_found(model: str, served: str, adapters: list[str]) -> GatewayError:
    """OpenAI's answer to a model (or LoRA adapter) the server does not have."""
    known = ", ".join(f"`{name}`" for name in [served, *adapters])
    return GatewayError("not_found", f"The model `{model}` does not exist; this server serves "
                        f"{known}", "model", "model_not_found")


def from_rpc_error(exc: grpc.RpcError, service: str) -> GatewayError:
    """An upstream call failed: the caller's fault (400) or ours (503/500)."""
    code, details = exc.code(), exc.details() or ""
    if code in _INVALID_CODES:
        return GatewayError("invalid_request", details, _param_in(details))
    if code == grpc.StatusCode.NOT_FOUND:  # the scheduler knows no adapter of that name
        return GatewayError("not_found", details, "model", "model_not_found")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return GatewayError("overloaded", f"the {service} is overloaded: {details}")
    if code in _UNAVAILABLE_CODES:
        return GatewayError("unavailable", f"the {service} is unavailable: {details or code.name}")
    return GatewayError("internal", f"the {service} failed: {code.name} {details}".strip())


def param_from_value_error(exc: ValueError) -> GatewayError:
    return invalid(str(exc), _param_in(str(exc)))


def _param_in(message: str) -> str | None:
    """SamplingParams' messages start with the parameter's name ("top_p must be ...")."""
    first = message.split(" ", 1)[0].split("[", 1)[0].rstrip(":,")
    return first if first in _PARAM_NAMES else None


_PARAM_NAMES = {f.name for f in fields(SamplingParams)} | {"prompt", "messages", "model",
                                                         "reasoning_effort"}
