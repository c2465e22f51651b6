# syntax=docker/dockerfile:1
# Two images from one file (docker-compose.yml builds both):
#   --target api     the HTTP API and the one-shot migration: the `api` extra, no torch
#   --target worker  the Celery worker: the `worker` extra with CUDA torch (runs on the CPU when
#                    no GPU is present)
# Both install the project as a wheel (no editable install, no source tree on the import path);
# the `higgs` command exists in both, and the migrations ship inside the package.

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

# ---------------------------------------------------------------- API (light: no torch)
FROM base AS api
COPY --from=wheel /wheels /wheels
RUN pip install --find-links /wheels "higgs-service[api]" && rm -rf /wheels
# `alembic upgrade head` (the compose migrate service) reads alembic.ini from the working
# directory; env.py and the revisions are the same files the package ships.
WORKDIR /app
COPY alembic.ini ./
COPY migrations ./migrations
USER higgs
ENV HIGGS_DATA_DIR=/data
EXPOSE 8000
CMD ["uvicorn", "app.main:create_app", "--factory", "--host", "0.0.0.0", "--port", "8000", "--loop", "uvloop", "--http", "httptools"]

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
RUN pip install --find-links /wheels "higgs-service[worker]" "torch==${TORCH_VERSION}" && rm -rf /wheels
WORKDIR /app
USER higgs
ENV HIGGS_DATA_DIR=/data \
    HF_HOME=/data/hf
CMD ["celery", "-A", "worker.celery_app", "worker", "-Q", "higgs,higgs.gpu", "--concurrency", "1", "--loglevel", "INFO"]
