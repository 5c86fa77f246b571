"""The repository's references stay inside the repository and point at something that exists.

- No tracked text file names a path outside the repository: an absolute path under the project
  machines' work directory, the shared design folder the project started from, or a relative `../`
  path that climbs out of the repository from the file's own directory. Machine-written records
  (`*.json`, `*.jsonl`) are exempt: they log the absolute paths of the runs that wrote them.
- Every citation of a design note, `docs/design/<file>.md section N` (also `sections A-B`,
  `sections A, B and C`), names a file of `docs/design/` and sections its headings define
  (`## N.`, `### N.M`, ...). A design note cited by its bare name (`engines.md 2.4`) outside
  `docs/design/` is an error too: the citation has to say where the file is.
- Every relative markdown link of a tracked .md file resolves to a file or directory of the
  repository, and its `#anchor` to a heading of the linked document.
- Every repository path and module the user documentation names (README.md and docs/*.md, not the
  design notes, whose paths are mostly the engines' own, nor the measurement records in
  docs/results/) exists.
Each check runs on a planted bad reference as well.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design"
DESIGN_NAMES = ("algorithms", "engines", "formats", "architecture", "deployment", "verl-on-cpu", "environment")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini", ""}
RECORDS = {".json", ".jsonl"}
# spelled in pieces so that this file does not match its own patterns
OUTSIDE = (re.compile("/" + "work" + "/"), re.compile("shared" + "/" + "design"), re.compile(r"\.\." + "/" + "shared"))
CLIMB = re.compile(r"(?<![\w./-])((?:\.\./)+)([\w.-]*)")
NUM = r"\d+(?:\.\d+)*"
CITATION = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*)(" + "|".join(map(re.escape, DESIGN_NAMES)) + r")\.md(?![\w-])")
SECTIONS = re.compile(rf"^[\s#*>()\]]*sections?\s+({NUM}(?:\s*(?:,|-|and|/)\s*(?:#\s*)?{NUM})*)", re.S)
BARE_NUMBER = re.compile(rf"^\s+{NUM}\b")
HEADING = re.compile(rf"^#{{2,6}}\s+({NUM})\.?\s", re.M)
REPO_DIRS = ("feature_store", "drafters", "verl_speco", "scripts", "configs", "docker", "tests", "docs", "benchmarks")
REPO_PATH = re.compile(r"(?<![\w./~-])((?:" + "|".join(REPO_DIRS) + r")/[\w./*{},<>-]*)")
# a dotted module; `feature_store.<key>` with one dot is also the drafter section's config key, not checked
MODULE = re.compile(r"(?<![\w./-])((?:verl_speco|drafters|feature_store)(?:\.\w+)+)(?![\w/=])")
SELF = Path(__file__).resolve()  # holds the planted examples of the checks below


UNTRACKED_DIRS = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".cache",
                  "build", "dist"}


def tracked_files() -> list[Path]:
    """The repository's files: git's tracked and not-ignored ones (a walk skipping the usual build
    and cache directories where git is unavailable)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        return sorted({ROOT / p for p in out.split("\0") if p and (ROOT / p).is_file()})
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for p in ROOT.rglob("*") if p.is_file() and not any(
            part in UNTRACKED_DIRS or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts))


def read_text(path: Path) -> str | None:
    if path.suffix not in TEXT_SUFFIXES and path.suffix not in RECORDS:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def design_sections(name: str) -> set[str] | None:
    path = DESIGN / f"{name}.md"
    return set(HEADING.findall(path.read_text(encoding="utf-8"))) if path.is_file() else None


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def outside_problems(rel: str, text: str) -> list[str]:
    """References in `text` (the file `rel`) to paths outside the repository."""
    if Path(rel).suffix in RECORDS:
        return []
    problems = [f"{rel}:{_line(text, m.start())}: {m.group(0)!r} points outside the repository"
                for pattern in OUTSIDE for m in pattern.finditer(text)]
    here = (ROOT / rel).parent
    for m in CLIMB.finditer(text):
        target = (here / m.group(1) / m.group(2)).resolve()
        if not target.is_relative_to(ROOT):
            problems.append(f"{rel}:{_line(text, m.start())}: {m.group(0)!r} climbs out of the repository")
    return problems


