"""The gateway's public ports with TLS and client certificates (--public-tls-*): REST over HTTPS
and the public gRPC API through kvrelay.client, each refusing clients without a certificate of
the users' CA; a real gateway process on a real tokenizer."""
from __future__ import annotations

import asyncio
import ssl

import httpx
import pytest

from kvrelay.client import KvrelayClient
from kvrelay.client.types import KvrelayError
from kvrelay.common.certs import Authority, write_file
from tests.services.conftest import ServiceProcess, free_port


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A server CA with the gateway's public certificate, and a users' CA with one client."""
    directory = tmp_path_factory.mktemp("public-tls")
    server_ca, users_ca = Authority.create("public CA"), Authority.create("users CA")
    files = {"server-ca.pem": server_ca.cert_pem(), "users-ca.pem": users_ca.cert_pem()}
    files["server.pem"], files["server-key.pem"] = server_ca.issue("gateway")
    files["client.pem"], files["client-key.pem"] = users_ca.issue("admin")
    files["stranger.pem"], files["stranger-key.pem"] = server_ca.issue("admin")
    for name, data in files.items():
        write_file(directory / name, data, secret=name.endswith("key.pem"))
    return directory


@pytest.fixture(scope="module")
def gateway(pki, tokenizer_address, tmp_path_factory):
    port, grpc_port = free_port(), free_port()
    service = ServiceProcess("gateway", [
        "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port),
        "--metrics-port", "0", "--tokenizer-address", tokenizer_address,
        "--scheduler-address", f"127.0.0.1:{free_port()}", "--submit-wait-timeout", "0",
        "--served-model-name", "m", "--log-level", "warning",
        "--public-tls-cert", str(pki / "server.pem"), "--public-tls-key",
        str(pki / "server-key.pem"), "--public-tls-client-ca", str(pki / "users-ca.pem")],
        tmp_path_factory.mktemp("gateway") / "gateway.log")
    client_cert = (str(pki / "client.pem"), str(pki / "client-key.pem"))
    base_url = f"https://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return httpx.get(f"{base_url}/version", verify=_context(pki, client_cert),
                             timeout=2, trust_env=False).status_code == 200
        except httpx.TransportError:
            return False
    try:
        service.wait_for(answers, "gateway with public TLS")
        yield {"base_url": base_url, "grpc_address": f"127.0.0.1:{grpc_port}"}
    finally:
        service.stop()


def _context(pki, client_cert=None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "server-ca.pem"))
    if client_cert:
        context.load_cert_chain(*client_cert)
    return context


def test_rest_needs_https_and_a_client_certificate_of_the_users_ca(gateway, pki):
    with_cert = _context(pki, (str(pki / "client.pem"), str(pki / "client-key.pem")))
    reply = httpx.post(f"{gateway['base_url']}/tokenize", json={"prompt": "Hello"},
                       verify=with_cert, timeout=10, trust_env=False)
    assert reply.status_code == 200 and reply.json()["count"] > 0
    stranger = _context(pki, (str(pki / "stranger.pem"), str(pki / "stranger-key.pem")))
    for context in (_context(pki), stranger):  # none, or one the users' CA did not sign
        with pytest.raises((httpx.TransportError, ssl.SSLError)):
            httpx.get(f"{gateway['base_url']}/version", verify=context, timeout=10,
                      trust_env=False).raise_for_status()
    plaintext = gateway["base_url"].replace("https://", "http://")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{plaintext}/version", timeout=10, trust_env=False)


def test_grpc_client_with_tls_and_a_client_certificate(gateway, pki):
    async def tokenize(**tls_options) -> list[int]:
        async with KvrelayClient(gateway["grpc_address"], timeout=10, **tls_options) as client:
            return await client.tokenize("Hello")

    ca = str(pki / "server-ca.pem")
    assert asyncio.run(tokenize(tls_ca=ca, tls_cert=str(pki / "client.pem"),
                                tls_key=str(pki / "client-key.pem")))
    for options in ({"tls_ca": ca}, {"tls_ca": ca, "tls_cert": str(pki / "stranger.pem"),
                                     "tls_key": str(pki / "stranger-key.pem")}, {}):
        with pytest.raises(KvrelayError) as error:
            asyncio.run(tokenize(**options))
        assert error.value.code == "UNAVAILABLE", options
