"""`kvrelay certs`: a CA and one certificate per role for the services' mutual TLS.

    kvrelay certs --out deploy/certs                      # new CA + every role
    kvrelay certs --out deploy/certs --reuse-ca           # rotate: new leaves, same CA
    kvrelay certs --out deploy/certs --revoke old/worker.pem   # add to deploy/certs/crl.pem

Rotation without downtime: issue new leaves from the same CA (--reuse-ca), replace the files;
servers load them at their next handshake, clients as they restart. A leaked certificate is
revoked by naming it in the CRL every service reads with --tls-crl.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from kvrelay.common.flags import add_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvrelay.common.certs import LEAF_DAYS, ROLES
    add_flag(parser, "--out", required=True, help="directory to write the PEM files into")
    add_flag(parser, "--roles", default=",".join(ROLES),
             help=f"comma-separated roles to issue ({', '.join(ROLES)})")
    add_flag(parser, "--san", action="append", default=[],
             help="an extra DNS name or IP every certificate carries (repeatable)")
    add_flag(parser, "--days", type=int, default=LEAF_DAYS, help="validity of the leaves")
    add_flag(parser, "--reuse-ca", action="store_true", default=False,
             help="sign with <out>/ca.pem and ca-key.pem instead of making a new CA")
    add_flag(parser, "--revoke", action="append", default=[],
             help="a certificate (PEM) to add to <out>/crl.pem instead of issuing (repeatable)")


def run(args: argparse.Namespace) -> int:
    from cryptography import x509

    from kvrelay.common.certs import Authority, write_bundle, write_file
    out = Path(args.out)
    if args.revoke:  # services re-read the CRL at their next call: nothing restarts
        authority = Authority.load(out / "ca.pem", out / "ca-key.pem")
        serials = [x509.load_pem_x509_certificate(Path(path).read_bytes()).serial_number
                   for path in args.revoke]
        serials += _already_revoked(out / "crl.pem")
        write_file(out / "crl.pem", authority.revocation_list(serials))
        print(f"{out / 'crl.pem'}: {len(set(serials))} certificate(s) revoked")
        return 0
    authority = Authority.load(out / "ca.pem", out / "ca-key.pem") if args.reuse_ca else None
    roles = tuple(role.strip() for role in args.roles.split(",") if role.strip())
    write_bundle(out, roles, tuple(args.san), authority, args.days)
    print(f"{out}: ca.pem and {', '.join(f'{role}.pem' for role in roles)} (+ keys)")
    return 0


def _already_revoked(path: Path) -> list[int]:
    if not path.exists():
        return []
    from cryptography import x509
    return [entry.serial_number for entry in x509.load_pem_x509_crl(path.read_bytes())]
