"""The worker under faults, at the runner level (real SQLite database, real tiny checkpoints,
real engine): database outages, duplicate and lost messages, a full disk, messages without
server paths, symbolic links out of the models folder. The same faults with real processes
(PostgreSQL and Redis restarted, a pool process killed, a real full filesystem) are in
tests/e2e/test_faults_e2e.py."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from app.db.base import utcnow
from app.db.models import Job
from app.jobs import state
from app.settings import Settings
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import files_under
from tests.worker.helpers import create_job, wait_until
from worker import sweep as sweep_mod
from worker.config import RunnerConfig
from worker.dbretry import DatabaseUnavailableError, retry_db
from worker.messages import is_storage_full, public_message, scrub_paths
from worker.runner import run_job
from worker.sweep import SweepThread, sweep

BODY = {"model": {"id": MODEL}, "target": {"bits": 4}}


def _job(sessions: sessionmaker[Session], job_id: str) -> Job:
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None
        s.expunge(job)
        return job


def _down() -> OperationalError:
    return OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))


# ---------------------------------------------------------------- retries with backoff


def test_retry_db_backs_off_then_succeeds_and_gives_up_after_its_budget() -> None:
    now = [0.0]
    sleeps: list[float] = []

    def sleep(d: float) -> None:
        sleeps.append(d)
        now[0] += d

    fails = [3]

    def flaky() -> str:
        if fails[0]:
            fails[0] -= 1
            raise _down()
        return "ok"

    assert retry_db(flaky, "test", 60, sleep=sleep, clock=lambda: now[0]) == "ok"
    assert len(sleeps) == 3 and sleeps[0] < sleeps[1] < sleeps[2]  # exponential backoff

    sleeps.clear()
    with pytest.raises(DatabaseUnavailableError, match="unreachable for"):
        retry_db(
            lambda: (_ for _ in ()).throw(_down()), "test", 10, sleep=sleep, clock=lambda: now[0]
        )
    assert 8 <= sum(sleeps) <= 10 + 1e-9 and max(sleeps) <= 2.4  # capped delay, bounded total

    calls = [0]

    def bad_row() -> None:
        calls[0] += 1
        raise IntegrityError("INSERT", {}, ValueError("duplicate key"))

    with pytest.raises(IntegrityError):
        retry_db(bad_row, "test", 60, sleep=sleep, clock=lambda: now[0])
    assert calls[0] == 1  # not a connection problem: never retried


class FlakySessions:
    """A session factory that refuses to connect while `down` is set (as SQLAlchemy does when
    the server is unreachable), counting the refusals."""

    def __init__(self, real: sessionmaker[Session]) -> None:
        self.real = real
        self.down = threading.Event()
        self.refused = 0
        self.kw = real.kw

    def __call__(self) -> Session:
        if self.down.is_set():
            self.refused += 1
            raise _down()
        return self.real()


# slow: a quantization across a database outage waited out (the lane keeps the over-budget outage)
@pytest.mark.slow
def test_a_database_outage_mid_job_does_not_end_or_count_the_attempt(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    job_id = create_job(sessions, settings, BODY)
    flaky = FlakySessions(sessions)
    cfg = dataclasses.replace(
        runner_cfg, debug_layer_delay_s=0.15, heartbeat_interval_s=0.2, db_retry_s=30
    )
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(run_job(flaky, job_id, cfg, worker_id="w1")))  # type: ignore[arg-type]
    t.start()
    try:
        wait_until(
            lambda: (
                _job(sessions, job_id).progress_done >= 2
                and _job(sessions, job_id).stage == "quantizing"
            ),
            60,
            "quantizing",
        )
        flaky.down.set()
        wait_until(lambda: flaky.refused >= 5, 10, "writes refused during the outage")
        threading.Event().wait(2.0)  # the outage lasts a while: longer than the heartbeat interval
        flaky.down.clear()
    finally:
        flaky.down.clear()
        t.join(120)
    assert result and result[0].status == "succeeded", result
    job = _job(sessions, job_id)
    assert (job.status, job.attempts, job.error_code) == ("succeeded", 1, None)


def test_an_outage_longer_than_the_budget_abandons_the_attempt_without_failing_the_job(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    job_id = create_job(sessions, settings, BODY)
    flaky = FlakySessions(sessions)
    cfg = dataclasses.replace(runner_cfg, debug_layer_delay_s=0.1, db_retry_s=1.0)
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(run_job(flaky, job_id, cfg, worker_id="w1")))  # type: ignore[arg-type]
    t.start()
    try:
        wait_until(lambda: _job(sessions, job_id).stage == "quantizing", 60, "quantizing")
        flaky.down.set()
        t.join(60)
    finally:
        flaky.down.clear()
        t.join(60)
    assert result and result[0].status == "lost", result
    job = _job(sessions, job_id)
    # Left running for the heartbeat sweep (bounded attempts), never failed as internal_error.
    assert (job.status, job.error_code) == ("running", None)
    assert files_under(settings.artifacts_path) == []


def test_a_claim_whose_reply_was_lost_is_recognised_as_ours(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    job_id = create_job(sessions, settings, BODY)

    class LoseFirstCommitReply:
        """The first session commits, then reports the connection lost (the reply never came)."""

        def __init__(self) -> None:
            self.first = True
            self.kw = sessions.kw

        def __call__(self) -> Session:
            s = sessions()
            if self.first:
                self.first = False
                real_commit = s.commit

                def commit() -> None:
                    real_commit()
                    raise _down()

                s.commit = commit  # type: ignore[method-assign]
            return s

    out = run_job(LoseFirstCommitReply(), job_id, runner_cfg, worker_id="w1")  # type: ignore[arg-type]
    assert out.status == "succeeded"
    assert _job(sessions, job_id).attempts == 1


def test_sweep_pauses_stale_checks_until_a_heartbeat_timeout_after_an_outage() -> None:
    now = [0.0]
    calls: list[bool] = []
    failing = [False]

    def run_once(requeue_stale: bool) -> None:
        if failing[0]:
            raise _down()
        calls.append(requeue_stale)

    t = SweepThread(run_once, interval=1, outage_grace_s=10, clock=lambda: now[0])
    t.pass_once()  # t=0: all checks
    failing[0] = True
    now[0] = 1
    t.pass_once()  # the database is away: the pass fails
    failing[0] = False
    for now[0] in (2, 7, 11.9, 12.1):  # back at t=2: no stale checks until t=12
        t.pass_once()
    assert calls == [True, False, False, False, True]


# ---------------------------------------------------------------- lost and duplicate messages


def _sent_at(sessions: sessionmaker[Session], job_id: str, seconds_ago: float) -> None:
    with sessions() as s:
        s.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(enqueued_at=utcnow() - timedelta(seconds=seconds_ago))
        )
        s.commit()


def test_a_queued_job_whose_message_was_lost_is_sent_again_and_a_duplicate_is_harmless(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    settings = settings.model_copy(update={"queued_resend_s": 5.0})
    job_id = create_job(sessions, settings, BODY)
    _sent_at(sessions, job_id, 1)
    sent: list[str] = []

    def send(jid: str) -> bool:
        sent.append(jid)
        return True

    # Recently sent: left alone whatever the broker holds.
    assert sweep(sessions, settings, send, lambda: 0).resent == []
    _sent_at(sessions, job_id, 60)
    # Unclaimed for a minute, but the broker still holds a message per sent job: only waiting.
    assert sweep(sessions, settings, send, lambda: 1).resent == [] and sent == []
    # The broker lost it (restarted without persistence): sent again, once per deadline.
    assert sweep(sessions, settings, send, lambda: 0).resent == [job_id] and sent == [job_id]
    assert sweep(sessions, settings, send, lambda: 0).resent == []
    # Both messages are delivered: one attempt runs, the duplicate finds nothing to claim.
    assert run_job(sessions, job_id, runner_cfg, worker_id="w1").status == "succeeded"
    assert run_job(sessions, job_id, runner_cfg, worker_id="w2").status == "skipped"
    job = _job(sessions, job_id)
    assert (job.status, job.attempts, job.worker_id) == ("succeeded", 1, "w1")


def test_release_lost_requeues_only_the_dead_processes_job(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    job_id = create_job(sessions, settings, BODY)
    with sessions() as s:
        assert state.claim(s, job_id, "host:111") is not None
        assert (
            state.release_lost(s, job_id, "host:222", 3, "died") is None
        )  # not that process's job
        assert state.release_lost(s, job_id, "host:111", 3, "died") == "queued"
        assert state.release_lost(s, job_id, "host:111", 3, "died") is None  # already released
    job = _job(sessions, job_id)
    assert (job.status, job.worker_id, job.attempts) == (
        "queued",
        None,
        1,
    ) and job.enqueued_at is not None
    with sessions() as s:
        assert state.claim(s, job_id, "host:333") is not None
        assert (
            state.release_lost(s, job_id, "host:333", 2, "the worker process running it died")
            == "failed"
        )
    job = _job(sessions, job_id)
    assert (job.status, job.error_code) == ("failed", "worker_lost")
    assert "attempt 2 of 2" in (job.error_message or "")


# ---------------------------------------------------------------- a full disk


def _full_disk_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The engine's first run writes part of its output, then hits ENOSPC; later runs work."""
    import higgs_engine.pipeline as pipeline

    real = pipeline.quantize_whole
    calls = [0]

    def quantize(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            Path(ctx.tmp).mkdir(parents=True, exist_ok=True)
            (Path(ctx.tmp) / "partial.bin").write_bytes(b"x" * 1000)
            raise OSError(
                errno.ENOSPC, "No space left on device", str(Path(ctx.tmp) / "model.safetensors")
            )
        return real(ctx, *args, **kwargs)

    monkeypatch.setattr(pipeline, "quantize_whole", quantize)
    return calls


def test_a_full_disk_puts_the_job_back_until_there_is_room(
    settings: Settings,
    sessions: sessionmaker[Session],
    runner_cfg: RunnerConfig,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = _full_disk_once(monkeypatch)
    job_id = create_job(sessions, settings, BODY)
    caplog.set_level("INFO")
    out = run_job(sessions, job_id, runner_cfg, worker_id="w1")
    assert out.status == "storage_full"
    job = _job(sessions, job_id)
    assert (job.status, job.error_code, job.attempts, job.enqueued_at) == (
        "queued",
        "storage_full",
        0,
        None,
    )
    assert job.wait_free_bytes is not None and job.wait_free_bytes > 0
    assert str(settings.data_dir) not in (job.error_message or "")
    assert files_under(settings.artifacts_path) == []  # the partial output is gone
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert (
        len(errors) == 1 and "storage full" in errors[0].getMessage() and errors[0].exc_info is None
    )

    sent: list[str] = []

    def send(jid: str) -> bool:
        sent.append(jid)
        return True

    free = job.wait_free_bytes
    monkeypatch.setattr(sweep_mod, "volume_free", lambda _p: (free + 1000, 10 * 2**30))
    assert sweep(sessions, settings, send).storage == [] and sent == []  # no more room yet
    monkeypatch.setattr(sweep_mod, "volume_free", lambda _p: (free + 2**30, 10 * 2**30))
    assert sweep(sessions, settings, send).storage == [job_id] and sent == [job_id]
    assert sweep(sessions, settings, send).storage == []  # sent once
    assert run_job(sessions, job_id, runner_cfg, worker_id="w2").status == "succeeded"
    job = _job(sessions, job_id)
    assert (job.status, job.error_code, job.attempts, job.wait_free_bytes) == (
        "succeeded",
        None,
        1,
        None,
    )
    assert calls[0] == 2


def test_a_job_waiting_for_storage_is_sent_again_after_storage_retry_s(
    settings: Settings,
    sessions: sessionmaker[Session],
    runner_cfg: RunnerConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _full_disk_once(monkeypatch)
    job_id = create_job(sessions, settings, BODY)
    assert run_job(sessions, job_id, runner_cfg, worker_id="w1").status == "storage_full"
    monkeypatch.setattr(sweep_mod, "volume_free", lambda _p: (0, 10 * 2**30))  # as full as ever
    short = settings.model_copy(update={"storage_retry_s": 0.5})
    assert sweep(sessions, short, lambda j: True).storage == []
    wait_until(
        lambda: sweep(sessions, short, lambda j: True).storage == [job_id], 10, "the storage retry"
    )


def test_storage_full_is_recognised_through_wrapping_and_library_messages() -> None:
    from higgs_engine.errors import HiggsError

    def write() -> None:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise HiggsError("could not write the artifact") from e

    with pytest.raises(HiggsError) as wrapped:
        write()
    assert is_storage_full(wrapped.value)
    assert is_storage_full(
        RuntimeError(
            'IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )
    )
    assert not is_storage_full(OSError(errno.EACCES, "Permission denied"))


# ---------------------------------------------------------------- messages and links


def test_error_messages_carry_no_server_paths_and_stay_short(
    settings: Settings,
    sessions: sessionmaker[Session],
    runner_cfg: RunnerConfig,
    tmp_path: Path,
    models_dir: Path,
) -> None:
    broken = tmp_path / "srv-models"
    (broken / MODEL).mkdir(parents=True)
    (broken / MODEL / "config.json").write_text(
        '{"model_type": "no_such_architecture_x", "hidden_size": 8}'
    )
    shutil.copy(models_dir / MODEL / "model.safetensors", broken / MODEL / "model.safetensors")
    job_id = create_job(sessions, settings, BODY)
    run_job(sessions, job_id, dataclasses.replace(runner_cfg, models_dir=broken))
    job = _job(sessions, job_id)
    assert job.error_code == "unsupported_model", job.error_message
    assert "no_such_architecture_x" in (job.error_message or "")
    assert len(job.error_message or "") < 300 and "albert" not in (job.error_message or "")

    (broken / MODEL / "config.json").write_text("{not json")
    job_id = create_job(sessions, settings, BODY)
    run_job(sessions, job_id, dataclasses.replace(runner_cfg, models_dir=broken))
    job = _job(sessions, job_id)
    assert job.error_code == "corrupt_checkpoint", job.error_message
    assert str(tmp_path) not in (job.error_message or "") and "tiny/config.json" in (
        job.error_message or ""
    )

    roots = {Path("/srv/models"): "", Path("/data/artifacts"): ""}
    text = (
        "cannot read '/srv/models/tiny/model.safetensors' or /data/artifacts/.staging/j.1.ab/out/native/x.json "
        "or /etc/secret/thing (see https://huggingface.co/docs/x)"
    )
    assert scrub_paths(text, roots) == (
        "cannot read 'tiny/model.safetensors' or native/x.json or thing (see https://huggingface.co/docs/x)"
    )
    assert public_message(FileNotFoundError(2, "No such file", "/var/lib/higgs/x.bin"), {}) == (
        "FileNotFoundError: [Errno 2] No such file: 'x.bin'"
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", "sixty-four"),  # transformers' strict config validation refuses it
        ("vocab_size", None),
        ("num_attention_heads", 0),  # the config's own check divides by it
        ("rope_scaling", "linear"),
    ],
)
def test_a_malformed_config_is_unsupported_model_not_internal_error(
    settings: Settings,
    sessions: sessionmaker[Session],
    runner_cfg: RunnerConfig,
    tmp_path: Path,
    models_dir: Path,
    field: str,
    value: Any,
) -> None:
    """config.json that is JSON but whose fields transformers cannot build a config from."""
    broken = tmp_path / "srv-models"
    shutil.copytree(models_dir / MODEL, broken / MODEL)
    cfg_file = broken / MODEL / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), field: value}))
    job_id = create_job(sessions, settings, BODY)
    run_job(sessions, job_id, dataclasses.replace(runner_cfg, models_dir=broken))
    job = _job(sessions, job_id)
    assert job.status == "failed" and job.error_code == "unsupported_model", job.error_message
    assert "config.json" in (job.error_message or "") and str(tmp_path) not in (
        job.error_message or ""
    )
    assert len(job.error_message or "") < 500


