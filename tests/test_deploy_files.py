"""No Docker engine runs here, so the deployment files are checked for what can be checked:
docker-compose.yml parses, every command it names exists in the package and starts (help /
import / a real migration), every HIGGS_* variable is a setting, the Dockerfile has the stages
and files the compose file relies on, and the worker reserves a GPU. The images install the
pyproject extras (`api`, `worker`) as a wheel, never an editable install or a copied list of
requirements; the worker's torch is the tested version; the extras cover what each package
imports, and the API's needs no torch."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.import_graph import imported_modules

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def _stages() -> dict[str, str]:
    """Dockerfile stage name -> the CMD of that stage (JSON form), '' when none."""
    stages: dict[str, str] = {}
    current = None
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"^FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = m.group(1)
            stages[current] = ""
        elif current and line.startswith("CMD "):
            stages[current] = line[4:].strip()
    return stages


def test_compose_has_the_production_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"api", "worker", "redis", "postgres", "migrate"} <= set(services)
    for name, svc in services.items():
        for dep in svc.get("depends_on") or {}:
            assert dep in services, f"{name} depends on unknown service {dep}"
    assert services["migrate"]["restart"] == "no"
    assert services["api"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices)


def test_build_targets_exist_in_the_dockerfile(compose: dict[str, Any]) -> None:
    stages = _stages()
    for name, svc in compose["services"].items():
        if "build" in svc:
            assert svc["build"]["target"] in stages, f"{name}: no stage {svc['build']['target']!r}"
    # The API image is light: torch is installed only in the worker stage.
    text = DOCKERFILE.read_text()
    api_part = text.split("AS api", 1)[1].split("AS worker", 1)[0]
    worker_part = text.split("AS worker", 1)[1]
    assert "torch" not in re.sub(r"#.*", "", api_part)
    assert "torch==" in worker_part


def test_dockerfile_copies_files_that_exist() -> None:
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), (
                    f"Dockerfile copies {src}, which is not in the repository"
                )


def test_every_higgs_variable_is_a_setting(compose: dict[str, Any]) -> None:
    from app.settings import Settings

    fields = set(Settings.model_fields)
    env = compose["x-higgs-env"]
    for name, svc in compose["services"].items():
        for var in svc.get("environment") or {}:
            if var.startswith("HIGGS_"):
                assert var[len("HIGGS_") :].lower() in fields, (
                    f"{name}: {var} is not a Settings field"
                )
    for var in env:
        if var.startswith("HIGGS_"):
            assert var[len("HIGGS_") :].lower() in fields, f"{var} is not a Settings field"
    # The values build valid settings (URLs of the production shape).
    s = Settings(
        **{k[len("HIGGS_") :].lower(): v for k, v in env.items() if k.startswith("HIGGS_") and v}
    )
    assert s.database_url.startswith("postgresql+psycopg://") and s.broker_url.startswith(
        "redis://"
    )


def _commands(compose: dict[str, Any]) -> list[list[str]]:
    cmds = [svc["command"] for svc in compose["services"].values() if "build" in svc]
    cmds += [__import__("json").loads(c) for c in _stages().values() if c]
    return cmds


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, **kw)


def test_every_command_exists_and_starts(compose: dict[str, Any], tmp_path: Path) -> None:
    seen = set()
    for cmd in _commands(compose):
        assert isinstance(cmd, list), f"use the exec form for commands: {cmd!r}"
        prog = cmd[0]
        seen.add(prog)
        if prog == "uvicorn":
            target = cmd[1]
            module, attr = target.split(":")
            obj = getattr(importlib.import_module(module), attr)
            assert "--factory" in cmd and callable(obj)
            from fastapi import FastAPI

            from app.settings import Settings

            assert isinstance(obj(Settings(data_dir=tmp_path / "api")), FastAPI)
        elif prog == "celery":
            assert cmd[1:3] == ["-A", "worker.celery_app"] and cmd[3] == "worker"
            out = _run([sys.executable, "-m", "celery", *cmd[1:4], "--help"])
            assert out.returncode == 0, out.stderr
            from worker.celery_app import app

            app.loader.import_default_modules()  # what the worker does at start (include=)
            assert {"higgs.run_job", "higgs.sweep"} <= set(app.tasks)
            queues = cmd[cmd.index("-Q") + 1].split(",")
            assert {q.name for q in app.conf.task_queues} >= set(queues)
        elif prog == "alembic":
            assert cmd[1:] == ["upgrade", "head"]
            # A real migration, with the same command, on a throwaway SQLite file.
            env = {**__import__("os").environ, "HIGGS_DATA_DIR": str(tmp_path / "mig")}
            env.pop("HIGGS_DATABASE_URL", None)
            out = _run([sys.executable, "-m", "alembic", *cmd[1:]], env=env)
            assert out.returncode == 0, out.stderr
            assert (tmp_path / "mig" / "higgs.db").is_file()
        elif prog in ("redis-server", "pg_isready", "redis-cli", "python"):
            continue  # belong to the public images / the interpreter
        elif prog == "higgs":
            out = _run(
                [
                    sys.executable,
                    "-c",
                    "from higgs_cli.main import main; raise SystemExit(main())",
                    *cmd[1:2],
                    "--help",
                ]
            )
            assert out.returncode == 0, out.stderr
        else:
            raise AssertionError(f"unknown command {prog!r} in docker-compose.yml / Dockerfile")
    assert {"uvicorn", "celery", "alembic"} <= seen


def test_higgs_serve_exists() -> None:
    out = _run(
        [
            sys.executable,
            "-c",
            "from higgs_cli.main import main; raise SystemExit(main())",
            "serve",
            "--help",
        ]
    )
    assert out.returncode == 0 and "--data-dir" in out.stdout, out.stderr


# ---------------------------------------------------------------- images, extras and versions

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
# Import name -> distribution, for the imports whose distribution is named otherwise or comes
# with another one (starlette and anyio with fastapi, kombu and billiard with celery).
PROVIDED_BY = {
    "starlette": "fastapi",
    "anyio": "fastapi",
    "kombu": "celery",
    "billiard": "celery",
    "pydantic_settings": "pydantic-settings",
    "prometheus_client": "prometheus-client",
    "psycopg": "psycopg",
    "huggingface_hub": "huggingface_hub",
    "botocore": "boto3",
    "llama_cpp": "llama-cpp-python",
    "compressed_tensors": "compressed-tensors",
}
OWN = {"app", "worker", "higgs_engine", "higgs_cli", "migrations"}


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _closure(*extras: str) -> set[str]:
    """Distribution names an install of the base plus these extras brings (self-references
    such as worker = higgs-service[api,engine] expanded)."""
    names = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    todo = list(extras)
    while todo:
        for req in EXTRAS[todo.pop()]:
            if _name(req) == "higgs-service":
                todo += re.findall(r"[\w-]+", req.split("[", 1)[1])
            else:
                names.add(_name(req))
    return names


def _third_party_imports(package: str) -> set[str]:
    found: set[str] = set()
    for path in (REPO / package).rglob("*.py"):
        found |= {module.split(".")[0] for _, module in imported_modules(path)}
    return {m for m in found if m not in sys.stdlib_module_names and m not in OWN}


def _pip_installs(stage: str) -> list[str]:
    """The `pip install` commands of one Dockerfile stage (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    part = re.split(r"^FROM\s+\S+\s+AS\s+", text, flags=re.M | re.I)
    body = next(p for p in part if p.split(None, 1)[0] == stage)
    return [m.strip() for m in re.findall(r"pip install ([^&\n]+)", re.sub(r"#.*", "", body))]


@pytest.mark.parametrize(
    ("package", "extras"),
    # higgs_engine.gguf imports llama_cpp lazily (the `gguf` extra), higgs_engine.ct
    # compressed_tensors (the `compressed-tensors` extra)
    [
        ("app", ("api",)),
        ("worker", ("worker",)),
        ("higgs_engine", ("engine", "gguf", "compressed-tensors")),
    ],
)
def test_extras_cover_what_each_package_imports(package: str, extras: tuple[str, ...]) -> None:
    have = _closure(*extras)
    missing = {
        m
        for m in _third_party_imports(package)
        if PROVIDED_BY.get(m, m).lower().replace("_", "-") not in have
    }
    assert missing == set(), (
        f"{package} imports {sorted(missing)}, which the {extras} extras do not install"
    )


def test_api_extra_has_no_torch() -> None:
    heavy = {"torch", "transformers", "safetensors", "gguf", "sentencepiece"}
    assert _closure("api") & heavy == set()
    assert heavy <= _closure("worker")


def test_images_install_the_extras_as_a_wheel() -> None:
    text = re.sub(r"#.*", "", DOCKERFILE.read_text())
    assert not re.search(r"pip install[^\n]*(\s-e\s|--editable)", text), (
        "an editable install in an image"
    )
    api, worker = _pip_installs("api"), _pip_installs("worker")
    assert any('"higgs-service[api]"' in cmd for cmd in api), api
    assert any('"higgs-service[worker]"' in cmd for cmd in worker), worker
    # No hand-copied requirement lists: only the project (with an extra) and torch are named.
    for cmd in api + worker:
        for arg in re.findall(r'"([^"]+)"', cmd):
            assert arg.startswith(("higgs-service[", "torch==", "$")), (
                f"Dockerfile installs {arg!r} by hand"
            )


def test_worker_image_torch_is_the_tested_version() -> None:
    setup = (REPO / "scripts" / "setup").read_text()
    tested = re.search(r"TORCH_SPEC=\$\{TORCH_SPEC:-torch==([0-9.]+)\}", setup)
    image = re.search(r"^ARG TORCH_VERSION=([0-9.]+)$", DOCKERFILE.read_text(), flags=re.M)
    assert tested and image, "TORCH_SPEC default in scripts/setup or ARG TORCH_VERSION not found"
    assert image.group(1) == tested.group(1)
    import torch

    assert torch.__version__.split("+")[0] == tested.group(1), "the tests run with another torch"


def test_transformers_floor_has_the_dtype_keyword() -> None:
    floor = next(r for r in EXTRAS["engine"] if _name(r) == "transformers")
    m = re.search(r">=([0-9.]+)", floor)
    assert m, floor
    version = tuple(int(x) for x in m.group(1).split("."))
    # 4.56.0 is the first release whose from_pretrained/_from_config read `dtype=`.
    assert version >= (4, 56)


# ---------------------------------------------------------------- the lock (requirements.lock)

LOCK = REPO / "requirements.lock"


def _lock_pins() -> dict[str, str]:
    """Distribution name (normalised) -> pinned version, from requirements.lock."""
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line)
            assert m, f"requirements.lock: not an exact pin: {line!r}"
            pins[_name(m.group(1)).replace(".", "-")] = m.group(2)
    return pins


