"""The docs name real code: README.md, docs/*.md and the READMEs in the tree
checked against the code.

- every `path/to/file.py` `Qualified.name` pair (the syntax of the request walk
  in docs/architecture.md) names a file that exists and a function, class,
  method or module-level name defined in it (read with `ast`, nothing imported);
- every `tests/...py::test_name` names a test that exists;
- every repository path in inline code and every relative link exists, and a
  link to a heading (`file.md#heading`) names a heading of that file;
- no absolute machine path (/tmp/, /work/, /root/, /home/);
- every `make X` in code names a target of the Makefile;
- every `specserve SUBCOMMAND --flag` in code names a subcommand (or a nested
  one, `specserve bench dataplane`) and its flags as the CLI's parser defines them.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "cluster" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "specserve").rglob("README.md"))]

PAIR = re.compile(r"`((?:[\w.-]+/)*[\w.-]+\.py)`\s+`([A-Za-z_][\w.]*)`")
TEST_REF = re.compile(r"`(tests/[\w/.-]+\.py)::(\w+)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
REPO_DIRS = ("specserve", "deployments", "tests", "cluster", "helm", "proto", "scripts", "docs")
REPO_PATH = re.compile(rf"^(?:{'|'.join(REPO_DIRS)})/[\w./-]*$")
MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(?:tmp|work|root|home)/")
MAKE = re.compile(r"(?<![\w-])make ([A-Za-z][\w-]*)")
COMMAND = re.compile(r"^\s*(?:[\w./-]*/)?specserve ([a-z]+)\b(.*)$")
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def _rel(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _children(node) -> dict[str, ast.AST]:
    """Names defined directly in a module, class or function body (through if/try)."""
    out: dict[str, ast.AST] = {}
    stack = list(getattr(node, "body", []))
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.setdefault(n.name, n)
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, n)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.setdefault(n.target.id, n)
        elif isinstance(n, (ast.If, ast.Try, ast.With)):
            stack.extend(n.body)
            stack.extend(getattr(n, "orelse", []))
            stack.extend(getattr(n, "finalbody", []))
            for h in getattr(n, "handlers", []):
                stack.extend(h.body)
    return out


def defined(path: Path, qualname: str) -> bool:
    node: ast.AST = _tree(path)
    for part in qualname.split("."):
        node = _children(node).get(part)
        if node is None:
            return False
    return True


def _code(text: str) -> tuple[list[str], list[str]]:
    """(fenced blocks, inline code spans outside them)."""
    blocks = FENCE.findall(text)
    return blocks, INLINE.findall(FENCE.sub("", text))


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings (outside code blocks)."""
    out = set()
    for line in FENCE.sub("", doc.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            title = re.sub(r"[^\w\s-]", "", m.group(1).replace("`", "").lower())
            out.add(re.sub(r"\s", "-", title))
    return out


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))


def test_the_docs_exist():
    assert (ROOT / "docs" / "architecture.md") in DOCS
    assert len(DOCS) > 2