def citation_problems(rel: str, text: str) -> list[str]:
    """Design-note citations in `text` (the file `rel`) that name no file or section of docs/design."""
    problems = []
    in_design = rel.startswith("docs/design/")
    for m in CITATION.finditer(text):
        prefix, name = m.group(1), m.group(2)
        where = f"{rel}:{_line(text, m.start())}"
        cited = f"{prefix}{name}.md"
        relative = ((ROOT / rel).parent / cited).resolve()
        # a design note: by its repository path, by its name from another design note, or by a
        # relative link into docs/design (design/engines.md from docs/)
        if not (prefix == "docs/design/" or (in_design and prefix == "") or relative.parent == DESIGN):
            if not ((ROOT / cited).is_file() or relative.is_file()):  # else another document of that name
                problems.append(f"{where}: {cited!r}: cite design notes as docs/design/{name}.md section N")
            continue
        sections = design_sections(name)
        if sections is None:
            problems.append(f"{where}: {cited!r}: no such file")
            continue
        after = text[m.end():m.end() + 200]
        if BARE_NUMBER.match(after):
            problems.append(f"{where}: {cited!r} followed by a bare number: write 'section N'")
            continue
        found = SECTIONS.match(after)
        if found:
            for number in re.findall(NUM, found.group(1)):
                if number not in sections:
                    problems.append(f"{where}: {cited} has no section {number} (it has {sorted(sections)})")
    return problems


def _module_exists(dotted: str) -> bool:
    """A module (or an attribute of one: the last component, defined in its source) of the repository."""
    parts = dotted.split(".")
    for cut in (len(parts), len(parts) - 1):
        base = ROOT.joinpath(*parts[:cut])
        for source in (base.with_suffix(".py"), base / "__init__.py"):
            if not source.is_file():
                continue
            if cut == len(parts):
                return True
            attr = re.escape(parts[-1])
            defined = rf"(?m)^\s*(?:def|class)\s+{attr}\b|^{attr}\s*[:=]|^\s*from\s+\S+\s+import\s+.*\b{attr}\b"
            return re.search(defined, source.read_text(encoding="utf-8")) is not None
    return False


def path_problems(rel: str, text: str) -> list[str]:
    """Repository paths and modules named in a user document that do not exist."""
    problems = []
    for m in REPO_PATH.finditer(text):
        path = m.group(1).rstrip(".,:;")
        if any(c in path for c in "*{}<>") or path.endswith("/."):
            continue
        if not (ROOT / path).exists():
            problems.append(f"{rel}:{_line(text, m.start())}: {path} does not exist")
    for m in MODULE.finditer(text):
        if m.group(1).startswith("feature_store.") and m.group(1).count(".") == 1:
            continue
        if not _module_exists(m.group(1)):
            problems.append(f"{rel}:{_line(text, m.start())}: module {m.group(1)} does not exist")
    return problems


LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(rel: str, text: str) -> list[str]:
    """Relative links of the markdown file `rel` whose target or anchor does not exist."""
    problems = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue  # http(s):, mailto:
        path_part, _, anchor = target.partition("#")
        path = ((ROOT / rel).parent / path_part).resolve() if path_part else ROOT / rel
        where = f"{rel}:{_line(text, m.start())}"
        if not path.exists() or not path.is_relative_to(ROOT):
            problems.append(f"{where}: link {target} does not resolve")
        elif anchor:
            headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", path.read_text(encoding="utf-8"), re.M) if path.is_file() else []
            if anchor not in {slug(h) for h in headings}:
                problems.append(f"{where}: link {target}: no heading with that anchor")
    return problems


def user_docs() -> list[Path]:
    return [p for p in tracked_files() if p.suffix == ".md" and p.relative_to(ROOT).parts[:1] in (("README.md",), ("docs",))
            and p.relative_to(ROOT).parts[:2] not in (("docs", "design"), ("docs", "results"))]


def test_no_tracked_file_points_outside_the_repository() -> None:
    problems = []
    for path in tracked_files():
        text = read_text(path)
        if text is not None and path != SELF:
            problems += outside_problems(path.relative_to(ROOT).as_posix(), text)
    assert problems == []


def test_every_design_citation_names_an_existing_file_and_section() -> None:
    assert {p.stem for p in DESIGN.glob("*.md")} >= {"algorithms", "engines", "formats", "architecture",
                                                     "environment", "verl-on-cpu"}
    problems, cited = [], 0
    for path in tracked_files():
        text = read_text(path)
        if text is None or path.suffix in RECORDS or path == SELF:
            continue
        problems += citation_problems(path.relative_to(ROOT).as_posix(), text)
        cited += len(CITATION.findall(text))
    assert problems == []
    assert cited > 50  # the code cites the design notes throughout


def test_user_docs_name_existing_paths_and_modules() -> None:
    docs = user_docs()
    assert ROOT / "README.md" in docs and ROOT / "docs" / "modes.md" in docs
    problems = []
    for path in docs:
        problems += path_problems(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))
    assert problems == []


def test_markdown_links_resolve() -> None:
    problems = []
    for path in tracked_files():
        if path.suffix == ".md" and path != SELF:
            problems += link_problems(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))
    assert problems == []
    planted = "[a](modes.md) [b](nowhere.md) [c](feature-store.md#no-such-heading) [d](https://example.org/x)"
    assert [p.split(": ", 1)[1] for p in link_problems("docs/planted.md", planted)] == [
        "link nowhere.md does not resolve", "link feature-store.md#no-such-heading: no heading with that anchor"]
    assert link_problems("docs/planted.md", "[e](feature-store.md#checking-a-store-verl-speco-inspect-features)") == []


