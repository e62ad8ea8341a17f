"""The OpenAI-compatible REST app: routes, auth, request ids, and errors as OpenAI error bodies.

Every failure a client can cause answers 400 with `{"error": {...}}`; bodies are parsed here
rather than by FastAPI so that no path returns FastAPI's 422."""
from __future__ import annotations

import hmac
import uuid
from importlib import metadata

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from kvrelay.common.log import bind_request_id, get_logger
from kvrelay.gateway.errors import KINDS, GatewayError, invalid
from kvrelay.gateway.openai_chat import create_chat_completion
from kvrelay.gateway.openai_completions import create_completion
from kvrelay.gateway.openai_embeddings import create_embedding
from kvrelay.gateway.openai_limits import check_body_limits, check_unparsed_text, read_body
from kvrelay.gateway.lora_admin import (load_adapter, model_cards, require_admin_key,
                                        unload_adapter)
from kvrelay.gateway.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                              DetokenizeRequest, EmbeddingRequest,
                                              LoadLoraAdapterRequest, TokenizeRequest,
                                              UnloadLoraAdapterRequest)
from kvrelay.gateway.openai_responses import create_response, delete_response, get_response
from kvrelay.gateway.openai_serving import ClientDisconnected, served_model
from kvrelay.gateway.openai_tools import chat_messages
from kvrelay.gateway.redaction import log_unexpected
from kvrelay.gateway.responses_protocol import ResponsesRequest
from kvrelay.gateway.responses_store import ResponseStore

log = get_logger(__name__)
REQUEST_ID_HEADER = "x-request-id"


def build_app(core, responses: ResponseStore, api_key: str | None = None) -> FastAPI:
    """responses: where /v1/responses keeps what it answers (responses_store.py)."""
    # /openapi.json is served by _add_probe_routes, behind the API key like every route but
    # /health.
    app = FastAPI(title="kvrelay", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.core = core
    app.state.draining = False
    _add_error_handlers(app)
    auth = [Depends(_authorizer(api_key))] if api_key else []
    _add_generation_routes(app, auth)
    _add_response_routes(app, responses, auth)
    _add_model_routes(app, core, auth)
    _add_adapter_routes(app, core, api_key, auth)
    _add_probe_routes(app, core, auth)
    _document_bodies(app)
    return app


# Bodies are parsed by _parse (so that no path answers FastAPI's 422): /openapi.json gets each
# route's body schema from the same pydantic models.
_BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
           "/v1/responses": ResponsesRequest, "/v1/embeddings": EmbeddingRequest,
           "/tokenize": TokenizeRequest,
           "/v1/load_lora_adapter": LoadLoraAdapterRequest,
           "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
           "/detokenize": DetokenizeRequest}


def _document_bodies(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=_version(), routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in _BODIES.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {
                        "$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _add_generation_routes(app: FastAPI, auth: list) -> None:
    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        return await _generate(request, ChatCompletionRequest, create_chat_completion, "chatcmpl")

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        return await _generate(request, CompletionRequest, create_completion, "cmpl")

    @app.post("/v1/embeddings", dependencies=auth)
    async def embeddings(request: Request):
        return await _generate(request, EmbeddingRequest, create_embedding, "embd")


def _add_response_routes(app: FastAPI, store: ResponseStore, auth: list) -> None:
    @app.post("/v1/responses", dependencies=auth)
    async def responses(request: Request):
        async def handler(core, http_request, body, client_request_id):
            return await create_response(core, store, http_request, body, client_request_id)
        return await _generate(request, ResponsesRequest, handler, "resp")

    @app.get("/v1/responses/{response_id}", dependencies=auth)
    async def stored_response(response_id: str):
        return get_response(store, response_id)

    @app.delete("/v1/responses/{response_id}", dependencies=auth)
    async def forget_response(response_id: str):
        return delete_response(store, response_id)


def _add_model_routes(app: FastAPI, core, auth: list) -> None:
    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": model_cards(core, served_model(core, None))}

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request):
        body = await _parse(request, TokenizeRequest)
        token_ids = await _tokenize(core, body, _client_request_id(request, "tok"))
        return {"count": len(token_ids), "max_model_len": core.max_model_len,
                "tokens": token_ids, "token_strs": None}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request):
        body = await _parse(request, DetokenizeRequest)
        served_model(core, body.model)
        text = await core.upstream.decode(body.tokens, _client_request_id(request, "detok"),
                                          skip_special_tokens=False)
        return {"prompt": text}


def _add_adapter_routes(app: FastAPI, core, api_key: str | None, auth: list) -> None:
    @app.post("/v1/load_lora_adapter", dependencies=auth, response_class=PlainTextResponse)
    async def load_lora_adapter(request: Request):
        require_admin_key(api_key)
        body = await _parse(request, LoadLoraAdapterRequest)
        return await load_adapter(core, body.lora_name, body.lora_path)

    @app.post("/v1/unload_lora_adapter", dependencies=auth, response_class=PlainTextResponse)
    async def unload_lora_adapter(request: Request):
        require_admin_key(api_key)
        body = await _parse(request, UnloadLoraAdapterRequest)
        return await unload_adapter(core, body.lora_name)


def _add_probe_routes(app: FastAPI, core, auth: list) -> None:
    """Health is never behind the API key (load balancers probe it, and it tells nothing);
    version and the OpenAPI document are. Metrics are not here: they live on the metrics port
    (--metrics-port), off the public one."""
    @app.get("/health")
    async def health():
        ready = core.ready and not app.state.draining
        return Response(status_code=200 if ready else 503)

    @app.get("/version", dependencies=auth)
    async def version():
        return {"version": _version()}

    @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
    async def openapi_document():
        return JSONResponse(app.openapi())


async def _generate(request: Request, model: type[BaseModel], handler, prefix: str):
    core = request.app.state.core
    if request.app.state.draining:
        raise GatewayError("unavailable", "the gateway is shutting down")
    client_request_id = _client_request_id(request, prefix)
    body = await _parse(request, model)
    log.info("request", endpoint=request.url.path, stream=getattr(body, "stream", False),
             user=body.user, model=body.model)  # the model: the base's, or a LoRA adapter's
    if core.log_request_text:  # off by default: prompts are the users' data
        log.info("request text", body=body.model_dump(mode="json", exclude_unset=True))
    try:
        response = await handler(core, request, body, client_request_id)
    except ClientDisconnected:
        log.info("client disconnected; request aborted")
        response = Response(status_code=499)
    response.headers[REQUEST_ID_HEADER] = client_request_id
    return response


async def _tokenize(core, body: TokenizeRequest, client_request_id: str) -> list[int]:
    served_model(core, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("give either prompt or messages", "prompt")
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return await core.upstream.encode(body.prompt, add_special, client_request_id)
    return await core.upstream.render_chat(chat_messages(body.messages),
                                           body.add_generation_prompt, client_request_id)


def _client_request_id(request: Request, prefix: str) -> str:
    """The client's id for this call (its X-Request-Id, else a new one): bound to the logs,
    sent upstream as metadata, and echoed in the response's header."""
    client_request_id = request.headers.get(REQUEST_ID_HEADER) or f"{prefix}-{uuid.uuid4().hex}"
    request.state.client_request_id = client_request_id
    bind_request_id(client_request_id)
    return client_request_id


async def _parse(request: Request, model: type[BaseModel]):
    limits = request.app.state.core.limits
    raw = await read_body(request, limits)
    try:
        body = model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        check_unparsed_text(raw, exc.errors(), limits)  # raises naming the field, if so
        raise _validation_error(exc.errors()) from None
    check_body_limits(body, raw, limits)
    return body


def _validation_error(errors) -> GatewayError:
    first = errors[0]
    location = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = f"{location}: {first['msg']}" if location else first["msg"]
    if first.get("type") == "extra_forbidden":  # never ignored: README lists what is served
        message = f"{location} is not supported by kvrelay"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return invalid(message, location.split(".", 1)[0] or None)


def _authorizer(api_key: str):
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise GatewayError("authentication", "invalid or missing API key "
                                                 "(send Authorization: Bearer <key>)")
    return check


def _add_error_handlers(app: FastAPI) -> None:
    async def gateway_error(request: Request, exc: GatewayError):
        response = _error_response(request, exc.http_status, exc.body())
        if exc.retry_after_s is not None:
            response.headers["Retry-After"] = str(exc.retry_after_s)
        if exc.kind == "too_large":  # the rest of the body is not worth receiving
            response.headers["Connection"] = "close"
        return response

    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request"
        body = {"error": {"message": str(exc.detail), "type": KINDS[kind][1], "param": None,
                          "code": exc.status_code}}
        return _error_response(request, exc.status_code, body)

    async def validation_error(request: Request, exc: RequestValidationError):
        error = _validation_error(exc.errors())
        return _error_response(request, 400, error.body())

    async def unexpected_error(request: Request, exc: Exception):
        log_unexpected(log, exc, request.app.state.core.log_request_text)
        error = GatewayError("internal", f"internal error: {type(exc).__name__}")
        return _error_response(request, 500, error.body())

    app.add_exception_handler(GatewayError, gateway_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected_error)


def _error_response(request: Request, status: int, body: dict) -> JSONResponse:
    client_request_id = getattr(request.state, "client_request_id", None)
    headers = {REQUEST_ID_HEADER: client_request_id} if client_request_id else None
    return JSONResponse(body, status_code=status, headers=headers)


def _version() -> str:
    try:
        return metadata.version("kvrelay")
    except metadata.PackageNotFoundError:
        return "0.1.0"
