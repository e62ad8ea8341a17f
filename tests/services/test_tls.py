"""Mutual TLS and role checks on a real grpc.aio server (ServiceServer), in this process.

Each case dials with a real certificate: one from the stack's CA with the right or the wrong
role, none at all, one from another CA, an expired one, a revoked one (the CRL replaced while
the server runs), and a server certificate rotated on disk while the server runs."""
from __future__ import annotations

import asyncio
import datetime
import os
import stat
import subprocess
import sys

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.common import tls
from kvrelay.common.certs import ROLES, Authority, write_bundle, write_file
from kvrelay.common.grpc_server import ServiceServer

SCHEDULER = "kvrelay.v1.Scheduler"
RPC_OK = b"ok"


@pytest.fixture
def bundle(tmp_path):
    return write_bundle(tmp_path / "ca")


def files(directory, role: str) -> tls.TlsFiles:
    return tls.TlsFiles(str(directory / "ca.pem"), str(directory / f"{role}.pem"),
                        str(directory / f"{role}-key.pem"),
                        str(directory / "crl.pem") if (directory / "crl.pem").exists() else None)


class Server:
    """A scheduler-role ServiceServer with raw handlers for a unary and a streaming RPC."""

    def __init__(self, identity: tls.TlsFiles) -> None:
        tls.install(identity)
        try:
            self.service = ServiceServer("127.0.0.1", 0, [SCHEDULER])
        finally:
            tls.install(None)
        self.service.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            SCHEDULER, {"RegisterWorker": grpc.unary_unary_rpc_method_handler(self.unary),
                        "Outputs": grpc.unary_stream_rpc_method_handler(self.stream)})])
        self.address = f"127.0.0.1:{self.service.port}"

    async def unary(self, request: bytes, context) -> bytes:
        return RPC_OK

    async def stream(self, request: bytes, context):
        for _ in range(3):
            yield RPC_OK

    async def __aenter__(self) -> "Server":
        await self.service.start()
        await self.service.set_serving(True)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.service.server.stop(0)


async def call(address: str, credentials, method: str = "health", server_role="scheduler"):
    """The status code of one call (OK or the error's)."""
    options = tls.target_options(server_role) if credentials else []
    channel = (grpc.aio.secure_channel(address, credentials, options=options) if credentials
               else grpc.aio.insecure_channel(address))
    async with channel:
        try:
            if method == "health":
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5)
            elif method == "RegisterWorker":
                await channel.unary_unary(f"/{SCHEDULER}/RegisterWorker")(b"", timeout=5)
            else:
                replies = [r async for r in channel.unary_stream(f"/{SCHEDULER}/{method}")(
                    b"", timeout=5)]
                assert replies == [RPC_OK] * 3
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def run(coroutine):
    return asyncio.run(coroutine)


def test_bundle_names_each_role_twice_and_keeps_keys_private(bundle):
    for role in ROLES:
        cert = x509.load_pem_x509_certificate((bundle / f"{role}.pem").read_bytes())
        unit = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert unit == role
        assert tls.server_name(role) in names.get_values_for_type(x509.DNSName)
        assert stat.S_IMODE(os.stat(bundle / f"{role}-key.pem").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(bundle / "ca-key.pem").st_mode) == 0o600


def test_only_certificates_of_the_ca_get_through(bundle, tmp_path):
    other_ca = write_bundle(tmp_path / "other")
    expired_cert, expired_key = Authority.load(bundle / "ca.pem", bundle / "ca-key.pem").issue(
        "admin", days=1, not_before=datetime.datetime.now(datetime.timezone.utc)
        - datetime.timedelta(days=3))
    write_file(tmp_path / "expired.pem", expired_cert)
    write_file(tmp_path / "expired-key.pem", expired_key, secret=True)
    ca = (bundle / "ca.pem").read_bytes()

    async def scenario():
        async with Server(files(bundle, "scheduler")) as server:
            admin = tls.channel_credentials(files(bundle, "admin"))
            assert await call(server.address, admin) == grpc.StatusCode.OK
            assert await call(server.address, None) == grpc.StatusCode.UNAVAILABLE
            no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
            assert await call(server.address, no_cert) == grpc.StatusCode.UNAVAILABLE
            foreign = grpc.ssl_channel_credentials(
                ca, (other_ca / "admin-key.pem").read_bytes(),
                (other_ca / "admin.pem").read_bytes())
            assert await call(server.address, foreign) == grpc.StatusCode.UNAVAILABLE
            expired = grpc.ssl_channel_credentials(ca, expired_key, expired_cert)
            assert await call(server.address, expired) == grpc.StatusCode.UNAVAILABLE
            # The client checks the server's role too: a scheduler is no worker.
            assert (await call(server.address, admin, server_role="worker")
                    == grpc.StatusCode.UNAVAILABLE)
    run(scenario())