def _linked_model(tmp_path: Path, models_dir: Path, link: Callable[[Path, Path], None]) -> Path:
    root = tmp_path / "linked-models"
    shutil.copytree(models_dir / MODEL, root / MODEL)
    link(root, tmp_path)
    return root


def test_a_symlink_out_of_the_models_folder_is_refused(
    settings: Settings,
    sessions: sessionmaker[Session],
    runner_cfg: RunnerConfig,
    tmp_path: Path,
    models_dir: Path,
) -> None:
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("server secret")

    def link_file(root: Path, _tmp: Path) -> None:
        (root / MODEL / "tokenizer.json").unlink()
        os.symlink(secret, root / MODEL / "tokenizer.json")

    root = _linked_model(tmp_path, models_dir, link_file)
    job_id = create_job(sessions, settings, BODY)
    out = run_job(sessions, job_id, dataclasses.replace(runner_cfg, models_dir=root))
    assert out.status == "failed"
    job = _job(sessions, job_id)
    assert job.error_code == "unsupported_model"
    assert "'tokenizer.json' is a symbolic link" in (job.error_message or "")
    assert str(tmp_path) not in (job.error_message or "")
    assert files_under(settings.artifacts_path) == []

    # A whole model folder linked from outside is refused too; a link inside the folder is fine.
    outside_model = tmp_path / "outside" / "model"
    shutil.copytree(models_dir / MODEL, outside_model)
    root2 = tmp_path / "linked-dir"
    root2.mkdir()
    os.symlink(outside_model, root2 / MODEL)
    job_id = create_job(sessions, settings, BODY)
    run_job(sessions, job_id, dataclasses.replace(runner_cfg, models_dir=root2))
    assert _job(sessions, job_id).error_code == "unsupported_model"

    def link_inside(root: Path, _tmp: Path) -> None:
        shutil.move(root / MODEL / "tokenizer.json", root / "shared-tokenizer.json")
        os.symlink(root / "shared-tokenizer.json", root / MODEL / "tokenizer.json")

    root3 = _linked_model(tmp_path / "in", models_dir, link_inside)
    job_id = create_job(sessions, settings, BODY)
    assert (
        run_job(sessions, job_id, dataclasses.replace(runner_cfg, models_dir=root3)).status
        == "succeeded"
    )


