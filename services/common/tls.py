"""Mutual TLS for the internal gRPC hops: flags, credentials and the process's own identity.

A service process has one identity (its role's certificate), so it is installed once at start
(`install`) and every server and channel of the process uses it: `channel(address, role)` in
grpc_server.py dials with it, ServiceServer serves with it. With no TLS flags everything stays
plaintext, as before.

Rotation: servers re-read their certificate, key and CA at the next handshake after the files
change (issue new certificates from the same CA before the old ones expire, replace the files);
clients read theirs when a channel is made, so they pick new ones up as they restart.
"""
from __future__ import annotations

import argparse
import os
import threading
from dataclasses import dataclass

import grpc

from kvrelay.common.flags import add_flag

SERVER_NAME_SUFFIX = ".kvrelay.internal"


def server_name(role: str) -> str:
    """The DNS name every certificate of `role` carries and every client of it checks."""
    return role + SERVER_NAME_SUFFIX


@dataclass(frozen=True)
class TlsFiles:
    ca: str  # PEM: the CA whose certificates peers must present
    cert: str  # PEM: this process's certificate (its role is its organizational unit)
    key: str  # PEM: its private key
    crl: str | None = None  # PEM: a revocation list of that CA, re-read when it changes

    def read(self) -> tuple[bytes, bytes, bytes]:
        return _read(self.ca), _read(self.cert), _read(self.key)

    def mtimes(self) -> tuple[float, ...]:
        return tuple(os.stat(path).st_mtime_ns for path in (self.ca, self.cert, self.key))


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--tls-ca", default=None,
             help="CA certificate (PEM): with --tls-cert and --tls-key, every internal gRPC hop "
                  "of this service uses mutual TLS and only peers with a certificate from this "
                  "CA are served (make them with `kvrelay certs`)")
    add_flag(parser, "--tls-cert", default=None, help="this service's certificate (PEM)")
    add_flag(parser, "--tls-key", default=None, help="this service's private key (PEM)")
    add_flag(parser, "--tls-crl", default=None,
             help="certificate revocation list (PEM) of the CA; peers it names are refused")


def tls_files_from_args(args: argparse.Namespace) -> TlsFiles | None:
    given = [args.tls_ca, args.tls_cert, args.tls_key]
    if not any(given):
        if args.tls_crl:
            raise SystemExit("--tls-crl needs --tls-ca, --tls-cert and --tls-key")
        return None
    if not all(given):
        raise SystemExit("TLS needs all three of --tls-ca, --tls-cert and --tls-key")
    files = TlsFiles(args.tls_ca, args.tls_cert, args.tls_key, args.tls_crl or None)
    for path in [*given, files.crl]:  # fail at start, naming the file, not at a handshake
        if path is not None and not os.access(path, os.R_OK):
            raise SystemExit(f"cannot read TLS file {path}")
    return files


_installed: TlsFiles | None = None


def install(files: TlsFiles | None) -> None:
    """Make `files` this process's identity for every internal server and channel."""
    global _installed
    _installed = files


def installed() -> TlsFiles | None:
    return _installed


def server_credentials(files: TlsFiles, require_client_cert: bool = True
                       ) -> grpc.ServerCredentials:
    """Credentials that re-read the files at the next handshake after any of them changed."""
    reloader = _Reloader(files)
    return grpc.dynamic_ssl_server_credentials(
        reloader.initial(), reloader.fetch, require_client_authentication=require_client_cert)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    ca, cert, key = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)


def target_options(peer_role: str) -> list[tuple[str, str]]:
    """Check the server's certificate against its role's name, not the address dialled:
    workers and containers are dialled by IP, and the role is what must not be spoofed."""
    return [("grpc.ssl_target_name_override", server_name(peer_role))]


class _Reloader:
    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self.lock = threading.Lock()  # fetch runs on gRPC's threads
        self.seen = files.mtimes()

    def initial(self):
        return self._configuration()

    def fetch(self):
        """None (keep the current files) unless one changed since the last load."""
        with self.lock:
            try:
                mtimes = self.files.mtimes()
                if mtimes == self.seen:
                    return None
                configuration = self._configuration()
            except OSError:
                return None  # mid-rotation (a file missing): keep serving with the old ones
            self.seen = mtimes
            return configuration

    def _configuration(self):
        ca, cert, key = self.files.read()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()
