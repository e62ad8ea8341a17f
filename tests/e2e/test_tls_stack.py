"""The default stack (pd_stack) runs `kvrelay up --tls`: each internal service refuses whoever
lacks a certificate of the stack's CA or holds one that expired or was revoked, a rogue cannot
register as a worker, and greedy output equals the plaintext stack's."""
from __future__ import annotations

import datetime
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.api.kvrelay.v1 import scheduler_pb2, scheduler_pb2_grpc
from kvrelay.common.certs import Authority, write_bundle, write_file
from kvrelay.common.tls import target_options
from tests.e2e.conftest import MAX_NEW_TOKENS
from tests.e2e.grpc_api import generate, token_ids_request

INTERNAL = ("tokenizer", "scheduler", "prefill-0", "decode-0")


def health(address: str, role: str, credentials: grpc.ChannelCredentials | None):
    """The health check's status name, or the error code's name."""
    channel = (grpc.secure_channel(address, credentials, options=target_options(role))
               if credentials else grpc.insecure_channel(address))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=5)
        except grpc.RpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def credentials(ca: bytes, cert: bytes | None = None, key: bytes | None = None):
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)


@pytest.fixture(scope="module")
def tls_dir(pd_stack) -> Path:
    return Path(pd_stack.state["tls_dir"])


def test_every_internal_service_refuses_peers_without_a_valid_certificate(pd_stack, tls_dir,
                                                                          tmp_path):
    ca = (tls_dir / "ca.pem").read_bytes()
    authority = Authority.load(tls_dir / "ca.pem", tls_dir / "ca-key.pem")
    foreign = write_bundle(tmp_path / "foreign")
    expired_cert, expired_key = authority.issue(
        "admin", days=1, not_before=datetime.datetime.now(datetime.timezone.utc)
        - datetime.timedelta(days=2))
    good_cert, good_key = authority.issue("admin")
    refused = {
        "plaintext": None,
        "no certificate": credentials(ca),
        "another CA": credentials(ca, (foreign / "admin.pem").read_bytes(),
                                  (foreign / "admin-key.pem").read_bytes()),
        "expired": credentials(ca, expired_cert, expired_key),
    }
    for name in INTERNAL:
        service = pd_stack.service(name)
        address, role = service["address"], service["kind"]
        assert health(address, role, credentials(ca, good_cert, good_key)) == "SERVING", name
        for case, creds in refused.items():
            assert health(address, role, creds) == "UNAVAILABLE", (name, case)
    # Revoked: the CRL every service was started with now names the certificate.
    revoked = authority.revocation_list([_serial(good_cert)] + _listed(tls_dir / "crl.pem"))
    write_file(tls_dir / "crl.pem", revoked)
    for name in INTERNAL:
        service = pd_stack.service(name)
        assert health(service["address"], service["kind"],
                      credentials(ca, good_cert, good_key)) == "PERMISSION_DENIED", name


def test_a_rogue_worker_cannot_register(pd_stack, tls_dir, tmp_path):
    ca = (tls_dir / "ca.pem").read_bytes()
    foreign = write_bundle(tmp_path / "foreign")
    register = scheduler_pb2.RegisterWorkerRequest(worker_id="rogue", address="127.0.0.1:1",
                                                   num_blocks=64, block_size=16)
    attempts = {
        # A stolen gateway certificate: authenticated, but not a worker.
        "gateway role": (credentials(ca, (tls_dir / "gateway.pem").read_bytes(),
                                     (tls_dir / "gateway-key.pem").read_bytes()),
                         "PERMISSION_DENIED"),
        "worker of another CA": (credentials(ca, (foreign / "worker.pem").read_bytes(),
                                             (foreign / "worker-key.pem").read_bytes()),
                                 "UNAVAILABLE"),
    }
    address = pd_stack.service("scheduler")["address"]
    for case, (creds, expected) in attempts.items():
        with grpc.secure_channel(address, creds, options=target_options("scheduler")) as channel:
            with pytest.raises(grpc.RpcError) as error:
                scheduler_pb2_grpc.SchedulerStub(channel).RegisterWorker(register, timeout=5)
            assert error.value.code().name == expected, case
    workers = {worker.worker_id for worker in pd_stack.scheduler_stats().workers}
    assert "rogue" not in workers and len(workers) == 2


def test_greedy_output_with_tls_equals_the_plaintext_stack(pd_stack, colocated_stack,
                                                           greedy_cases):
    for case in greedy_cases:
        request = token_ids_request(case.prompt_ids, max_tokens=MAX_NEW_TOKENS, temperature=0)
        over_tls = generate(pd_stack.grpc_address, request)
        plaintext = generate(colocated_stack.grpc_address, request)
        assert over_tls.token_ids[0] == plaintext.token_ids[0] == case.engine_tokens


def _serial(cert_pem: bytes) -> int:
    from cryptography import x509
    return x509.load_pem_x509_certificate(cert_pem).serial_number


def _listed(crl_path: Path) -> list[int]:
    from cryptography import x509
    return [entry.serial_number for entry in x509.load_pem_x509_crl(crl_path.read_bytes())]
