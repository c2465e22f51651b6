"""Dynamic HIGGS end to end on the embedded `higgs serve` (real processes): the client submits
an avg_bits job with --wait, the worker profiles the model (data-free, a tiny token budget set
through the environment), allocates and quantizes; then the layers, the report and a plan
from the profile the job stored."""

from __future__ import annotations

import math
import signal
from pathlib import Path
from typing import Any

import pytest

from devtools.stack import HIGGS
from tests.fixtures import TINY_MODEL as MODEL

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 150


def test_avg_bits_job_and_plan_on_the_embedded_default(stack_factory: Any, tmp_path: Path) -> None:
    stack = stack_factory("local")
    stack.env.update({"HIGGS_PROFILE_CONTEXT": "16", "HIGGS_PROFILE_WINDOWS": "1"})
    data = stack.data_dir
    serve = stack.start_serve()
    key = stack.create_key(data_dir=data)

    with stack.client(key) as c:
        r = c.post("/v1/plans", json={"model": {"id": MODEL}, "target": {"avg_bits": 3.5}})
        assert r.status_code == 404 and r.json()["code"] == "no_profile", r.text

    out = tmp_path / "submitted"
    res = stack.run(
        [
            *HIGGS,
            "submit",
            MODEL,
            "--avg-bits",
            "3.5",
            "--wait",
            "--out",
            str(out),
            "--url",
            stack.url,
            "--key",
            key,
        ],
        timeout=JOB_TIMEOUT_S,
    )
    job_id = res.stdout.strip().splitlines()[-1]
    assert "succeeded" in res.stdout and (out / "config.json").is_file(), (
        res.stdout + res.stderr + stack.logs()
    )

    with stack.client(key) as c:
        job = c.get(f"/v1/jobs/{job_id}").json()
        assert {"profiling", "allocating", "quantizing"} <= set(job["stage_durations"])
        assert job["summary"]["bits_per_weight"] <= 3.5
        layers = c.get(f"/v1/jobs/{job_id}/layers").json()["data"]
        assert layers and all(row["alpha"] is not None for row in layers)
        assert len({(row["p"], row["n"]) for row in layers}) >= 2
        report = c.get(f"/v1/jobs/{job_id}/report").json()
        m = report["metrics"]
        pred = math.fsum(row["alpha"] * row["rel_error"] for row in layers)
        assert m["predicted_kl"] == pytest.approx(pred, rel=1e-9)
        assert job["summary"]["predicted_ppl_increase"] == pytest.approx(math.expm1(pred), rel=1e-9)
        assert "exp(KL) - 1" in m["conversion"]

        plan = c.post("/v1/plans", json={"model": {"id": MODEL}, "target": {"avg_bits": 3.5}})
        assert plan.status_code == 200, plan.text
        got = {row["name"]: (row["p"], row["n"]) for row in plan.json()["allocation"]["layers"]}
        assert got == {row["name"]: (row["p"], row["n"]) for row in layers}

    serve.popen.send_signal(signal.SIGTERM)
    assert serve.popen.wait(40) == 0, serve.tail()
