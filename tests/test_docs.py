"""The README stays a user's document: short, no dated measurement notes in it or in the code (they belong in
CHANGELOG.md and bench/results/), and its CPU-only commands run as written in a copy of the checkout."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.config import PROJECT_ROOT
from tests.conftest import cli_env

README = PROJECT_ROOT / "README.md"
CODE_DIRS = ("tasks", "flows", "deployments")
CODE_SUFFIXES = {".py", ".yaml", ".yml", ".md", ".toml", ".json"}
# what a measurement diary leaves behind: a date, a time of day in UTC, an issue's number or pass
DATED = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"                      # 2026-12-03
                   r"|\b\d{1,2}:\d\d(?:\s*-\s*\d{1,2}:\d\d)? ?UTC\b"   # 21:19-21:27 UTC
                   r"|\b[Ii]ssue \d+\b"                                 # Issue 24
                   r"|\b(?:fourth|fifth|sixth|seventh|eighth|ninth|tenth) pass\b")
RESULT_FILE = re.compile(r"bench/results/\S+")  # code names a reason and a docs section, not a result file
# a fenced block the README marks for this test: `<!-- readme-test: run -->` (a bash script) or
# `<!-- readme-test: file NAME -->` (written to NAME before the next script runs)
MARKED = re.compile(r"<!-- readme-test: (run|file (\S+)) -->\n```[\w-]*\n(.*?)\n```", re.S)


def dated_notes(root: Path) -> list[str]:
    """Every line of root's README and code that carries a dated measurement note, as `path:line: text`."""
    files = [root / "README.md"] + [p for d in CODE_DIRS for p in sorted((root / d).rglob("*"))
                                    if p.suffix in CODE_SUFFIXES and "__pycache__" not in p.parts]
    found = []
    for path in files:
        in_code = path.name != "README.md"
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if DATED.search(line) or (in_code and RESULT_FILE.search(line)):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()[:120]}")
    return found


def readme_steps(text: str) -> list[tuple[str, str | None, str]]:
    """The README's marked blocks in order: ("run", None, script) or ("file", name, content)."""
    return [("file" if name else "run", name or None, body) for _, name, body in MARKED.findall(text)]


def test_the_readme_is_under_350_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines < 350, f"README.md has {lines} lines: move detail to a docs/ page (README: Documentation)"


def test_no_dated_measurement_notes_in_the_readme_or_the_code() -> None:
    notes = dated_notes(PROJECT_ROOT)
    assert not notes, ("dated measurement notes (history goes to CHANGELOG.md, figures to docs/performance.md with "
                       "their bench/results file):\n" + "\n".join(notes))


def test_a_diary_line_is_found() -> None:
    """The pattern catches the notes it is for, and not the project's own words for passes over data."""
    for line in ("measured 2026-12-03 on an H200", "the repeat, 21:19-21:27 UTC", '(bench/README.md, "Issue 24")',
                 "Issue 24, seventh pass"):
        assert DATED.search(line), line
    for line in ("evaluation's first pass over the batches", "a 2-pass merge", "time.strftime('%Y-%m-%d')"):
        assert not DATED.search(line), line


def test_the_readme_marks_its_cpu_only_commands() -> None:
    """The quick start, the nightly config through --config and the serving export are marked for the run below."""
    steps = readme_steps(README.read_text())
    scripts = [body for kind, _, body in steps if kind == "run"]
    assert [body.strip() for body in scripts][0] == "qlora-pipeline run"
    assert ("file", "nightly.yaml") in [(kind, name) for kind, name, _ in steps]
    assert any("--config nightly.yaml" in body for body in scripts)
    assert any("export.gguf" in body and "gguf" in body.splitlines()[-1] for body in scripts)


def _checkout_copy(target: Path) -> Path:
    """The working tree's files as a fresh clone would have them (tracked and new, not ignored ones)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=PROJECT_ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = PROJECT_ROOT / name
        if source.is_file():  # a deleted file is still listed until its deletion is committed
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(source.read_bytes())
    return target


@pytest.mark.slow
def test_the_readme_cpu_commands_run_as_written(tmp_path: Path) -> None:
    """Each marked block of the README, in order, in one copy of the checkout: the quick start's run, the serving
    export with the champion's gguf/ listed, the nightly config through --config (several minutes on 2 cores)."""
    clone = _checkout_copy(tmp_path / "clone")
    env = cli_env(tmp_path / "prefect")
    # the copy's code, not this checkout's editable install; this venv's `qlora-pipeline` and `python`
    env.update(PYTHONPATH=str(clone), PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
    failed = []  # every block runs, so one report names all that fail (a later block may not need an earlier one)
    for index, (kind, name, body) in enumerate(readme_steps(README.read_text())):
        if kind == "file":
            (clone / name).write_text(body + "\n")
            continue
        log = tmp_path / f"step-{index}.log"
        with log.open("w") as out:
            done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", body], cwd=clone, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=1200)
        if done.returncode != 0:
            failed.append(f"README block (exit {done.returncode}):\n{body}\n--- its output, the end:\n"
                          f"{log.read_text()[-2500:]}")
    assert not failed, "\n\n".join(failed)


def test_the_serving_page_marks_the_vllm_command_the_tests_start() -> None:
    """docs/serving.md's server command is the one tests/conftest.py's vllm_server runs as written (its port aside):
    vLLM's own environment, a KV cache that fits a small machine, the base model alone, the stable-name middleware."""
    from tests.conftest import documented_vllm_command

    command = documented_vllm_command(8000)
    for part in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True", "VLLM_CPU_KVCACHE_SPACE=", "-m vllm.entrypoints.openai",
                 "--model data/tiny-llama", "--enable-lora", "--middleware model_aliases.ModelAliases",
                 "PYTHONPATH=$PWD/tasks/export_adapter/vllm_server"):
        assert part in command, part
    assert "--lora-modules" not in command  # it starts before any run: the first run loads the champion