def test_roles_decide_what_a_peer_may_call(bundle):
    async def scenario():
        async with Server(files(bundle, "scheduler")) as server:
            as_role = {role: tls.channel_credentials(files(bundle, role)) for role in ROLES}
            # A rogue holder of a gateway's (or admin's) certificate cannot register as a worker.
            for role in ("gateway", "admin", "tokenizer", "scheduler"):
                assert (await call(server.address, as_role[role], "RegisterWorker")
                        == grpc.StatusCode.PERMISSION_DENIED), role
            assert await call(server.address, as_role["worker"], "RegisterWorker") == \
                grpc.StatusCode.OK
            # Streaming handlers are guarded the same way.
            assert await call(server.address, as_role["gateway"], "Outputs") == \
                grpc.StatusCode.OK
            assert await call(server.address, as_role["worker"], "Outputs") == \
                grpc.StatusCode.PERMISSION_DENIED
    run(scenario())


def test_a_revoked_certificate_is_refused_once_the_crl_names_it(bundle):
    async def scenario():
        async with Server(files(bundle, "scheduler")) as server:
            admin = tls.channel_credentials(files(bundle, "admin"))
            assert await call(server.address, admin) == grpc.StatusCode.OK
            revoke = subprocess.run([sys.executable, "-m", "kvrelay.cli", "certs", "--out",
                                     str(bundle), "--revoke", str(bundle / "admin.pem")],
                                    capture_output=True, text=True, timeout=60)
            assert revoke.returncode == 0, revoke.stderr
            assert await call(server.address, admin) == grpc.StatusCode.PERMISSION_DENIED
            gateway = tls.channel_credentials(files(bundle, "gateway"))
            assert await call(server.address, gateway) == grpc.StatusCode.OK
    run(scenario())


def test_a_rotated_server_certificate_is_served_without_a_restart(bundle, tmp_path):
    new_ca = write_bundle(tmp_path / "new")

    async def scenario():
        async with Server(files(bundle, "scheduler")) as server:
            old_admin = tls.channel_credentials(files(bundle, "admin"))
            new_admin = tls.channel_credentials(files(new_ca, "admin"))
            assert await call(server.address, old_admin) == grpc.StatusCode.OK
            assert await call(server.address, new_admin) == grpc.StatusCode.UNAVAILABLE
            for name in ("ca.pem", "scheduler.pem", "scheduler-key.pem"):
                write_file(bundle / name, (new_ca / name).read_bytes(), secret=True)
            assert await call(server.address, new_admin) == grpc.StatusCode.OK
            assert await call(server.address, old_admin) == grpc.StatusCode.UNAVAILABLE
    run(scenario())


def test_tls_flags_need_all_three_files(bundle, tmp_path):
    import argparse
    parser = argparse.ArgumentParser()
    tls.add_tls_flags(parser)
    assert tls.tls_files_from_args(parser.parse_args([])) is None
    with pytest.raises(SystemExit, match="all three"):
        tls.tls_files_from_args(parser.parse_args(["--tls-ca", str(bundle / "ca.pem")]))
    with pytest.raises(SystemExit, match="cannot read"):
        tls.tls_files_from_args(parser.parse_args([
            "--tls-ca", str(bundle / "ca.pem"), "--tls-cert", str(tmp_path / "missing.pem"),
            "--tls-key", str(bundle / "admin-key.pem")]))


def test_certs_command_rotates_under_the_same_ca_with_extra_names(bundle):
    ca_before = (bundle / "ca.pem").read_bytes()
    worker_before = (bundle / "worker.pem").read_bytes()
    done = subprocess.run([sys.executable, "-m", "kvrelay.cli", "certs", "--out", str(bundle),
                           "--reuse-ca", "--roles", "worker", "--san", "10.0.0.7",
                           "--san", "decode.example", "--days", "30"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (bundle / "ca.pem").read_bytes() == ca_before
    rotated = x509.load_pem_x509_certificate((bundle / "worker.pem").read_bytes())
    assert rotated.serial_number != x509.load_pem_x509_certificate(worker_before).serial_number
    names = rotated.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "decode.example" in names.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1",
                                                                            "10.0.0.7"]
    assert (rotated.not_valid_after_utc - rotated.not_valid_before_utc).days == 30

    async def scenario():  # the rotated worker certificate is still one of the stack's
        async with Server(files(bundle, "scheduler")) as server:
            worker = tls.channel_credentials(files(bundle, "worker"))
            assert await call(server.address, worker, "RegisterWorker") == grpc.StatusCode.OK
    run(scenario())
