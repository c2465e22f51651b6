"""HTTP for webhooks: the caller's signing secret, and a job's deliveries."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from app.deps import CurrentKey, SessionsDep
from app.jobs.service import get_job
from app.openapi import AUTHENTICATED, problems
from app.params import JobId
from app.webhooks import service
from app.webhooks.signing import SIGNATURE_HEADER

router = APIRouter(tags=["webhooks"])


class SecretOut(BaseModel):
    secret: str
    algorithm: str = "HMAC-SHA256"
    header: str = SIGNATURE_HEADER
    signed_content: str = "<t>.<raw request body>"


class DeliveryOut(BaseModel):
    id: str
    event: str
    url: str
    state: str
    attempts: int
    next_attempt_at: datetime | None
    last_status_code: int | None
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None
    attempt_log: list[dict[str, Any]]
    payload: dict[str, Any]


class DeliveriesOut(BaseModel):
    job_id: str
    webhook_url: str | None
    data: list[DeliveryOut]


@router.get(
    "/v1/webhooks/secret",
    response_model=SecretOut,
    responses=problems(*AUTHENTICATED),
    summary="The caller's webhook signing secret (made on first use)",
)
def get_webhook_secret(sessions: SessionsDep, key: CurrentKey) -> SecretOut:
    with sessions() as session:
        return SecretOut(secret=service.secret_of(session, key.id))


@router.post(
    "/v1/webhooks/secret/rotate",
    response_model=SecretOut,
    responses=problems(*AUTHENTICATED),
    summary="Replace the caller's webhook signing secret",
)
def rotate_webhook_secret(sessions: SessionsDep, key: CurrentKey) -> SecretOut:
    with sessions() as session:
        return SecretOut(secret=service.rotate_secret(session, key.id))


@router.get(
    "/v1/jobs/{job_id}/webhooks",
    response_model=DeliveriesOut,
    responses=problems(*AUTHENTICATED, 404),
    summary="The job's webhook deliveries and their outcomes",
)
def list_job_webhooks(job_id: JobId, sessions: SessionsDep, key: CurrentKey) -> DeliveriesOut:
    with sessions() as session:
        job = get_job(session, key, job_id)
        rows = service.deliveries_of(session, job.id)
        return DeliveriesOut.model_validate(
            {
                "job_id": job.id,
                "webhook_url": job.webhook_url,
                "data": [service.delivery_view(d) for d in rows],
            }
        )
