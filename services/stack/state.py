"""The stack's state file: one JSON document listing every service's pid, address and metrics URL.

Tests and operators read it to find a service (e.g. to kill the decode worker); it is replaced
atomically on every change, so a reader never sees half of it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from kvrelay.stack.child import Child


def stack_state(status: str, topology: str, children: list[Child], ready: set[str],
                restarts: dict[str, int] | None = None) -> dict:
    gateways = [child.spec for child in children if child.spec.kind == "gateway"]
    gateway = gateways[0]
    return {
        # starting, ready, degraded (a crashed child is being restarted), stopping, stopped, failed
        "status": status,
        "pid": os.getpid(),
        "topology": topology,
        "rest_url": gateway.rest_url,
        "openai_base_url": f"{gateway.rest_url}/v1",
        "grpc_address": gateway.address,
        "rest_urls": [spec.rest_url for spec in gateways],  # every gateway replica
        # mutual TLS between the services: ca.pem and <role>.pem/-key.pem; admin.pem for tools
        "tls_dir": gateway.tls_dir or None,
        "services": {child.name: {
            "kind": child.spec.kind,
            "role": child.spec.role,
            "pid": child.pid,
            "address": child.spec.address,
            "metrics_url": child.spec.metrics_url,
            "command": child.spec.command(),  # the same service by hand
            "log": str(child.log_path) if child.log_path else None,
            "ready": child.name in ready,
            "exit_code": child.exit_code(),
            "restarts": (restarts or {}).get(child.name, 0),
        } for child in children},
    }


def write_state(path: Path, state: dict) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(staging, path)
