"""The documentation stays true to the code: no dead link or anchor between README.md and docs/, every module path
the docs name exists, every option of every command documented in docs/reference.md, and a README short enough to
read in five minutes."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
#: dated records of past measurements: they name the modules as they were when measured
DATED_PAGES = {"benchmarks.md", "measurements.md"}
#: names in backticks that are not this repository's files, and what they are
NOT_OURS = {
    "convert_checkpoint.py": "Model Zoo's converter",
    "fold_lora_checkpoint.py": "Model Zoo's LoRA folding script",
    "convert_hf_to_gguf.py": "llama.cpp's converter",
    "text_model/bin/": "a folder of a mount",
}
#: a module path as the docs write it: relative to ckptfs/ or to the repository (``readers/hf/folder.py``,
#: ``readers/cerebras/lz4chunks/``, ``tests/helpers/s3.py``); placeholders (``<family>.py``, ``OUT/tf/``) are not
CODE_PATH = re.compile(r"(?:\./)?(?:[a-z_][a-z0-9_]*/)+(?:[a-z_][a-z0-9_]*\.py)?")
BARE_MODULE = re.compile(r"[A-Za-z_]\w*\.py")


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    h = heading.strip().lstrip("#").strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(page: Path) -> set:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(line) for line in text.splitlines() if line.startswith("#")}


def links(page: Path) -> list:
    """``[(target, anchor)]`` of every relative Markdown link of ``page`` (code blocks left out)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        out.append((path, anchor))
    return out


def test_no_dead_link_or_anchor():
    dead = []
    for page in PAGES:
        for path, anchor in links(page):
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                dead.append(f"{page.relative_to(ROOT)}: {path} does not exist")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                dead.append(f"{page.relative_to(ROOT)}: {path}#{anchor}: no such heading")
    assert dead == []


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or not page.exists() or page.suffix != ".md":
            continue
        seen.add(page)
        todo += [(page.parent / p).resolve() for p, _ in links(page) if p]
    assert sorted(p.name for p in PAGES if p not in seen) == []


def backticked_words(page: Path) -> list:
    """Every whitespace-separated word of every inline code span of ``page`` (code blocks left out)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [w.strip(",;:()[]'\"") for span in re.findall(r"`([^`\n]+)`", text) for w in span.split()]


def test_every_module_path_in_the_docs_exists():
    """A path with a ``/`` ending in ``.py`` or ``/`` is a file or folder under ckptfs/ or the repository root, and a
    bare ``name.py`` is a file somewhere under ckptfs/, scripts/ or tests/: a moved module leaves no stale name."""
    modules = {p.name for top in ("ckptfs", "scripts", "tests") for p in (ROOT / top).rglob("*.py")}
    stale, used = [], set()
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name in DATED_PAGES:
            continue
        for word in backticked_words(page):
            if word in NOT_OURS:
                used.add(word)
            elif CODE_PATH.fullmatch(word) and "/" in word.rstrip("/"):
                rel = word.removeprefix("./").rstrip("/")
                if not ((ROOT / "ckptfs" / rel).exists() or (ROOT / rel).exists()):
                    stale.append(f"{page.relative_to(ROOT)}: {word}")
            elif BARE_MODULE.fullmatch(word) and word not in modules:
                stale.append(f"{page.relative_to(ROOT)}: {word}")
    assert stale == []
    assert sorted(set(NOT_OURS) - used) == [], "an exemption no page needs any more"


def cli_options() -> dict:
    """``{command: [option, …]}`` of every command's parser."""
    import argparse

    from ckptfs.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for name, p in sub.choices.items():
        out[name] = sorted({s for a in p._actions if a.help != argparse.SUPPRESS for s in a.option_strings
                            if s.startswith("--") and s != "--help"})
    return out


def test_every_command_and_option_is_documented():
    text = (ROOT / "docs" / "reference.md").read_text()
    missing = [f"ckptfs {cmd} {opt}" for cmd, opts in cli_options().items() for opt in [cmd, *opts]
               if not re.search(r"(?<![\w-])" + re.escape(opt) + r"(?![\w-])", text)]
    assert missing == []


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES
