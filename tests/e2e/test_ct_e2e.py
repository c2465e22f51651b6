"""compressed-tensors through the whole service, with real processes (uvicorn, a Celery worker,
PostgreSQL + Redis): `higgs submit --formats compressed-tensors` for --bits 4 and --avg-bits
ends in a downloadable directory that passed the worker's load check; the downloaded
directory loads in transformers with the reported schemes; what the format cannot take is a
422 naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from devtools.stack import HIGGS
from tests.e2e.test_service_e2e import JOB_TIMEOUT_S, start_separate
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import TINY_TEXT

pytestmark = pytest.mark.slow


def test_ct_jobs_download_directories_transformers_loads(
    stack_factory: Any, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    text = tmp_path / "eval.txt"
    text.write_text(TINY_TEXT * 20)
    stack = stack_factory("redis-postgres")
    stack.env.update(
        {
            "HIGGS_PROFILE_CONTEXT": "16",
            "HIGGS_PROFILE_WINDOWS": "1",
            "HIGGS_PROFILE_DATA_FREE": "random",
            "HIGGS_EVAL_TEXT_FILE": str(text),
            "HIGGS_EVAL_CONTEXT": "32",
            "HIGGS_EVAL_WINDOWS": "2",
        }
    )
    start_separate(stack)
    key = stack.create_key()
    conn = ["--url", stack.url, "--key", key]
    with stack.client(key) as c:
        r = c.post(
            "/v1/jobs",
            json={
                "model": {"id": MODEL},
                "target": {"bits": 3},
                "options": {"formats": ["compressed-tensors"]},
            },
        )
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "target.bits"

    for target, name in ((["--bits", "4", "--evaluate"], "b4"), (["--avg-bits", "6"], "a6")):
        out = tmp_path / name
        res = stack.run(
            [*HIGGS, "submit", MODEL, *target, "--formats", "compressed-tensors", "--wait",
             "--out", str(out), *conn],
            timeout=JOB_TIMEOUT_S,
        )  # fmt: skip
        job_id = res.stdout.strip().splitlines()[-1]
        assert "succeeded" in res.stdout, res.stdout + res.stderr + stack.logs()
        with stack.client(key) as c:
            job = c.get(f"/v1/jobs/{job_id}").json()
            assert [a["format"] for a in job["artifacts"]] == ["compressed-tensors"]
            report = c.get(f"/v1/jobs/{job_id}/report").json()
            layers = c.get(f"/v1/jobs/{job_id}/layers").json()["data"]
        assert report["metrics"]["load_check"]["class"] == "LlamaForCausalLM"
        if name == "b4":
            assert job["summary"]["kl"] is not None and job["summary"]["ppl_quantized"] > 0
        else:
            assert job["summary"]["bits_per_weight"] <= 6.0
            assert {"profiling", "allocating", "quantizing"} <= set(job["stage_durations"])
        # the downloaded directory is the checkpoint the report describes
        cfg = json.loads((out / "config.json").read_text())["quantization_config"]
        assert cfg["quant_method"] == "compressed-tensors"
        kept = set(cfg["ignore"])
        assert kept == {row["name"] for row in layers if row["type"] == "keep"}
        model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor([[5, 6, 7, 8]])).logits).all()
