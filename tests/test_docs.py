"""The documentation: README.md stays short, and no relative link or anchor is broken in README.md
or in the site's pages under docs/, the hand-written ones and those bench/docs_pages.py generates
(built here in memory, not written). No model, no Ray session: `make docs` builds the site
itself, with `mkdocs build --strict`, which checks the same links as it renders them. And
bench/, whose scripts and results the docs cite, imports the project, never tests/."""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
import sys
import unicodedata
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 300
README_MAX_CHARS = 100

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ATTR_ID = re.compile(r"\s*\{[^}]*#([\w-]+)[^}]*\}\s*$")
SNIPPET = re.compile(r'^--8<--\s+"([^"]+)"\s*$')
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
# history of the work has no place in what a user reads
HISTORY = re.compile(r"\b(session|issue|sitting) #?\d+\b|\bthis session\b", re.IGNORECASE)


@functools.cache
def docs_pages() -> ModuleType:
    """bench/docs_pages.py, the generator of the site's pages (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("docs_pages", ROOT / "bench" / "docs_pages.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site() -> dict[str, str | None]:
    """Path from the repository root -> Markdown text (None for a generated file that is not a
    page): the hand-written pages on disk, and the generated ones as bench/docs_pages.py makes
    them (whatever an earlier `make docs` left in docs/ is not read)."""
    module = docs_pages()
    files: dict[str, str | None] = {}
    for path in sorted(DOCS.rglob("*")):
        relative = path.relative_to(DOCS)
        if path.is_file() and relative.parts[0] not in module.GENERATED:
            text = path.read_text(encoding="utf-8") if path.suffix == ".md" else None
            files[f"docs/{relative.as_posix()}"] = text
    for relative, content in module.generate().items():
        files[f"docs/{relative}"] = content if isinstance(content, str) else None
    return files


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with code spans blanked out."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)))
    return out


def heading_text(raw: str) -> str:
    """What a heading reads as, once rendered: code spans keep their text, links their label,
    emphasis marks go."""
    parts = re.split(r"(`+.+?`+)", raw)
    rendered = []
    for part in parts:
        if part.startswith("`"):
            rendered.append(part.strip("`"))
        else:
            part = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", part)
            rendered.append(part.replace("*", ""))
    return "".join(rendered)


def mkdocs_slug(text: str) -> str:
    """Python-Markdown's toc slugify, which MkDocs uses."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def github_slug(text: str) -> str:
    """GitHub's anchors for a README's headings."""
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: str, text: str) -> set[str]:
    slug = github_slug if path == "README.md" else mkdocs_slug
    found: set[str] = set()
    seen: Counter[str] = Counter()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if not match:
            continue
        title = match.group(2)
        explicit = ATTR_ID.search(title)
        if explicit:
            found.add(explicit.group(1))
            continue
        base = slug(heading_text(title))
        separator = "-" if path == "README.md" else "_"
        found.add(base if not seen[base] else f"{base}{separator}{seen[base]}")
        seen[base] += 1
    return found


def links(text: str) -> list[tuple[int, str]]:
    return [(number, m.group(1)) for number, line in prose(text) for m in LINK.finditer(line)]


def resolve(source: str, target: str) -> str:
    """The repository path a relative link of `source` names."""
    base = Path(source).parent
    parts: list[str] = []
    for part in (base / target).as_posix().split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return "../" + target  # out of the repository
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts)


def broken_links(source: str, text: str, site: dict[str, str | None]) -> list[str]:
    problems = []
    for number, target in links(text):
        if SCHEME.match(target) or target.startswith("/"):
            continue  # a web address, not this repository's
        path_part, _, fragment = unquote(target).partition("#")
        where = f"{source}:{number}: {target}"
        page = resolve(source, path_part) if path_part else source
        if page.startswith("docs/"):
            if page not in site:
                problems.append(f"{where}: no such page or file in the site")
                continue
        elif source.startswith("docs/"):
            problems.append(f"{where}: leads out of docs/, which the site cannot link to")
            continue
        elif not (ROOT / page).exists():
            problems.append(f"{where}: no such file")
            continue
        if fragment:
            content = site.get(page) if page != "README.md" else README.read_text("utf-8")
            if content is None:
                problems.append(f"{where}: an anchor into a file that is not a page")
            elif fragment not in anchors(page, content):
                problems.append(f"{where}: {page} has no heading #{fragment}")
    return problems


