"""The docs as checked facts: README.md links every page under docs/, every link and named path resolves inside the
repository, README stays short and carries CI's test command verbatim, and the CLI commands the docs show run.

No model loads: `prefixkv simulate` commands on the shipped trace slice run for real, with the docs' flags (a
sweep's grid on the slice's first requests only, to stay within seconds); every other `prefixkv ...` command is
parsed by the real CLI parser with its handler replaced, so a renamed flag or subcommand fails here. Commands with
placeholders (FILE, `...`, `a|b`) are checked down to their subcommand.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOC_PAGES = sorted((REPO / "docs").glob("*.md"))
ALL_DOCS = [README, *DOC_PAGES]
TEST_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m pytest -q tests"
MAX_README_LINES = 160

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_DIRS = ("prefixkv/", "scripts/", "tests/", "docs/")
SWEEP_REQUESTS = 40
PLACEHOLDERS = {"FILE", "PATH", "DIR", "BYTES", "URL", "KEY", "N", "...", "NAME|FILE"}


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _prose(text: str) -> str:
    """The Markdown outside fenced code blocks."""
    return FENCE.sub("", text)


def _links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path.read_text())) if not re.match(r"^[a-z]+:", t) and t[0] != "#"]


def _code_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(path.read_text())]


def _commands(path: Path) -> list[str]:
    """Every `prefixkv ...` command in the page's code blocks, continuation lines joined."""
    commands = []
    for _, body in _code_blocks(path):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("prefixkv "):
                commands.append(line)
    return commands


def test_every_docs_page_is_linked_from_readme():
    linked = {(REPO / t.split("#")[0]).resolve() for t in _links(README)}
    missing = [_rel(p) for p in DOC_PAGES if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


@pytest.mark.parametrize("page", ALL_DOCS + [REPO / "docs" / "data" / "README.md"], ids=_rel)
def test_relative_links_resolve_inside_the_repository(page):
    bad = []
    for target in _links(page):
        resolved = (page.parent / target.split("#")[0]).resolve()
        if not resolved.is_relative_to(REPO) or not resolved.exists():
            bad.append(target)
    assert not bad, f"{_rel(page)}: links that do not resolve inside the repository: {bad}"


@pytest.mark.parametrize("page", ALL_DOCS, ids=_rel)
def test_paths_named_in_code_spans_exist(page):
    """`prefixkv/...`, `scripts/...`, `tests/...`, `docs/...` in prose name files or folders of this repository."""
    bad = []
    for span in CODE_SPAN.findall(_prose(page.read_text())):
        if not span.startswith(REPO_DIRS) or any(c in span for c in " <*{"):
            continue
        if not (REPO / span.rstrip("/")).exists():
            bad.append(span)
    assert not bad, f"{_rel(page)} names paths that do not exist: {bad}"


@pytest.mark.parametrize("page", ALL_DOCS + [REPO / "docs" / "data" / "README.md"], ids=_rel)
def test_no_doc_points_outside_the_repository(page):
    assert "../shared" not in page.read_text(), f"{_rel(page)} points at ../shared (outside the repository)"


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}: details go to docs/)"


def _headline_script():
    spec = importlib.util.spec_from_file_location("headline", REPO / "scripts" / "headline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["headline"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_readme_headline_table_is_the_generated_one():
    """README's headline table is exactly what scripts/headline.py computes from the stored results (after a
    change to a result, or to code a row measures, run `python scripts/headline.py --write`)."""
    headline = _headline_script()
    assert headline.readme_table(README.read_text()) == headline.table()


def test_a_headline_figure_follows_its_data(monkeypatch):
    """The check can fail: a stored round behind moves the vLLM row's figure and its verdict."""
    headline = _headline_script()
    before = headline.table()
    load = headline.load

    def one_round_behind(rel):
        data = load(rel)
        if rel.endswith("amd_epyc/2026-12-07/compare_vllm.json"):
            data["summary"][0]["per_round_ratio"] = [0.5, 0.5, 0.5]
        return data

    monkeypatch.setattr(headline, "load", one_round_behind)
    after = headline.table()
    assert after != before and "**0.50x-" in after and "behind: cold TTFT" in after


def test_readme_carries_the_test_command_ci_runs():
    """CI runs the test command from README verbatim: it must stay, byte for byte, a line of a bash block."""
    blocks = [body.splitlines() for lang, body in _code_blocks(README) if lang == "bash"]
    assert any(TEST_COMMAND in lines for lines in blocks)
    assert any("bash scripts/demo.sh" in lines for lines in blocks)


# Runs in one fresh process: each case is `prefixkv` argv and a mode. "run" calls the CLI; "parse" and "help"
# parse with every subcommand's handler replaced by a no-op (nothing loads a model or opens a socket).
_HARNESS = r"""
import argparse, contextlib, io, json, sys
from prefixkv import cli

original = argparse.ArgumentParser.parse_args

def parse_only(self, args=None, namespace=None):
    ns = original(self, args, namespace)
    if hasattr(ns, "func"):
        ns.func = lambda _args: 0
    return ns

results = []
for argv, mode in json.load(sys.stdin):
    out = io.StringIO()
    if mode != "run":
        argparse.ArgumentParser.parse_args = parse_only
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        argparse.ArgumentParser.parse_args = original
    results.append({"argv": argv, "mode": mode, "code": code, "output": out.getvalue()[-2000:]})
print(json.dumps(results))
"""


def _cases(tmp_path: Path) -> list[tuple[list[str], str, str]]:
    """(argv, mode, where) for every command the docs show."""
    cases = []
    for page in ALL_DOCS:
        for command in _commands(page):
            words = shlex.split(command, comments=True)
            while words and words[-1] == "&":
                words.pop()
            argv = words[1:]
            where = f"{_rel(page)}: {command}"
            if any(w in PLACEHOLDERS or "|" in w for w in argv):
                sub = []
                for w in argv:
                    if w.startswith("-") or w in PLACEHOLDERS:
                        break
                    sub.append(w)
                cases.append(([*sub, "--help"], "help", where))
            elif argv[:1] == ["simulate"] and "docs/data/mooncake_slice.jsonl" in argv:
                out = tmp_path / f"sim{len(cases)}"
                run = [*argv, "--output-dir", str(out), "--quiet", "--no-plot"]
                if argv[1:2] == ["sweep"]:  # a grid of dozens of runs: each cell on the slice's first requests
                    run += ["--max-requests", str(SWEEP_REQUESTS)]
                cases.append((run, "run", where))
            else:
                cases.append((argv, "parse", where))
    return cases


def test_cli_commands_in_the_docs_run(tmp_path):
    cases = _cases(tmp_path)
    assert any(mode == "run" for _, mode, _ in cases), "no doc runs `prefixkv simulate` on the shipped slice"
    proc = subprocess.run(
        [sys.executable, "-c", _HARNESS],
        input=json.dumps([[argv, mode] for argv, mode, _ in cases]),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = [
        f"{where}\n  exit {r['code']}: {r['output'][-600:]}"
        for (_, _, where), r in zip(cases, results)
        if r["code"] != 0
    ]
    assert not failed, "doc commands that fail:\n" + "\n".join(failed)
    for argv, mode, where in cases:
        if mode == "run":
            out = Path(argv[len(argv) - 1 - argv[::-1].index("--output-dir") + 1])
            assert list(out.glob("*.json")), f"{where}: wrote no results"
