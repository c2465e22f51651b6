"""The API's light Celery client: real messages on the embedded filesystem transport and, when
HIGGS_TEST_REDIS_URL is set, on a real Redis."""

from __future__ import annotations

import base64
import json
import os
import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.queue import check_broker, enqueue_job, queue_depth
from app.settings import TASK_NAME, Settings
from tests.fixtures import METRICS_AUTH, assert_problem

REDIS_ENV = "HIGGS_TEST_REDIS_URL"


def task_args(message: dict) -> list:
    """Positional args of a Celery protocol-2 message (body: base64 JSON [args, kwargs, embed])."""
    body = message["body"]
    if message["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args, _kwargs, _embed = json.loads(body)
    return list(args)


def test_filesystem_transport_message_is_a_celery_task(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    with pytest.raises(ConnectionError):
        check_broker(settings)  # folders not made yet
    settings.ensure_dirs()
    check_broker(settings)
    assert enqueue_job(settings, "job-1")
    assert queue_depth(settings) == 1
    files = list(Path(settings.broker_transport_options()["data_folder_in"]).iterdir())
    assert len(files) == 1
    message = json.loads(files[0].read_text())
    assert message["headers"]["task"] == TASK_NAME
    assert message["properties"]["delivery_info"]["routing_key"] == "higgs"
    assert task_args(message) == ["job-1"]


@pytest.fixture
def redis_url() -> str:
    url = os.environ.get(REDIS_ENV)
    if not url:
        pytest.skip(f"{REDIS_ENV} is not set (e.g. redis://127.0.0.1:6379/0)")
    return url


def test_redis_enqueue_readyz_and_depth(
    redis_url: str, settings: Settings, auth: dict[str, str]
) -> None:
    import redis

    queue = f"higgs-test-{uuid.uuid4().hex[:8]}"
    on_redis = settings.model_copy(update={"broker_url": redis_url, "task_queue": queue})
    client = redis.Redis.from_url(redis_url)
    try:
        with TestClient(create_app(on_redis)) as c:
            assert c.get("/readyz").json()["checks"]["broker"] == "ok"
            jid = c.post(
                "/v1/jobs", json={"model": {"id": "tiny"}, "target": {"bits": 4}}, headers=auth
            ).json()["id"]
            assert queue_depth(on_redis) == 1
            raw = client.lindex(queue, 0)
            assert raw is not None
            message = json.loads(raw)
            assert message["headers"]["task"] == TASK_NAME
            assert task_args(message) == [jid]
            assert (
                f'higgs_queue_depth{{queue="{queue}"}} 1.0'
                in c.get("/metrics", headers=METRICS_AUTH).text
            )
    finally:
        client.delete(queue)
        client.close()


def test_readyz_503_when_redis_is_down(settings: Settings) -> None:
    down = settings.model_copy(
        update={"broker_url": "redis://127.0.0.1:1/0", "broker_timeout_s": 0.5}
    )
    with TestClient(create_app(down)) as c:
        ready = c.get("/readyz")
        body = assert_problem(ready, 503)
        assert "broker" in body["detail"] and ready.headers["retry-after"] == "5"
        # Which dependency failed, never the exception text (that goes to the log).
        assert body["checks"] == {"database": "ok", "broker": "unavailable", "store": "ok"}
        assert "127.0.0.1" not in ready.text and "refused" not in ready.text.lower()
        assert (
            'higgs_queue_depth{queue="higgs"} -1.0' in c.get("/metrics", headers=METRICS_AUTH).text
        )