def test_the_walk_names_code_that_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    walk = text.split("## One request, from HTTP to the last token", 1)
    assert len(walk) == 2, "docs/architecture.md has no request walk section"
    hops = PAIR.findall(walk[1].split("\n## ", 1)[0])
    # A walk from HTTP to the last token crosses router, target, draft, sink and book.
    assert len(hops) >= 30, hops
    files = {f for f, _ in hops}
    for needed in ("deployments/router.py", "specserve/target/proposer.py",
                   "specserve/target/book.py", "specserve/draft/runner.py"):
        assert needed in files, f"the walk never passes through {needed}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_named_functions_exist(doc):
    problems = []
    for path, name in PAIR.findall(doc.read_text()):
        file = ROOT / path
        if not file.is_file():
            problems.append(f"{path}: no such file (for `{name}`)")
        elif not defined(file, name):
            problems.append(f"{path}: `{name}` is not defined there")
    assert not problems, f"{_rel(doc)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_named_tests_exist(doc):
    problems = []
    for path, name in TEST_REF.findall(doc.read_text()):
        file = ROOT / path
        if not file.is_file():
            problems.append(f"{path}: no such file")
        elif not any(name in _children(n) for n in
                     [_tree(file), *(c for c in _children(_tree(file)).values()
                                     if isinstance(c, ast.ClassDef))]):
            problems.append(f"{path}::{name}: no such test")
    assert not problems, f"{_rel(doc)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_paths_and_links_exist(doc):
    text = doc.read_text()
    _, inline = _code(text)
    problems = []
    for span in inline:
        path = span.split("::")[0]
        if REPO_PATH.match(path) and not (ROOT / path).exists():
            problems.append(f"`{span}`: no such path")
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = doc.parent / path if path else doc
        if not file.exists():
            problems.append(f"link ({target}): no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"link ({target}): no heading #{anchor} there")
    assert not problems, f"{_rel(doc)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_machine_paths(doc):
    hits = [line.strip() for line in doc.read_text().splitlines() if MACHINE_PATH.search(line)]
    assert not hits, f"{_rel(doc)} names machine paths:\n" + "\n".join(hits)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_make_targets_exist(doc):
    blocks, inline = _code(doc.read_text())
    named = {t for code in (*blocks, *inline) for t in MAKE.findall(code)}
    missing = named - _makefile_targets()
    assert not missing, f"{_rel(doc)} names make targets the Makefile lacks: {sorted(missing)}"


def cli_commands(code: str) -> list[tuple[str, list[str]]]:
    """(subcommand, flags) of each `specserve ...` command line in a code block,
    continuation lines (after a backslash, or indented options) included."""
    out: list[tuple[str, list[str]]] = []
    lines = code.splitlines()
    i = 0
    while i < len(lines):
        m = COMMAND.match(lines[i])
        i += 1
        if not m:
            continue
        command, text = m.group(1), m.group(2)
        words = text.split()
        if words and f"{command} {words[0]}" in _cli():  # a nested subcommand
            command = f"{command} {words[0]}"
            text = text.split(words[0], 1)[1]
        while i < len(lines) and (text.rstrip().endswith("\\")
                                  or re.match(r"^\s+[\[-]", lines[i])):
            text = text.rstrip().rstrip("\\") + " " + lines[i]
            i += 1
        text = text.split(" #")[0]  # a trailing comment
        out.append((command, FLAG.findall(text)))
    return out


@cache
def _cli() -> dict[str, set[str]]:
    import argparse

    from specserve.cli import build_parser

    def commands(parser, prefix: str) -> dict[str, set[str]]:
        out = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, p in action.choices.items():
                    out[prefix + name] = {o for a in p._actions for o in a.option_strings}
                    out.update(commands(p, f"{prefix}{name} "))  # `bench dataplane`
        return out

    return commands(build_parser(), "")


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_cli_commands_exist(doc):
    blocks, inline = _code(doc.read_text())
    problems = []
    for code in (*blocks, *inline):
        for command, flags in cli_commands(code):
            if command not in _cli():
                problems.append(f"specserve {command}: no such subcommand")
                continue
            problems += [f"specserve {command} {f}: no such flag"
                         for f in flags if f not in _cli()[command]]
    assert not problems, f"{_rel(doc)}:\n" + "\n".join(problems)


def test_the_checks_can_fail(tmp_path):
    """The checkers reject what they should (so a passing run means something)."""
    py = tmp_path / "m.py"
    py.write_text("class A:\n    def f(self): pass\nX = 1\nif True:\n    def g(): pass\n")
    assert defined(py, "A.f") and defined(py, "X") and defined(py, "g")
    assert not defined(py, "A.h") and not defined(py, "f") and not defined(py, "A.f.x")
    assert MACHINE_PATH.search("see /tmp/x") and not MACHINE_PATH.search("~/.cache/x /v1/tmp/")
    assert MAKE.findall("make serve CONFIG=a; make bench-quick") == ["serve", "bench-quick"]
    assert "nonexistent-target" not in _makefile_targets() and "test" in _makefile_targets()
    assert cli_commands(".venv/bin/specserve serve [C] --port P \\\n    [--api-key K]  # x --no\n"
                        "specserve models default\nls --not-this\n"
                        "specserve bench dataplane --rows 8") == [
        ("serve", ["--port", "--api-key"]), ("models default", []),
        ("bench dataplane", ["--rows"])]
    assert "--rows" in _cli()["bench dataplane"] and "--rows" not in _cli()["bench"]
    assert "--port" in _cli()["serve"] and "--nope" not in _cli()["serve"]
    heads = tmp_path / "h.md"
    heads.write_text("# Top\n## TLS on the draft → target stream\n```\n# not a heading\n```\n")
    assert anchors(heads) == {"top", "tls-on-the-draft--target-stream"}
    assert PAIR.findall("`a/b.py` `C.d` and `x.py` `y`") == [("a/b.py", "C.d"), ("x.py", "y")]
