"""The documentation stays true and self-contained: the settings tables of docs/settings.md list
exactly the service's settings, the README links the reference pages and keeps the test command
CI runs, relative links in the README and docs/ resolve, and nothing in the repository points at
design notes outside it."""

from __future__ import annotations

import os
import re
from pathlib import Path

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]


SETTINGS_DOC = ROOT / "docs" / "settings.md"


def settings_table_variables(text: str) -> list[str]:
    """The variable of every settings table row (`| `HIGGS_X` | default | what |`), in order,
    repeats included."""
    return re.findall(r"^\| `(HIGGS_[A-Z0-9_]+)` \|", text, flags=re.MULTILINE)


def test_settings_doc_lists_every_setting_once() -> None:
    rows = settings_table_variables(SETTINGS_DOC.read_text())
    documented = set(rows)
    fields = {f"HIGGS_{name.upper()}" for name in Settings.model_fields}
    assert sorted(fields - documented) == [], "settings missing from docs/settings.md"
    assert sorted(documented - fields) == [], "docs/settings.md rows that are no setting"
    assert sorted(v for v in documented if rows.count(v) > 1) == [], "settings with two rows"


def test_settings_table_parser_sees_rows() -> None:
    text = (
        "## Store\n\n| variable | default |\n|---|---|\n| `HIGGS_A_B` | `1` |\n\n"
        "Prose naming `HIGGS_C`.\n\n## Next\n\n| `HIGGS_D` | unset |\n| `HIGGS_A_B` | `2` |\n"
    )
    assert settings_table_variables(text) == ["HIGGS_A_B", "HIGGS_D", "HIGGS_A_B"]


def test_readme_links_the_reference_pages_and_keeps_no_settings_table() -> None:
    readme = (ROOT / "README.md").read_text()
    pages = ("settings", "benchmarks", "api", "cli", "architecture", "algorithm")
    for page in (f"docs/{name}.md" for name in pages):
        assert f"]({page}" in readme, page
    assert settings_table_variables(readme) == [], "the settings table lives in docs/settings.md"


def test_readme_gives_the_test_command_ci_runs() -> None:
    # .ci/run runs the README's test command; both must name the same one.
    command = re.findall(r"^exec (\S+)$", (ROOT / ".ci" / "run").read_text(), flags=re.MULTILINE)
    assert command == ["./scripts/test"]
    assert re.search(r"^\./scripts/test +#", (ROOT / "README.md").read_text(), flags=re.MULTILINE)


def test_relative_links_resolve() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_docs_exist() -> None:
    for name in ("api.md", "algorithm.md", "architecture.md", "settings.md", "benchmarks.md"):
        assert (ROOT / "docs" / name).stat().st_size > 1000, name


SKIP_DIRS = {
    ".git",
    ".venv",
    ".bench-venvs",
    "data",
    "node_modules",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
    "build",
    "dist",
}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".ini", ".cfg", ".sh", ""}


def repository_text_files() -> list[Path]:
    """Source and documentation files of the checkout (no git needed), without environments,
    data, caches, build metadata (*.egg-info, written by an editable install) or benchmark
    outputs. Skipped folders are not entered at all."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        rel = Path(folder).relative_to(ROOT)
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIP_DIRS
            and not d.startswith(".pytest")
            and not d.endswith(".egg-info")
            and not (rel.parts[:1] == ("benchmarks",) and d == "results")
            and not Path(folder, d).is_symlink()
        )
        for name in sorted(files):
            path = Path(folder, name)
            if path.suffix in TEXT_SUFFIXES and not path.is_symlink():
                out.append(path)
    return out


def test_nothing_points_outside_the_repository() -> None:
    pattern = re.compile(r"\.\./shared|shared/design|\b(API|ALGORITHM|ARCHITECTURE|STYLE)\.md\b")
    hits = []
    for path in repository_text_files():
        if path == Path(__file__).resolve():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert hits == []


def test_file_walk_sees_the_sources() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in repository_text_files()}
    assert {"README.md", "docs/api.md", "scripts/setup", "app/settings.py", "Dockerfile"} <= names


def test_no_wording_about_how_the_project_was_built() -> None:
    pattern = re.compile(r"\bthe issue\b|\bissue \d|reference figures|\blent\b", re.IGNORECASE)
    hits = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}"
        for path in repository_text_files()
        if path != Path(__file__).resolve()
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []


def _documented_routes(api_md: str) -> set[tuple[str, str]]:
    """(METHOD, path with every parameter written {}) of each backticked `METHOD[|METHOD] /path`
    in docs/api.md (a query string after ? is not part of the path)."""
    out = set()
    for methods, path in re.findall(r"`((?:[A-Z]+\|)*[A-Z]+) (/[^`?\s]*)", api_md):
        for m in methods.split("|"):
            out.add((m, re.sub(r"\{[^}]*\}", "{}", path)))
    return out


def test_every_api_route_has_a_section_in_the_api_docs(tmp_path: Path) -> None:
    from app.main import create_app

    app = create_app(
        Settings(database_url=f"sqlite:///{tmp_path}/db.sqlite", data_dir=tmp_path / "data")
    )
    documented = _documented_routes((ROOT / "docs" / "api.md").read_text())
    routes = {
        (method.upper(), re.sub(r"\{[^}]*\}", "{}", path))
        for path, ops in app.openapi()["paths"].items()
        for method in ops
        if method in {"get", "post", "put", "patch", "delete", "head"}
    }
    assert len(routes) > 10
    assert sorted(routes - documented) == []


def test_documented_routes_parser_reads_method_lists() -> None:
    got = _documented_routes("- `GET|HEAD /v1/x/{id}/files/{path}`: one; `POST /v1/y?a=1`")
    assert got == {("GET", "/v1/x/{}/files/{}"), ("HEAD", "/v1/x/{}/files/{}"), ("POST", "/v1/y")}
