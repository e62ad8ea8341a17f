"""Which service role may call which internal RPC, enforced on every server when TLS is on.

The TLS handshake already refuses peers without a certificate from the CA; this decides what an
authenticated peer may do, from the role its certificate names (certs.py). The table is the one
place that says who talks to whom: a gateway cannot register as a worker and receive prompts, a
worker cannot submit requests, and only a worker can push KV pages into a decode worker's cache.
Revoked certificates (the CRL given with --tls-crl) are refused on every call, health included.
"""
from __future__ import annotations

import inspect
import os
import threading
from functools import lru_cache

import grpc
from cryptography import x509
from cryptography.x509.oid import NameOID

from kvrelay.common.certs import ROLES
from kvrelay.common.tls import TlsFiles

ANY_ROLE = frozenset(ROLES)
# Full method name -> the roles that may call it. Methods not listed are refused.
CALLERS: dict[str, frozenset[str]] = {
    "/kvrelay.v1.Tokenizer/Encode": frozenset({"gateway"}),
    "/kvrelay.v1.Tokenizer/Decode": frozenset({"gateway"}),
    "/kvrelay.v1.Tokenizer/Detokenize": frozenset({"gateway"}),
    "/kvrelay.v1.Scheduler/Submit": frozenset({"gateway"}),
    "/kvrelay.v1.Scheduler/Abort": frozenset({"gateway"}),
    "/kvrelay.v1.Scheduler/Outputs": frozenset({"gateway"}),
    "/kvrelay.v1.Scheduler/RegisterWorker": frozenset({"worker"}),
    "/kvrelay.v1.Scheduler/Heartbeat": frozenset({"worker"}),
    "/kvrelay.v1.Scheduler/Stats": frozenset({"gateway", "admin"}),
    "/kvrelay.v1.Scheduler/LoadAdapter": frozenset({"gateway", "admin"}),
    "/kvrelay.v1.Scheduler/UnloadAdapter": frozenset({"gateway", "admin"}),
    "/kvrelay.v1.Worker/Steps": frozenset({"scheduler"}),
    "/kvrelay.v1.Worker/LoadAdapter": frozenset({"scheduler"}),
    "/kvrelay.v1.Worker/UnloadAdapter": frozenset({"scheduler"}),
    "/kvrelay.v1.KvTransfer/Push": frozenset({"worker"}),
    "/grpc.health.v1.Health/Check": ANY_ROLE,
    "/grpc.health.v1.Health/Watch": ANY_ROLE,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": ANY_ROLE,
}


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler so that it first checks the peer's certificate."""

    def __init__(self, files: TlsFiles, callers: dict[str, frozenset[str]] = CALLERS) -> None:
        self.callers = callers
        self.revocations = RevocationList(files.crl)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return _guarded(handler, lambda context: self._check(method, context))

    async def _check(self, method: str, context) -> None:
        role, serial = peer_identity(context.auth_context())
        if serial is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no client certificate")
        if self.revocations.is_revoked(serial):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "certificate revoked")
        allowed = self.callers.get(method, frozenset())
        if role not in allowed:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"role {role or '(none)'} may not call {method}")


def peer_identity(auth_context: dict) -> tuple[str | None, int | None]:
    """(role, serial number) of the peer's certificate; (None, None) without one."""
    pems = auth_context.get("x509_pem_cert") or []
    if not pems:
        return None, None
    return _identity(pems[0])


def peer_role_of_pem(pem: bytes) -> str | None:
    """The role a certificate (PEM) names."""
    return _identity(pem)[0]


@lru_cache(maxsize=256)
def _identity(pem: bytes) -> tuple[str | None, int]:
    cert = x509.load_pem_x509_certificate(pem)
    units = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return (str(units[0].value) if units else None), cert.serial_number


class RevocationList:
    """The serials a CRL names, re-read when the file changes (an operator revokes a
    certificate by replacing the CRL; no restart)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.mtime: int | None = None
        self.serials: frozenset[int] = frozenset()
        self._refresh()

    def is_revoked(self, serial: int) -> bool:
        self._refresh()
        return serial in self.serials

    def _refresh(self) -> None:
        if self.path is None:
            return
        mtime = os.stat(self.path).st_mtime_ns
        if mtime == self.mtime:
            return
        with self.lock:
            with open(self.path, "rb") as handle:
                crl = x509.load_pem_x509_crl(handle.read())
            self.serials = frozenset(entry.serial_number for entry in crl)
            self.mtime = mtime


def _guarded(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    """The same handler, running `await check(context)` before its behaviour."""
    if handler.unary_unary or handler.stream_unary:
        behaviour = handler.unary_unary or handler.stream_unary

        async def unary_response(request, context):
            await check(context)
            return await behaviour(request, context)
        factory = (grpc.unary_unary_rpc_method_handler if handler.unary_unary
                   else grpc.stream_unary_rpc_method_handler)
        return factory(unary_response, handler.request_deserializer,
                       handler.response_serializer)
    behaviour = handler.unary_stream or handler.stream_stream

    async def stream_response(request, context):
        await check(context)
        responses = behaviour(request, context)
        if inspect.isasyncgen(responses):
            async for response in responses:
                yield response
        else:  # a coroutine that writes with context.write
            await responses
    factory = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
               else grpc.stream_stream_rpc_method_handler)
    return factory(stream_response, handler.request_deserializer, handler.response_serializer)