def test_lock_pins_every_dependency_pyproject_names() -> None:
    from packaging.requirements import Requirement

    pins = _lock_pins()
    named = list(PYPROJECT["project"]["dependencies"])
    for reqs in EXTRAS.values():
        named += [r for r in reqs if _name(r) != "higgs-service"]
    for text in named:
        req = Requirement(text)
        key = _name(req.name)
        assert key in pins, f"requirements.lock has no pin for {req.name} (pyproject: {text!r})"
        assert req.specifier.contains(pins[key], prereleases=True), (
            f"requirements.lock pins {req.name}=={pins[key]}, outside pyproject's {text!r}"
        )


def test_lock_torch_is_the_tested_version_and_no_cuda_wheels() -> None:
    pins = _lock_pins()
    setup = (REPO / "scripts" / "setup").read_text()
    tested = re.search(r"TORCH_SPEC=\$\{TORCH_SPEC:-torch==([0-9.]+)\}", setup)
    assert tested, "TORCH_SPEC default in scripts/setup not found"
    # `torch==X` without a local version: both the CPU and the CUDA build satisfy it.
    assert pins["torch"] == tested.group(1)
    cuda = sorted(n for n in pins if n.startswith(("nvidia-", "triton", "cuda-")))
    assert cuda == [], f"requirements.lock pulls CUDA packages: {cuda}"
    llama = re.search(r"^V=\$\{LLAMA_CPP_VERSION:-([0-9.]+)\}", _script("install_llama_cpp"), re.M)
    assert llama and pins["llama-cpp-python"] == llama.group(1)


