"""The client verbs' input errors: one line on stderr, a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess

import pytest

from devtools.stack import HIGGS, REPO, free_port


def higgs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HIGGS, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
    )


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (
            ["submit", "tiny", "--bits", "4", "--avg-bits", "3", "--key", "k"],
            2,
            "exactly one target",
        ),
        (["submit", "tiny", "--key", "k"], 2, "exactly one target"),
        (["submit", "tiny", "--bits", "-1", "--key", "k"], 2, "must be positive"),
        (["status", "abc"], 1, "no API key"),
        (["status", "abc", "--key", "k", "--url", "ftp://x"], 1, "must start with http"),
        (["download", "abc", "--key", "k"], 2, "--out"),
    ],
)
def test_bad_input_is_one_line(args: list[str], code: int, needle: str) -> None:
    out = higgs(*args)
    assert out.returncode == code, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert needle in out.stderr and "Traceback" not in out.stderr
    if code == 1:
        assert len(lines) == 1


def test_unreachable_service_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    out = higgs("status", "abc", "--url", url, env={"HIGGS_API_KEY": "k"})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"higgs: error: cannot reach the service at {url}: [Errno 111] Connection refused"
    ]


def test_env_variables_are_used() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    out = higgs("download", "abc", "--out", "/tmp/x", env={"HIGGS_API_KEY": "k", "HIGGS_URL": url})
    assert out.returncode == 1 and url in out.stderr


def test_submit_webhook_url_goes_into_the_request() -> None:
    from higgs_cli.client_cmds import build_request
    from higgs_cli.main import build_parser

    parser = build_parser("submit")
    args = parser.parse_args(
        ["submit", "tiny", "--bits", "4", "--webhook-url", "https://h.example/x"]
    )
    assert build_request(args) == {
        "model": {"id": "tiny"},
        "target": {"bits": 4.0},
        "webhook_url": "https://h.example/x",
    }
    plain = parser.parse_args(["submit", "tiny", "--bits", "4"])
    assert "webhook_url" not in build_request(plain)


def test_submit_gguf_rotate_goes_into_the_options() -> None:
    from higgs_cli.client_cmds import build_request
    from higgs_cli.main import build_parser

    args = build_parser("submit").parse_args(
        ["submit", "tiny", "--avg-bits", "5", "--formats", "gguf", "--gguf-rotate", "auto"]
    )
    assert build_request(args)["options"] == {"formats": ["gguf"], "gguf_rotate": "auto"}
