"""A sharded source fanned out into parts (worker.fanout, app.jobs.parts) against a real
migrated SQLite database, real tiny checkpoints and the real engine; the tasks' functions are
called directly (the dispatcher records what a chord would send)."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.store import uri_path
from app.db.base import utcnow
from app.db.models import Job, JobPart
from app.jobs import parts as part_state
from app.jobs import state
from app.settings import Settings
from higgs_engine.job import QuantizeJob, run
from higgs_engine.planning.config import HiggsConfig
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import build_tiny_checkpoint, files_under
from tests.worker.helpers import create_job, wait_until
from worker.config import RunnerConfig
from worker.fanout import assemble, run_part
from worker.runner import run_job
from worker.sweep import sweep_fanout

BODY = {"model": {"id": MODEL}, "target": {"bits": 4}}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HIGGS_MODELS_DIR whose TINY_MODEL is saved in several shards."""
    root = tmp_path_factory.mktemp("models-sharded")
    build_tiny_checkpoint("llama", root / MODEL, max_shard_size="60KB")
    assert len(list((root / MODEL).glob("model-*.safetensors"))) >= 3
    return root


class Dispatcher:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int, list[int]]] = []

    def __call__(self, job_id: str, attempt: int, idxs: list[int]) -> bool:
        self.sent.append((job_id, attempt, list(idxs)))
        return True


def digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in files_under(root)
    }


def published(sessions: sessionmaker[Session], job_id: str) -> dict[str, str]:
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None
        out = {}
        for art in job.artifacts:
            root = uri_path(art.uri)
            for f in art.files:
                assert hashlib.sha256((root / f.path).read_bytes()).hexdigest() == f.sha256
                out[f"{art.format}/{f.path}"] = f.sha256
        return out


def rows(sessions: sessionmaker[Session], job_id: str) -> list[JobPart]:
    with sessions() as s:
        got = list(s.scalars(select(JobPart).where(JobPart.job_id == job_id).order_by(JobPart.idx)))
        s.expunge_all()
        return got


def job_row(sessions: sessionmaker[Session], job_id: str) -> Job:
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None
        s.expunge(job)
        return job


def test_fanned_out_job_equals_a_single_run(
    settings: Settings,
    sessions: sessionmaker[Session],
    runner_cfg: RunnerConfig,
    models_dir: Path,
    tmp_path: Path,
) -> None:
    job_id = create_job(sessions, settings, BODY)
    d = Dispatcher()
    out = run_job(sessions, job_id, runner_cfg, worker_id="coord", dispatch=d)
    assert out.status == "fanned_out", out.detail
    (jid, attempt, idxs) = d.sent[0]
    assert jid == job_id and attempt == 1 and idxs == list(range(len(idxs))) and len(idxs) >= 3
    parts = rows(sessions, job_id)
    assert [p.state for p in parts] == ["queued"] * len(idxs)
    assert all(p.enqueued_at is not None for p in parts)
    job = job_row(sessions, job_id)
    assert job.status == "running" and job.stage == "quantizing" and job.progress_total == 14

    # An early assembly (a duplicate chord callback) does nothing.
    assert assemble(sessions, job_id, attempt, runner_cfg, worker_id="early").status == "skipped"
    # Parts run in any order on any worker; duplicates and older attempts are no-ops.
    for i in reversed(idxs):
        assert run_part(sessions, job_id, attempt, i, runner_cfg, f"w{i % 2}").status == "succeeded"
    assert run_part(sessions, job_id, attempt, 0, runner_cfg, "w9").status == "skipped"
    assert run_part(sessions, job_id, attempt + 1, 0, runner_cfg, "w9").status == "skipped"
    job = job_row(sessions, job_id)
    assert (job.progress_done, job.progress_total) == (14, 14)
    # The parts' shards are already where the artifact will be published, under their final
    # names (no artifact row names them yet), each recorded with its bytes and sha256.
    where = settings.artifacts_path / job_id / f"{job_id}.{attempt}.parts"
    stored = {p.relative_to(where).as_posix(): p for p in files_under(where)}
    n = len(idxs)
    assert sorted(stored) == sorted(
        [f"native/model-{i + 1:05d}-of-{n + 1:05d}.safetensors" for i in idxs]
        + [f"dequantized/model-{i + 1:05d}-of-{n:05d}.safetensors" for i in idxs]
    )
    for p in rows(sessions, job_id):
        assert p.output is not None and p.output_uri == where.as_uri()
        for rel, f in p.output["files"].items():
            data = stored[rel].read_bytes()
            assert (len(data), hashlib.sha256(data).hexdigest()) == (f["bytes"], f["sha256"])
    inodes = {rel: p.stat().st_ino for rel, p in stored.items()}
    with sessions() as s:
        assert s.get(Job, job_id).artifacts == []  # type: ignore[union-attr]
    assert assemble(sessions, job_id, attempt, runner_cfg, worker_id="asm").status == "succeeded"
    # The assembly moved no shard (same files) and wrote only the small ones beside them.
    assert {rel: (where / rel).stat().st_ino for rel in stored} == inodes
    assert assemble(sessions, job_id, attempt, runner_cfg, worker_id="asm2").status == "skipped"

    job = job_row(sessions, job_id)
    assert job.status == "succeeded" and job.worker_id == "asm"
    assert {"resolving", "quantizing", "packaging"} <= set(job.stage_durations or {})
    assert job.report is not None
    listed = job.report["metrics"]["parts"]
    assert [p["index"] for p in listed] == idxs
    assert {p["worker_id"] for p in listed} == {"w0", "w1"}
    assert all(p["seconds"] > 0 and p["attempts"] == 1 for p in listed)

    # Every file equals what one in-process run of the same source writes (the engine's
    # run: the same plan, its parts one after the other, assembled).
    single = tmp_path / "single"
    run(QuantizeJob(models_dir / MODEL, _engine_cfg(job)), single)
    want = {k: v for k, v in digests(single).items() if k != "report.json"}
    assert published(sessions, job_id) == want
    assert "native/model.safetensors.index.json" in want
    # Only the published attempt remains (no part outputs), nothing in staging.
    assert [p.name for p in (settings.artifacts_path / job_id).iterdir()] == [
        uri_path(job_row_artifact_uri(sessions, job_id)).parent.name
    ]
    assert files_under(settings.artifacts_path / ".staging") == []


def test_fanned_out_scope_all_job_equals_a_single_run(
    settings: Settings,
    sessions: sessionmaker[Session],
    runner_cfg: RunnerConfig,
    models_dir: Path,
    tmp_path: Path,
) -> None:
    """options.scope "all" over parts: the parts holding the embedding and the head quantize
    them, and the published files are those of one in-process run with the same config."""
    job_id = create_job(sessions, settings, {**BODY, "options": {"scope": "all"}})
    d = Dispatcher()
    assert run_job(sessions, job_id, runner_cfg, dispatch=d).status == "fanned_out"
    (_, attempt, idxs) = d.sent[0]
    assert job_row(sessions, job_id).progress_total == 14 + 2  # linear layers, embedding, head
    for i in idxs:
        assert run_part(sessions, job_id, attempt, i, runner_cfg, "w").status == "succeeded"
    assert assemble(sessions, job_id, attempt, runner_cfg, worker_id="asm").status == "succeeded"
    job = job_row(sessions, job_id)
    assert job.status == "succeeded" and job.report is not None
    assert _engine_cfg(job).scope == "all"
    assert job.report["metrics"]["embedding_layers"] == {
        "model.embed_tokens": "embedding",
        "lm_head": "head",
    }
    single = tmp_path / "single"
    run(QuantizeJob(models_dir / MODEL, _engine_cfg(job)), single)
    want = {k: v for k, v in digests(single).items() if k != "report.json"}
    assert published(sessions, job_id) == want


