"""The gguf format end to end on the embedded `higgs serve` (real processes): a client submits
an avg_bits job for a GGUF file with evaluation, the worker converts the checkpoint with
llama.cpp's converter, profiles it (embeddings and head included), allocates llama.cpp's types,
quantizes with llama.cpp and measures the file in llama.cpp; the client downloads it and
llama.cpp runs it."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from devtools.stack import HIGGS
from tests.fixtures import TINY_TEXT, build_gguf_llama

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 240
MODEL = "tiny-gguf"


def test_gguf_job_downloads_a_file_llama_cpp_runs(stack_factory: Any, tmp_path: Path) -> None:
    from higgs_engine.gguf.llama import LlamaModel
    from higgs_engine.gguf.plan import read_gguf

    models = tmp_path / "models"
    build_gguf_llama(models / MODEL)
    text = tmp_path / "eval.txt"
    text.write_text(TINY_TEXT * 20)
    stack = stack_factory("local")
    stack.env.update(
        {
            "HIGGS_MODELS_DIR": str(models),
            "HIGGS_PROFILE_CONTEXT": "16",
            "HIGGS_PROFILE_WINDOWS": "1",
            "HIGGS_PROFILE_DATA_FREE": "random",
            "HIGGS_EVAL_TEXT_FILE": str(text),
            "HIGGS_EVAL_CONTEXT": "32",
            "HIGGS_EVAL_WINDOWS": "2",
        }
    )
    data = stack.data_dir
    serve = stack.start_serve()
    key = stack.create_key(data_dir=data)
    with stack.client(key) as c:
        # two formats with gguf: refused at submit, naming the field
        r = c.post(
            "/v1/jobs",
            json={
                "model": {"id": MODEL},
                "target": {"bits": 4},
                "options": {"formats": ["gguf", "native"]},
            },
        )
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "options.formats"

    out = tmp_path / "downloaded"
    res = stack.run(
        [
            *HIGGS,
            "submit",
            MODEL,
            "--avg-bits",
            "4.5",
            "--formats",
            "gguf",
            "--evaluate",
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
    files = sorted(out.glob("*.gguf"))
    assert "succeeded" in res.stdout and files, res.stdout + res.stderr + stack.logs()

    with stack.client(key) as c:
        job = c.get(f"/v1/jobs/{job_id}").json()
        assert [a["format"] for a in job["artifacts"]] == ["gguf"]
        assert {"converting", "profiling", "measuring", "allocating", "quantizing"} <= set(
            job["stage_durations"]
        )
        s = job["summary"]
        assert s["bits_per_weight"] <= 4.5
        assert s["kl"] is not None and s["ppl_quantized"] > 0
        assert s["predicted_ppl_increase"] is not None
        layers = c.get(f"/v1/jobs/{job_id}/layers").json()["data"]
        assert "token_embd.weight" in {row["name"] for row in layers}
        assert all(row["type"] and row["alpha"] is not None for row in layers)
        report = c.get(f"/v1/jobs/{job_id}/report").json()
        assert report["metrics"]["eval_engine"] == "llama.cpp"

    # a rotated file: options.gguf_rotate goes through the job config to the worker
    out_rot = tmp_path / "rotated"
    res = stack.run(
        [
            *HIGGS, "submit", MODEL, "--bits", "8", "--formats", "gguf", "--gguf-rotate", "on",
            "--wait", "--out", str(out_rot), "--url", stack.url, "--key", key,
        ],
        timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    rot_id = res.stdout.strip().splitlines()[-1]
    assert "succeeded" in res.stdout, res.stdout + res.stderr + stack.logs()
    with stack.client(key) as c:
        job = c.get(f"/v1/jobs/{rot_id}").json()
        assert job["request"]["options"]["gguf_rotate"] == "on"
        assert job["config"]["gguf_rotate"] == "on"
        report = c.get(f"/v1/jobs/{rot_id}/report").json()
        assert report["metrics"]["rotated"] and report["metrics"]["rotation"]["per_head_vo"]

    # the downloaded file holds the reported types and runs in llama.cpp
    written = read_gguf(files, quantized=True)
    assert written.types == {row["name"]: row["type"] for row in layers}
    with LlamaModel(files[0], n_ctx=32) as m:
        logits = m.logits(m.tokenize("The committee met on Tuesday"))
    assert logits.shape[1] == 320 and (logits == logits).all()

    serve.popen.send_signal(signal.SIGTERM)
    assert serve.popen.wait(40) == 0, serve.tail()