def test_the_main_process_releases_the_job_of_a_lost_pool_process(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket
    from types import SimpleNamespace

    from billiard.exceptions import TimeLimitExceeded, WorkerLostError

    import worker.tasks as tasks

    monkeypatch.setattr(tasks, "sessions_for", lambda _settings: sessions)
    monkeypatch.setitem(tasks.app.conf, "higgs_settings", settings)
    host = socket.gethostname()
    job_id = create_job(sessions, settings, BODY)
    with sessions() as s:
        assert state.claim(s, job_id, f"{host}:4242") is not None

    def lost(pid: int, exc: BaseException) -> None:
        request: Any = SimpleNamespace(worker_pid=pid, args=[job_id], id="t")
        tasks.JobRequest._release_job(request, exc)

    lost(9999, WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL)"))  # not its job
    assert _job(sessions, job_id).status == "running"
    lost(4242, WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL)"))
    job = _job(sessions, job_id)
    assert (job.status, job.attempts, job.worker_id) == ("queued", 1, None)
    assert job.enqueued_at is not None  # the message goes back to the broker: not re-sent

    with sessions() as s:
        assert state.claim(s, job_id, f"{host}:5555") is not None
    lost(5555, ValueError("an ordinary task error"))  # the runner records those itself
    assert _job(sessions, job_id).status == "running"
    lost(5555, TimeLimitExceeded(21900))  # killed by the hard time limit
    job = _job(sessions, job_id)
    assert (job.status, job.error_code) == ("failed", "time_limit")
