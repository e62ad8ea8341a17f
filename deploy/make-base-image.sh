#!/bin/sh
# Builds a Debian bookworm base image locally, for machines that cannot pull from an image
# registry: `docker build --build-arg BASE_IMAGE=kvrelay-base:bookworm .` then needs no pull.
#
#   deploy/make-base-image.sh [IMAGE]        # default kvrelay-base:bookworm; needs root
#
# What the Dockerfile expects of its base, which python:3.11-slim-bookworm has too: python3 3.11
# with venv (Debian's own python refuses `pip install`, PEP 668), its headers and g++ (torch
# compiles kernels/csrc on first start), ca-certificates, useradd. The root filesystem comes from
# Debian's archive through debootstrap, the same mirror apt uses (DEBIAN_MIRROR overrides it).
# Does nothing when the image already exists, so scripts and tests can call it every time.
set -eu
IMAGE="${1:-kvrelay-base:bookworm}"
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES=python3,python3-venv,python3-dev,g++,ca-certificates,passwd

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "$IMAGE exists; nothing to do"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }

root="$(mktemp -d "${TMPDIR:-/var/tmp}/kvrelay-base.XXXXXX")"
# debootstrap mounts /proc and /sys inside the tree while it runs; unmount before removing it.
cleanup() {
    for mount in proc sys dev/pts dev; do umount "$root/$mount" 2>/dev/null || true; done
    rm -rf "$root"
}
trap cleanup EXIT INT TERM

# minbase: only Essential packages and apt, plus what the Dockerfile needs (no recommends).
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR"
# An image carries no package caches or downloaded lists (the Dockerfile's apt step fetches lists
# again), and its apt sources point at the mirror it came from.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
       "$root"/var/log/* "$root"/tmp/* "$root"/root/.cache
echo "deb $MIRROR $SUITE main" > "$root/etc/apt/sources.list"
# As in Debian's own images: apt keeps no package cache and no downloaded .debs, so a layer that
# runs `apt-get update && apt-get install` holds only what it installed.
cat > "$root/etc/apt/apt.conf.d/docker-clean" <<'APT'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
APT
# mktemp -d made the tree's top 0700, which would become the image's / (no one but root could
# reach /bin/sh).
chmod 0755 "$root"

tar --numeric-owner -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap $SUITE minbase + $PACKAGES" \
    - "$IMAGE"
echo "built $IMAGE"