def test_assembly_fails_when_a_parts_file_is_not_as_recorded(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    """The assembly reads no shard, but checks that each one is in the store with the size its
    part recorded: a truncated file fails the job and nothing is published."""
    job_id, attempt, idxs = _fanned(settings, sessions, runner_cfg)
    for i in idxs:
        assert run_part(sessions, job_id, attempt, i, runner_cfg, "w").status == "succeeded"
    where = settings.artifacts_path / job_id / f"{job_id}.{attempt}.parts"
    victim = sorted(files_under(where / "dequantized"))[1]
    victim.write_bytes(victim.read_bytes()[:-8])
    assert assemble(sessions, job_id, attempt, runner_cfg, "asm").status == "failed"
    job = job_row(sessions, job_id)
    assert job.status == "failed" and job.error_code == "corrupt_checkpoint"
    assert job.error_message is not None and "not the" in job.error_message
    with sessions() as s:
        assert s.get(Job, job_id).artifacts == []  # type: ignore[union-attr]
    assert not (settings.artifacts_path / job_id).exists()


def _engine_cfg(job: Job) -> HiggsConfig:
    from app.jobs.job_config import JobConfig

    return JobConfig.load(job.config).higgs_config()


def job_row_artifact_uri(sessions: sessionmaker[Session], job_id: str) -> str:
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job.artifacts[0].uri


def _fanned(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> tuple[str, int, list[int]]:
    job_id = create_job(sessions, settings, BODY)
    d = Dispatcher()
    assert (
        run_job(sessions, job_id, runner_cfg, worker_id="coord", dispatch=d).status == "fanned_out"
    )
    return d.sent[0]


def test_a_failing_part_fails_the_job_and_cancels_its_siblings(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig, models_dir: Path
) -> None:
    job_id, attempt, _idxs = _fanned(settings, sessions, runner_cfg)
    assert run_part(sessions, job_id, attempt, 0, runner_cfg, "w0").status == "succeeded"
    # Part 1's shard is corrupt on its worker.
    bad_models = settings.data_dir / "bad-models"
    import shutil

    shutil.copytree(models_dir, bad_models)
    shard = rows(sessions, job_id)[1].shards[0]
    (bad_models / MODEL / shard).write_bytes(b"\x00" * 16)
    bad_cfg = dataclasses.replace(runner_cfg, models_dir=bad_models)
    out = run_part(sessions, job_id, attempt, 1, bad_cfg, "w1")
    assert out.status == "failed" and "corrupt_checkpoint" in out.detail
    job = job_row(sessions, job_id)
    assert job.status == "failed" and job.error_code == "corrupt_checkpoint"
    assert job.error_message is not None and job.error_message.startswith(f"part 1 ({shard})")
    states = [p.state for p in rows(sessions, job_id)]
    assert states[:2] == ["done", "failed"] and set(states[2:]) == {"cancelled"}
    assert run_part(sessions, job_id, attempt, 2, runner_cfg, "w2").status == "skipped"
    assert assemble(sessions, job_id, attempt, runner_cfg, "asm").status == "skipped"
    with sessions() as s:
        assert s.get(Job, job_id).artifacts == []  # type: ignore[union-attr]
    assert not (settings.artifacts_path / job_id).exists()  # part 0's output removed too


def test_cancel_in_the_middle_of_a_fanout_publishes_nothing(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    job_id, attempt, _idxs = _fanned(settings, sessions, runner_cfg)
    assert run_part(sessions, job_id, attempt, 0, runner_cfg, "w0").status == "succeeded"
    slow = dataclasses.replace(runner_cfg, debug_layer_delay_s=0.3, progress_min_interval_s=0.0)
    result: list[str] = []
    t = threading.Thread(
        target=lambda: result.append(run_part(sessions, job_id, attempt, 1, slow, "w1").status)
    )
    t.start()
    wait_until(lambda: rows(sessions, job_id)[1].progress_done >= 1, 60, "part 1 under way")
    with sessions() as s:
        state.request_cancel(s, job_id)
    t.join(60)
    assert result == ["cancelled"]
    job = job_row(sessions, job_id)
    assert job.status == "cancelled"
    assert {p.state for p in rows(sessions, job_id)[1:]} == {"cancelled"}
    assert run_part(sessions, job_id, attempt, 2, runner_cfg, "w2").status in (
        "skipped",
        "cancelled",
    )
    assert assemble(sessions, job_id, attempt, runner_cfg, "asm").status in ("skipped", "cancelled")
    assert not (settings.artifacts_path / job_id).exists()
    assert files_under(settings.artifacts_path / ".staging") == []


def test_lost_part_is_requeued_and_the_sweep_is_the_barrier(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    job_id, attempt, idxs = _fanned(settings, sessions, runner_cfg)
    # Part 0 claimed by a worker that then dies (no heartbeats).
    with sessions() as s:
        assert part_state.claim_part(s, job_id, attempt, 0, "dead") is not None
    # A pool process that died: its main process releases the part at once.
    with sessions() as s:
        assert part_state.claim_part(s, job_id, attempt, 1, "pool:1") is not None
    with sessions() as s:
        assert (
            part_state.release_lost_part(s, job_id, attempt, 1, "pool:1", 3, "killed") == "queued"
        )
    sent_parts: list[tuple[str, int, int]] = []
    sent_asm: list[tuple[str, int]] = []

    def send_part(j: str, a: int, i: int) -> bool:
        sent_parts.append((j, a, i))
        return True

    def send_asm(j: str, a: int) -> bool:
        sent_asm.append((j, a))
        return True

    def sweep_now() -> dict[str, list[str]]:
        return sweep_fanout(sessions, settings, send_part, send_asm)

    # The job itself is never judged stale while fanned out; its dead part is.
    import time

    time.sleep(settings.heartbeat_timeout_s + 0.2)
    with sessions() as s:
        stale = state.requeue_stale(s, utcnow(), settings.heartbeat_timeout_s, 3)
    assert job_id not in stale.requeued
    got = sweep_now()
    assert f"{job_id}/0" in got["parts_requeued"] and (job_id, attempt, 0) in sent_parts
    assert rows(sessions, job_id)[0].state == "queued"
    assert rows(sessions, job_id)[1].attempts == 1
    for i in idxs:
        assert run_part(sessions, job_id, attempt, i, runner_cfg, f"w{i}").status == "succeeded"
    assert [p.attempts for p in rows(sessions, job_id)[:2]] == [2, 2]
    # No chord callback came (its host died): the sweep sends the assembly.
    assert sent_asm == []
    sweep_now()
    assert sent_asm == [(job_id, attempt)]  # enqueue_grace_s = 0 in these settings
    assert assemble(sessions, job_id, attempt, runner_cfg, "asm").status == "succeeded"
    assert job_row(sessions, job_id).status == "succeeded"


def test_dynamic_target_fans_out_after_one_profile_and_plan(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """avg_bits: the coordinator profiles and allocates once into the job plan every part
    row carries; the parts run it and the assembly annotates from it (nothing planned
    again); the assembled job equals the same job run on one worker."""
    import higgs_engine.dynamic as engine_dynamic
    from higgs_engine.job import JobPlan
    from tests.fixtures import count_calls

    dyn = settings.model_copy(update={"profile_context": 16, "profile_windows": 1})
    cfg = RunnerConfig.from_settings(dyn, "cpu")
    body = {"model": {"id": MODEL}, "target": {"avg_bits": 3.5}}
    job_id = create_job(sessions, dyn, body)
    d = Dispatcher()
    assert run_job(sessions, job_id, cfg, worker_id="coord", dispatch=d).status == "fanned_out"
    _, attempt, idxs = d.sent[0]
    job = job_row(sessions, job_id)
    assert {"profiling", "allocating"} <= set(job.stage_durations or {})
    part_cfg = rows(sessions, job_id)[0].engine_config
    assert part_cfg["overrides"], "the plan's per-layer grids reach the parts"
    stored = [r.plan for r in rows(sessions, job_id)]
    assert stored[0] is not None and all(p == stored[0] for p in stored)
    plan = JobPlan.from_dict(stored[0])
    assert plan.kind == "dynamic" and plan.config.to_dict() == part_cfg
    assert [p.index for p in plan.parts] == idxs and plan.dynamic is not None
    planned = count_calls(monkeypatch, engine_dynamic, "plan_dynamic")
    for i in idxs:
        assert run_part(sessions, job_id, attempt, i, cfg, f"w{i}").status == "succeeded"
    assert assemble(sessions, job_id, attempt, cfg, "asm").status == "succeeded"
    assert planned == [0], "a part or the assembly planned again"
    fanned = job_row(sessions, job_id)
    assert fanned.status == "succeeded" and fanned.report is not None
    # The same job on one worker (no dispatcher), with the profile the first one stored.
    one = create_job(sessions, dyn, body)
    assert run_job(sessions, one, cfg, worker_id="solo").status == "succeeded"
    solo = job_row(sessions, one)
    assert solo.report is not None
    assert published(sessions, job_id) == published(sessions, one)
    for key in ("allocation", "target", "predicted_ppl_increase"):
        assert fanned.report["metrics"][key] == solo.report["metrics"][key], key
    assert [(r["name"], r["p"], r["n"], r["alpha"]) for r in fanned.report["layers"]] == [
        (r["name"], r["p"], r["n"], r["alpha"]) for r in solo.report["layers"]
    ]


def test_parts_whose_message_was_lost_are_sent_again(
    settings: Settings, sessions: sessionmaker[Session], runner_cfg: RunnerConfig
) -> None:
    job_id, attempt, idxs = _fanned(settings, sessions, runner_cfg)
    with sessions() as s:
        fresh = part_state.sweep_parts(s, utcnow(), 60.0, 3, 60.0, resend_after_s=3600.0)
    assert fresh.unsent == []  # sent just now: only waiting
    with sessions() as s:
        assert part_state.claim_part(s, job_id, attempt, 0, "w0") is not None
    with sessions() as s:
        old = part_state.sweep_parts(s, utcnow(), 60.0, 3, 60.0, resend_after_s=0.0)
    # Sent and still unclaimed past resend_after_s: sent again (the running one is not).
    assert sorted(i for j, _, i in old.unsent if j == job_id) == idxs[1:]
