# rein's image: the `rein` command with its migrations, for every service in compose.yaml.
#
# CPU (default):  docker build -t rein .
# CUDA:           docker build -t rein --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   (the CUDA torch wheels bring their own CUDA runtime and Triton; the host needs only the
#   NVIDIA driver and the NVIDIA Container Toolkit. A different base works too, e.g.
#   --build-arg BASE_IMAGE=nvidia/cuda:12.8.0-runtime-ubuntu24.04 with a Python 3.11 on it.)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/hf-cache \
    REIN_CACHE_DIR=/models/rein-cache

WORKDIR /app

# A C compiler: the worker builds rein's CPU kernels on first use (rein.kernels.cpu_native;
# without one it falls back to torch's slower code).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the chosen index, in its own layer (it is by far the largest).
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md ./
COPY rein/ ./rein/
RUN pip install '.[gguf]'

# The API and the worker check the schema revision at startup and `rein migrate` applies
# it: they find migrations/ in the working directory (/app).
COPY migrations/ ./migrations/

# Non-root; /models is where compose mounts the models volume, /data/files the files volume
# (a new named volume takes this directory's owner, so the user can write there).
RUN useradd --create-home --uid 10001 rein \
    && mkdir -p /models /data/files \
    && chown rein:rein /models /data/files
USER rein

EXPOSE 8000
ENTRYPOINT ["rein"]
CMD ["--help"]