def test_readme_is_short_with_short_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, over {README_MAX_LINES}: move the detail to docs/"
    )
    long = [
        f"README.md:{number}: {len(line)} characters"
        for number, line in enumerate(lines, 1)
        if len(line) > README_MAX_CHARS
    ]
    assert not long, f"lines over {README_MAX_CHARS} characters:\n" + "\n".join(long)


def test_readme_links_and_anchors_resolve(site):
    problems = broken_links("README.md", README.read_text(encoding="utf-8"), site)
    assert not problems, "broken links in README.md:\n" + "\n".join(problems)


def test_docs_links_and_anchors_resolve(site):
    pages = {path: text for path, text in site.items() if text is not None}
    assert "docs/index.md" in pages and "docs/reference/cli.md" in pages
    problems = [p for path, text in pages.items() for p in broken_links(path, text, site)]
    assert not problems, "broken links in docs/:\n" + "\n".join(problems)


def test_included_files_exist(site):
    missing = [
        f"{path}:{number}: {match.group(1)}"
        for path, text in site.items()
        if text is not None
        for number, line in enumerate(text.splitlines(), 1)
        if (match := SNIPPET.match(line)) and not (ROOT / match.group(1)).is_file()
    ]
    assert not missing, "pages include files that do not exist:\n" + "\n".join(missing)


def test_every_results_file_has_a_page(site):
    module = docs_pages()
    results = sorted(module.RESULTS.glob("*.md")) + sorted(module.RESULTS.glob("**/results.md"))
    index = site["docs/benchmarks/index.md"] or ""
    for markdown in results:
        relative = markdown.relative_to(module.RESULTS)
        page = relative.with_suffix("") if relative.name != "results.md" else relative.parent
        assert f"docs/benchmarks/{page.as_posix()}.md" in site, markdown
        assert f"]({page.as_posix()}.md)" in index, f"{markdown} is not in the benchmarks index"


def test_cli_reference_lists_every_command(site):
    module = docs_pages()
    from pipeline.cli.main import build_parser

    reference = site["docs/reference/cli.md"] or ""
    for name in module.subcommands(build_parser()):
        assert f"\n## memstream {name}\n" in reference, name


def test_cli_reference_shows_each_default_in_its_column(site):
    from connectors.engines.factory import DEFAULT_MODEL

    reference = site["docs/reference/cli.md"] or ""
    meanings = [row.rsplit("|", 2)[1] for row in reference.splitlines() if row.startswith("| `")]
    assert meanings and not [meaning for meaning in meanings if "(default: " in meaning]
    run = reference.split("\n## memstream run\n")[1].split("\n## ")[0]
    assert f"| `--model MODEL` | {DEFAULT_MODEL} |" in run  # the job spec's, shown in the help
    assert "| `-v, --verbose` | off |" in run


def test_bench_imports_the_project_never_the_tests():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in sorted((ROOT / "bench").glob("*.py"))
        for line, module in imported_modules(path)
        if module.split(".")[0] == "tests"
    ]
    assert not found, "move what bench/ needs of tests/ into the package:\n" + "\n".join(found)


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of each import statement of a Python file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            yield node.lineno, node.module or ""
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)


def test_readme_and_guides_tell_no_history():
    texts = {"README.md": README.read_text(encoding="utf-8")}
    generated = docs_pages().GENERATED
    for path in DOCS.rglob("*.md"):
        if path.relative_to(DOCS).parts[0] not in generated:
            texts[str(path.relative_to(ROOT))] = path.read_text(encoding="utf-8")
    found = [
        f"{name}:{number}: {match.group(0)!r}"
        for name, text in texts.items()
        for number, line in enumerate(text.splitlines(), 1)
        if (match := HISTORY.search(line))
    ]
    assert not found, "the history of the work belongs in git, not in the docs:\n" + "\n".join(
        found
    )
