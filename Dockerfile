# syntax=docker/dockerfile:1
# Two images from one file (docker-compose.yml builds both):
#   --target api     the HTTP API and the one-shot migration: the `api` extra, no torch
#   --target worker  the Celery worker: the `worker` extra with CUDA torch (runs on the CPU when
#                    no GPU is present)
# Both install the project as a wheel (no editable install, no source tree on the import path);
# the `higgs` command exists in both, and the migrations ship inside the package. The versions
# are those of requirements.lock (the tested set, taken as pip constraints: each image installs
# only what its extra needs).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- common base
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --uid 10001 higgs && mkdir -p /data && chown higgs /data

# ---------------------------------------------------------------- the project as a wheel
FROM base AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY migrations ./migrations
COPY app ./app
COPY higgs_engine ./higgs_engine
COPY higgs_cli ./higgs_cli
COPY worker ./worker
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------- llama.cpp (the gguf format)
# llama-cpp-python is published as source only: built here once, for any x86-64 CPU
# (GGML_NATIVE=OFF), with llama.cpp's converter taken from the same source distribution.
FROM base AS llama
ARG LLAMA_CPP_VERSION=0.3.36
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
RUN pip download --no-deps --no-binary :all: "llama-cpp-python==${LLAMA_CPP_VERSION}" -d /llama \
    && CMAKE_ARGS="-DGGML_NATIVE=OFF" pip wheel --no-deps \
       "/llama/llama_cpp_python-${LLAMA_CPP_VERSION}.tar.gz" --wheel-dir /llama/wheels \
    && mkdir -p /llama/src /llama/convert \
    && tar -xzf "/llama/llama_cpp_python-${LLAMA_CPP_VERSION}.tar.gz" -C /llama/src --wildcards \
       "*/vendor/llama.cpp/convert_hf_to_gguf.py" "*/vendor/llama.cpp/conversion/*" \
       "*/vendor/llama.cpp/gguf-py/*" "*/vendor/llama.cpp/LICENSE" \
    && cp -r /llama/src/*/vendor/llama.cpp/. /llama/convert/ \
    && echo "${LLAMA_CPP_VERSION}" > /llama/convert/VERSION

# ---------------------------------------------------------------- API (light: no torch)
FROM base AS api
COPY --from=wheel /wheels /wheels
COPY requirements.lock /tmp/requirements.lock
RUN pip install --find-links /wheels -c /tmp/requirements.lock "higgs-service[api]" \
    && rm -rf /wheels /tmp/requirements.lock
# `alembic upgrade head` (the compose migrate service) reads alembic.ini from the working
# directory; env.py and the revisions are the same files the package ships.
WORKDIR /app
COPY alembic.ini ./
COPY migrations ./migrations
USER higgs
ENV HIGGS_DATA_DIR=/data
EXPOSE 8000
CMD ["uvicorn", "app.main:create_app", "--factory", "--host", "0.0.0.0", "--port", "8000", "--loop", "uvloop", "--http", "httptools", "--no-proxy-headers"]

# ---------------------------------------------------------------- worker (CUDA torch)
FROM base AS worker
# The torch version the project is tested with (scripts/setup's TORCH_SPEC default). From PyPI
# the Linux x86_64 wheel is the CUDA build, its CUDA runtime in nvidia-* wheels: the host needs
# only the NVIDIA driver and the container toolkit (compose reserves the GPU). TORCH_INDEX_URL
# picks another build, e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
# (that index must carry this version).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
COPY --from=wheel /wheels /wheels
COPY --from=llama /llama/wheels /wheels
# The engine finds llama.cpp's converter under <prefix>/share/higgs-service/llama.cpp; its
# gguf-py (the same llama.cpp commit) replaces PyPI's gguf.
COPY --from=llama /llama/convert /usr/local/share/higgs-service/llama.cpp
COPY requirements.lock /tmp/requirements.lock
RUN pip install --find-links /wheels -c /tmp/requirements.lock "higgs-service[worker]" \
       "torch==${TORCH_VERSION}" \
    && pip install --no-deps /usr/local/share/higgs-service/llama.cpp/gguf-py \
    && rm -rf /wheels /tmp/requirements.lock
WORKDIR /app
USER higgs
ENV HIGGS_DATA_DIR=/data \
    HF_HOME=/data/hf \
    OMP_WAIT_POLICY=PASSIVE
CMD ["celery", "-A", "worker.celery_app", "worker", "-Q", "higgs,higgs.gpu", "--concurrency", "1", "--loglevel", "INFO"]
