#!/bin/sh
# The image's entrypoint: `kvrelay "$@"`, plus one default that only a container needs.
#
# A worker registers with its scheduler under an address that the scheduler and the other workers
# dial (KV pages go worker to worker). The CLI's default, 127.0.0.1:PORT, is right for `kvrelay up`
# on one host and wrong in a container. Unless KVRELAY_ADVERTISE_ADDRESS is set (Kubernetes sets
# it to the pod IP), advertise this container's own IP: it is dialable on the compose network and
# differs between replicas (`docker compose up --scale decode-worker=2`). The port is taken from
# KVRELAY_PORT, so set the port through that variable, not `--port`, when relying on this.
set -e
if [ "${1:-}" = worker ] && [ -z "${KVRELAY_ADVERTISE_ADDRESS:-}" ]; then
    ip="$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')"
    KVRELAY_ADVERTISE_ADDRESS="$ip:${KVRELAY_PORT:-50060}"
    export KVRELAY_ADVERTISE_ADDRESS
fi
exec kvrelay "$@"
