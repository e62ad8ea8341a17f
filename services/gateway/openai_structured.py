"""A request's output constraints as the engine takes them: OpenAI's response_format, vLLM's
structured_outputs and its older guided_* fields (one of them), and logit_bias."""
from __future__ import annotations

from kvrelay.engine.structured.spec import StructuredOutputs, from_vllm_fields
from kvrelay.gateway.errors import GatewayError, invalid
from kvrelay.gateway.openai_protocol import SamplingFields

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_outputs(request: SamplingFields) -> StructuredOutputs | None:
    """The one constraint the request sets, or None. Raises a 400 for two at once."""
    given = [(name, spec) for name, spec in _candidates(request) if spec is not None]
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise invalid(f"give one output constraint, got {names}", given[1][0])
    return given[0][1] if given else None


def constraint_field(request: SamplingFields) -> str | None:
    """The request field its output constraint came from (for the param of a compile error)."""
    if request.response_format is not None and request.response_format.type != "text":
        return "response_format"
    if request.structured_outputs is not None:
        return "structured_outputs"
    return next((name for name in _GUIDED if getattr(request, name) is not None), None)


def blame_constraint(error: GatewayError, request: SamplingFields,
                     from_tools: bool = False) -> GatewayError:
    """The scheduler's compile errors ("invalid json: ...") name the request field at fault:
    `tools` where the grammar was built from them (a parameters schema did not compile)."""
    return blame_compile_error(error, "tools" if from_tools else constraint_field(request))


def blame_compile_error(error: GatewayError, param: str | None) -> GatewayError:
    """A grammar compile error from the scheduler (kind invalid_request, no param, "invalid
    <kind>: ...") given the request field its grammar came from; other errors as they are."""
    if error.kind == "invalid_request" and error.param is None \
            and error.message.startswith("invalid "):
        error.param = param
    return error


def _candidates(request: SamplingFields):
    if request.response_format is not None:
        yield "response_format", _from_response_format(request)
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True)
        yield "structured_outputs", _checked(lambda: from_vllm_fields(fields),
                                             "structured_outputs")
    for name, kind in _GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            yield name, _checked(lambda: from_vllm_fields({kind: value}), name)


def _from_response_format(request: SamplingFields) -> StructuredOutputs | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputs("json_object")
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.schema_ is None:
        raise invalid("response_format json_schema needs json_schema.schema",
                      "response_format")
    return _checked(lambda: StructuredOutputs.json_schema(json_schema.schema_),
                    "response_format")


def _checked(build, param: str) -> StructuredOutputs | None:
    try:
        return build()
    except ValueError as exc:
        raise invalid(f"{param}: {exc}", param) from None


def logit_bias(request: SamplingFields) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys, so as strings."""
    bias = {}
    for key, value in (request.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        bias[token_id] = value
    return bias
