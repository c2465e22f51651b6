"""`higgs quantize` / `higgs eval` run as subprocesses: outputs, JSON, and one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HIGGS = [sys.executable, "-m", "higgs_cli.main"]
ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HIGGS, *args], capture_output=True, text=True, timeout=600, cwd=cwd or ROOT
    )


def assert_one_line_error(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("higgs: error: "), res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def cli_out(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("cli") / "q"
    res = run("quantize", str(llama_ckpt), "--out", str(out), "--bits", "4.5", "--json")
    assert res.returncode == 0, res.stderr
    return out, json.loads(res.stdout)


def test_quantize_json(cli_out: tuple[Path, dict]) -> None:
    out, rep = cli_out
    assert rep["config"]["p"] == 2 and rep["config"]["n"] == 512  # --bits 4.5
    # 4.5 code bits + one fp16 scale per 64- or 32-wide block of these narrow layers (16/64 or
    # 32/96 bits) + the 4 KB grid over 61440 weights
    assert 4.5 + 16 / 64 < rep["bits_per_weight"] < 4.5 + 32 / 96 + 8 * 4096 / 61440 + 1e-6
    assert sorted(p.name for p in out.iterdir()) == ["dequantized", "native", "report.json"]
    assert json.loads((out / "report.json").read_text()) == rep


def test_quantize_human_summary_and_options(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    res = run(
        "quantize",
        str(llama_ckpt),
        "--out",
        str(out),
        "--p",
        "1",
        "--n",
        "16",
        "--group-size",
        "64",
        "--rotation-block",
        "64",
        "--format",
        "native",
        "--skip",
        "*.k_proj",
        "*.v_proj",
    )
    assert res.returncode == 0, res.stderr
    assert "bits per weight" in res.stdout and "p=1 n=16" in res.stdout
    rep = json.loads((out / "report.json").read_text())
    assert rep["formats"] == ["native"] and not (out / "dequantized").exists()
    assert rep["config"]["group_size"] == 64 and rep["config"]["rotation_block"] == 64
    kept = {r["name"] for r in rep["layers"] if r["p"] == 0}
    assert kept == {
        f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("k_proj", "v_proj")
    }
    # The defaults: signs with seed 0 and the MSE-searched unbiased scale.
    assert (rep["config"]["sign_seed"], rep["config"]["scale_rule"]) == (0, "mse-unbiased")


# slow: four `higgs` processes
@pytest.mark.slow
def test_quantize_sign_seed_none_and_scale_rule(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "plain"
    args = ["--p", "1", "--n", "16", "--format", "native", "--json"]
    res = run(
        "quantize",
        str(llama_ckpt),
        "--out",
        str(out),
        *args,
        "--sign-seed",
        "none",
        "--scale-rule",
        "rms",
    )
    assert res.returncode == 0, res.stderr
    cfg = json.loads(res.stdout)["config"]
    assert (cfg["sign_seed"], cfg["scale_rule"]) == (None, "rms")
    for bad, why in (("--sign-seed", "-3"), ("--sign-seed", "x"), ("--scale-rule", "median")):
        res = run("quantize", str(llama_ckpt), "--out", str(tmp_path / "bad"), bad, why)
        assert res.returncode != 0 and why in res.stderr and not (tmp_path / "bad").exists()


def test_eval_json_with_and_without_base(
    cli_out: tuple[Path, dict], llama_ckpt: Path, tiny_text_file: Path
) -> None:
    out, _ = cli_out
    res = run(
        "eval",
        str(out),
        "--text",
        str(tiny_text_file),
        "--base",
        str(llama_ckpt),
        "--context",
        "32",
        "--windows",
        "3",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert set(got) == {"ppl", "kl", "tokens"} and got["tokens"] == 3 * 31
    assert got["ppl"] > 1 and got["kl"] > 0
    res = run(
        "eval",
        str(llama_ckpt),
        "--text",
        str(tiny_text_file),
        "--context",
        "32",
        "--windows",
        "3",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    base = json.loads(res.stdout)
    assert base["kl"] is None and base["tokens"] == got["tokens"] and base["ppl"] != got["ppl"]


# slow: nine `higgs` processes (a minute)
@pytest.mark.slow
def test_bad_inputs_get_one_line_errors(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert_one_line_error(
        run("quantize", str(tmp_path / "nope"), "--out", str(out)), "does not exist"
    )
    assert_one_line_error(
        run("quantize", str(llama_ckpt), "--out", str(out), "--bits", "0.5"), "bits=0.5"
    )
    assert_one_line_error(
        run("quantize", str(llama_ckpt), "--out", str(out), "--p", "3", "--n", "8"), "p=3"
    )
    assert_one_line_error(
        run("quantize", str(llama_ckpt), "--out", str(out), "--format", "onnx"), "formats"
    )
    # a byte-level BPE tokenizer llama.cpp's converter has no pre-tokenizer entry for
    assert_one_line_error(
        run("quantize", str(llama_ckpt), "--out", str(out), "--format", "gguf"),
        "does not support",
        "pre-tokenizer",
    )
    assert_one_line_error(
        run("quantize", str(llama_ckpt), "--out", str(out), "--format", "gguf,native"), "gguf"
    )
    assert_one_line_error(
        run("quantize", str(llama_ckpt), "--out", str(out), "--device", "tpu"), "'tpu'"
    )
    assert not out.exists()

    alien = tmp_path / "alien"
    shutil.copytree(llama_ckpt, alien)
    cfg = json.loads((alien / "config.json").read_text())
    cfg["model_type"] = "no-such-architecture"
    (alien / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run("quantize", str(alien), "--out", str(out)), "no-such-architecture")

    corrupt = tmp_path / "corrupt"
    shutil.copytree(llama_ckpt, corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(run("quantize", str(corrupt), "--out", str(out)), "model.safetensors")
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alien", "corrupt"]  # no temp dirs


# slow: five `higgs` processes
@pytest.mark.slow
def test_existing_output_and_bad_eval_inputs(cli_out: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = cli_out
    before = (out / "report.json").read_bytes()
    assert_one_line_error(run("quantize", str(out / "native"), "--out", str(out)), "already exists")
    assert (out / "report.json").read_bytes() == before

    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 8)
    assert_one_line_error(run("eval", str(out), "--text", str(blob)), "not a UTF-8 text file")
    assert_one_line_error(
        run("eval", str(out), "--text", str(tmp_path / "none.txt")), "does not exist"
    )
    txt = tmp_path / "t.txt"
    txt.write_text("hello world")
    assert_one_line_error(
        run("eval", str(tmp_path / "nomodel"), "--text", str(txt)), "does not exist"
    )
    assert_one_line_error(
        run("eval", str(out), "--text", str(txt), "--context", "64"), "fewer than one window"
    )


def test_top_level_help_is_light() -> None:
    code = (
        "import sys; from higgs_cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'help imported torch'\n"
        "try:\n    main(['quantize', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'quantize --help imported torch'\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr
    assert "quantize" in res.stdout and "--rotation-block" in res.stdout


# slow: three `higgs` processes
@pytest.mark.slow
def test_quantize_scope_all_and_its_gguf_rule(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    res = run(
        "quantize", str(llama_ckpt), "--out", str(out), "--bits", "3", "--scope", "all",
        "--format", "native", "--quiet",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "(token embedding / head: model.embed_tokens, lm_head)" in res.stdout
    rep = json.loads((out / "report.json").read_text())
    assert rep["config"]["scope"] == "all"
    assert {r["name"] for r in rep["layers"]} >= {"model.embed_tokens", "lm_head"}
    bad = run("quantize", str(llama_ckpt), "--out", str(tmp_path / "g"), "--format", "gguf",
              "--bits", "4", "--scope", "linear")  # fmt: skip
    assert_one_line_error(bad, "--scope linear", "gguf")
    bad = run("quantize", str(llama_ckpt), "--out", str(tmp_path / "x"), "--scope", "some")
    assert bad.returncode == 2 and "--scope" in bad.stderr