def test_lock_is_reproducible_text() -> None:
    # scripts/lock's output names no temporary or local path (a rerun changes nothing).
    text = LOCK.read_text()
    assert "/tmp" not in text and "file://" not in text and str(REPO) not in text
    assert text.startswith("# This file was autogenerated by uv") and "scripts/lock" in text


def _script(name: str) -> str:
    return (REPO / "scripts" / name).read_text()


def test_setup_installs_torch_first_then_the_lock_then_the_project_alone() -> None:
    lines = [ln for ln in _script("setup").splitlines() if not ln.lstrip().startswith("#")]
    text = "\n".join(lines)
    torch_at = text.index('pip install -q "${torch_args[@]}"')
    llama_at = text.index("./scripts/install_llama_cpp")
    lock_at = text.index("pip install -q -r requirements.lock")
    project_at = text.index("pip install -q --no-deps -e .")
    assert torch_at < llama_at < lock_at < project_at
    # Nothing else resolves dependencies of its own (only the lock's versions get in).
    assert not re.search(r'pip install[^\n]*"\.\[', text), "setup installs the extras unlocked"


def test_images_take_the_lock_as_constraints() -> None:
    for stage in ("api", "worker"):
        cmds = [c for c in _pip_installs(stage) if "higgs-service[" in c]
        assert cmds and all("-c /tmp/requirements.lock" in c for c in cmds), (stage, cmds)
    assert "COPY requirements.lock /tmp/requirements.lock" in DOCKERFILE.read_text()


def test_the_environment_is_the_locked_set() -> None:
    """The tests run with the versions the lock names (scripts/setup installs them)."""
    from importlib.metadata import PackageNotFoundError, version

    wrong = {}
    for name, pinned in _lock_pins().items():
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "missing"
        if have.split("+")[0] != pinned:
            wrong[name] = f"lock {pinned}, installed {have}"
    assert wrong == {}, f"the environment differs from requirements.lock: {wrong}"
