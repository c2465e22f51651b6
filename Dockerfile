# syntax=docker/dockerfile:1
# Two images from one file (docker-compose.yml builds both):
#   --target api     the HTTP API and the one-shot migration: no torch, starts in a second
#   --target worker  the Celery worker with CUDA torch (runs on the CPU when no GPU is present)
# The source lives in /app and is installed in editable mode, so `alembic upgrade head` finds
# alembic.ini + migrations/ and the `higgs` command exists in both images.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- common source layer
FROM ${PYTHON_IMAGE} AS source
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY migrations ./migrations
COPY app ./app
COPY higgs_engine ./higgs_engine
COPY higgs_cli ./higgs_cli
COPY worker ./worker

# ---------------------------------------------------------------- API (light: no torch)
FROM source AS api
# The API imports only the torch-free parts of the engine (config, errors, and for POST
# /v1/plans the allocator, profile and dynamic modules, which need numpy), so the package goes
# in without its dependencies and only the service's (plus numpy) are added.
RUN pip install \
        "numpy>=1.26" "fastapi>=0.115" "uvicorn[standard]>=0.30" "pydantic>=2.7" "pydantic-settings>=2.3" \
        "sqlalchemy>=2.0" "alembic>=1.13" "psycopg[binary]>=3.1" "celery>=5.4" "redis>=5.0" \
        "httpx>=0.27" "prometheus-client>=0.20" "pyyaml>=6" "tqdm>=4.66" \
    && pip install --no-deps -e . \
    && useradd --create-home --uid 10001 higgs \
    && mkdir -p /data && chown higgs /data
USER higgs
ENV HIGGS_DATA_DIR=/data
EXPOSE 8000
CMD ["uvicorn", "app.main:create_app", "--factory", "--host", "0.0.0.0", "--port", "8000", "--loop", "uvloop", "--http", "httptools"]

# ---------------------------------------------------------------- worker (CUDA torch)
FROM source AS worker
# CUDA wheels of torch carry the CUDA runtime; the host needs only the NVIDIA driver and the
# container toolkit (compose reserves the GPU).
ARG TORCH_VERSION=2.5.1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && pip install -e . \
    && useradd --create-home --uid 10001 higgs \
    && mkdir -p /data && chown higgs /data
USER higgs
ENV HIGGS_DATA_DIR=/data \
    HF_HOME=/data/hf
CMD ["celery", "-A", "worker.celery_app", "worker", "-Q", "higgs,higgs.gpu", "--concurrency", "1", "--loglevel", "INFO"]
