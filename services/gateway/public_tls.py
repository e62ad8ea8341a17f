"""TLS for the gateway's public ports (REST and gRPC), optionally mutual, for API users.

Separate from the internal identity (common/tls.py): the public certificate is the one clients
know the service by (a public CA or the company's), and client certificates, when asked for,
come from whatever CA the users' certificates are issued by.
"""
from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass

import grpc

from kvrelay.common.flags import add_flag


@dataclass(frozen=True)
class PublicTls:
    cert: str  # PEM chain the public ports present
    key: str
    client_ca: str | None = None  # PEM: when set, clients must present a certificate from it

    def grpc_credentials(self) -> grpc.ServerCredentials:
        with open(self.cert, "rb") as cert, open(self.key, "rb") as key:
            pair = (key.read(), cert.read())
        client_ca = None
        if self.client_ca:
            with open(self.client_ca, "rb") as handle:
                client_ca = handle.read()
        return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                           require_client_auth=client_ca is not None)

    def uvicorn_options(self) -> dict:
        options = {"ssl_certfile": self.cert, "ssl_keyfile": self.key}
        if self.client_ca:
            options.update(ssl_ca_certs=self.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options


def add_public_tls_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--public-tls-cert", default=None,
             help="certificate chain (PEM) for HTTPS on the REST port and TLS on the public "
                  "gRPC port")
    add_flag(parser, "--public-tls-key", default=None, help="its private key (PEM)")
    add_flag(parser, "--public-tls-client-ca", default=None,
             help="CA (PEM) whose client certificates the public ports require (mutual TLS)")


def public_tls_from_args(args: argparse.Namespace) -> PublicTls | None:
    if not (args.public_tls_cert or args.public_tls_key):
        if args.public_tls_client_ca:
            raise SystemExit("--public-tls-client-ca needs --public-tls-cert and --public-tls-key")
        return None
    if not (args.public_tls_cert and args.public_tls_key):
        raise SystemExit("public TLS needs both --public-tls-cert and --public-tls-key")
    return PublicTls(args.public_tls_cert, args.public_tls_key, args.public_tls_client_ca)