@pytest.mark.parametrize("line, expected", [
    ("see " + "/" + "work/main/x.py", "points outside"),
    ("# the recipe of ../" + "shared/design/verl-on-cpu.md", "points outside"),
    ("[notes](../../../elsewhere/notes.md)", "climbs out"),
])
def test_planted_outside_references_are_caught(line: str, expected: str) -> None:
    problems = outside_problems("docs/planted.md", f"text\n{line}\n")
    assert problems and all(expected in p or "points outside" in p for p in problems), problems
    assert outside_problems("tests/engines/planted.py", 'f = "../escape.safetensors"\n') == []
    assert outside_problems('scripts/lib/planted.sh', 'cd "$(dirname "$0")/../.."\n') == []
    assert outside_problems("docs/results/x/report.json", '"export": "/' + 'work/main/runs/x"') == []


@pytest.mark.parametrize("text, expected", [
    ("(docs/design/engines.md section 9.9)", "has no section 9.9"),
    ("(docs/design/algorithms.md sections 4-12)", "has no section 12"),
    ("(docs/design/engines.md sections 2.4 and\n# 4.99)", "has no section 4.99"),
    ("(docs/design/nowhere.md section 1)", None),  # not a design-note name: not a citation
    ("(docs/design/formats.md 1)", "bare number"),
    ("(engines.md 2.4)", "cite design notes as docs/design/engines.md"),
    ("(shared/design/algorithms.md section 3)", "cite design notes as docs/design/algorithms.md"),
])
def test_planted_bad_citations_are_caught(text: str, expected: str | None) -> None:
    problems = citation_problems("drafters/planted.py", text)
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0], problems


def test_good_citations_pass() -> None:
    text = ("(docs/design/engines.md sections 2.3, 2.3.1 and 5.3); docs/design/algorithms.md sections 4-6;\n"
            "docs/design/engines.md sections 2.5, 4.7\nand 5.5; docs/design/formats.md section 1;"
            " docs/design/engines.md for what each engine serves; see `docs/real-target.md`")
    assert citation_problems("drafters/planted.py", text) == []
    assert citation_problems("docs/design/planted.md", "[algorithms.md section 0.3](algorithms.md)") == []
    assert citation_problems("docs/planted.md", "[design/engines.md](design/engines.md) section 6") == []
    assert "has no section 17" in citation_problems("docs/planted.md", "[design/engines.md](design/engines.md) section 17")[0]


def test_planted_missing_paths_are_caught() -> None:
    text = ("`verl_speco/no_such_module.py`, `scripts/run_qwen3_8b_eagle3.sh`, `python -m verl_speco.nowhere.cpu_launch`,"
            " `verl_speco.deploy.support`, `feature_store.transcode.transcode_store`, `verl_speco.deploy.no_such_name`")
    problems = path_problems("docs/planted.md", text)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "verl_speco/no_such_module.py does not exist", "module verl_speco.nowhere.cpu_launch does not exist",
        "module verl_speco.deploy.no_such_name does not exist"]


README_MAX_LINES = 160  # the front door stays short; results beyond one table per target live in docs/results.md
RESULT_TARGETS = 2  # the embedded tiny Qwen3 and SmolLM2-135M-Instruct


def readme_length_problems(text: str) -> list[str]:
    """The README's bound: under README_MAX_LINES lines, one results table per target, the rest linked."""
    problems = []
    if len(text.splitlines()) >= README_MAX_LINES:
        problems.append(f"README.md has {len(text.splitlines())} lines, expected under {README_MAX_LINES}")
    section = text.split("\n## Results\n", 1)[-1].split("\n## ", 1)[0] if "\n## Results\n" in text else ""
    tables = len(re.findall(r"(?:^|\n)\n\|[^\n]*\|\n\|[-| ]+\|\n", section))
    if tables != RESULT_TARGETS:
        problems.append(f"README's Results section has {tables} tables, expected one per target ({RESULT_TARGETS}); "
                        "move the others to docs/results.md")
    if "](docs/results.md" not in section:
        problems.append("README's Results section does not link docs/results.md")
    return problems


def test_readme_stays_under_its_bound() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme_length_problems(text) == []
    longer = text.replace("\n## Documentation\n", "\n" * (README_MAX_LINES - len(text.splitlines()) + 1) + "## Documentation\n")
    assert readme_length_problems(longer) == [f"README.md has {README_MAX_LINES} lines, expected under {README_MAX_LINES}"]
    third = text.replace("\n## Documentation\n", "\n| a | b |\n|---|---|\n| 1 | 2 |\n\n## Documentation\n")
    assert readme_length_problems(third)[-1].startswith("README's Results section has 3 tables")
