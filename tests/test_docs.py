"""The documents stay what a reader can trust: `benchmarks/results/` holds only files a document names and stays
small, the README keeps its size, its two commands and no commit hashes, and every relative link in the
documents leads to a file (and heading) that exists. Engine-free and fast: text and ``git ls-files`` only."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MAX_RESULT_FILES = 40
MAX_RESULT_BYTES = 3_000_000
MAX_README_LINES = 150
MAX_README_CELL_CHARS = 200
MAX_RESULTS_DOC_LINES = 400
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A commit hash as the docs would write it: 7 to 40 hex digits with at least one digit and one letter.
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def naming_documents() -> list[Path]:
    """The documents whose mention keeps a result file: README.md, docs/*.md and benchmarks/README.md."""
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
    return [path for path in documents if path.exists()]


def linked_documents() -> list[Path]:
    """Every Markdown file a reader reaches from the README: the naming documents and the GPU results' index."""
    return [*naming_documents(), RESULTS / "gpu" / "README.md"]


def result_files() -> list[Path]:
    """The files of ``benchmarks/results/`` as committed: git's list in a checkout (a benchmark run's new,
    uncommitted outputs do not count), every file below the folder elsewhere."""
    listed = subprocess.run(["git", "ls-files", "-z", "--", str(RESULTS)], cwd=ROOT, capture_output=True)
    if listed.returncode == 0:
        return [ROOT / name for name in listed.stdout.decode().split("\0") if name and (ROOT / name).exists()]
    return [path for path in RESULTS.rglob("*") if path.is_file()]


def is_named(result: Path, text: str) -> bool:
    """A result file is named when its path below ``benchmarks/results/`` appears, or, unless it is a README
    (whose bare name every document shares), its file name."""
    relative = result.relative_to(RESULTS).as_posix()
    return relative in text or (result.name != "README.md" and result.name in text)


def test_every_result_file_is_named_by_a_document() -> None:
    text = "\n".join(path.read_text() for path in naming_documents())
    unnamed = [path.relative_to(ROOT).as_posix() for path in result_files() if not is_named(path, text)]
    assert not unnamed, (
        f"{len(unnamed)} file(s) in benchmarks/results/ named by no document (README.md, docs/, "
        f"benchmarks/README.md): {unnamed[:10]}; name each where its figures are reported, or `git rm` it"
    )


def test_the_results_folder_stays_small() -> None:
    files = result_files()
    size = sum(path.stat().st_size for path in files)
    assert len(files) <= MAX_RESULT_FILES, (
        f"benchmarks/results/ has {len(files)} files, at most {MAX_RESULT_FILES}: keep the latest run per "
        "question per machine kind and `git rm` superseded ones (git keeps their history)"
    )
    assert size <= MAX_RESULT_BYTES, f"benchmarks/results/ holds {size} bytes, at most {MAX_RESULT_BYTES}"


def test_a_result_file_counts_as_named_only_by_its_own_name() -> None:
    report, index = RESULTS / "main_job.md", RESULTS / "gpu" / "README.md"
    assert is_named(report, "Recorded in `main_job.md`.")
    assert not is_named(report, "Recorded in `main_job_full.md`.")
    assert not is_named(index, "See its README.md.")
    assert is_named(index, "See benchmarks/results/gpu/README.md.")


def readme_lines() -> list[str]:
    return (ROOT / "README.md").read_text().splitlines()


def test_the_readme_is_short_and_starts_with_its_two_commands() -> None:
    lines = readme_lines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines, at most {MAX_README_LINES}"
    first_screen = "\n".join(lines[:15])
    for command in ("make demo", "make test"):
        assert command in first_screen, f"README.md's first lines must keep `{command}`"


def test_no_readme_table_cell_is_longer_than_a_reader_scans() -> None:
    long_cells = [
        cell.strip()[:60]
        for line in readme_lines()
        if line.startswith("|")
        for cell in line.strip().strip("|").split("|")
        if len(cell.strip()) > MAX_README_CELL_CHARS
    ]
    assert not long_cells, f"README.md table cells over {MAX_README_CELL_CHARS} characters: {long_cells}"


def test_the_readme_names_no_commit() -> None:
    hashes = sorted({match.group() for line in readme_lines() for match in COMMIT_HASH.finditer(line)})
    assert not hashes, f"README.md names commits {hashes}: say what a reader can check instead (a date, a file)"


def test_results_doc_fits_in_its_budget() -> None:
    lines = (ROOT / "docs" / "results.md").read_text().splitlines()
    assert len(lines) <= MAX_RESULTS_DOC_LINES, f"docs/results.md has {len(lines)} lines, at most {MAX_RESULTS_DOC_LINES}"


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a document's headings: lower case, punctuation dropped, spaces as hyphens, repeats
    numbered."""
    anchors: set[str] = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        anchor, count = slug, 1
        while anchor in anchors:
            anchor, count = f"{slug}-{count}", count + 1
        anchors.add(anchor)
    return anchors


def test_heading_anchors_follow_github() -> None:
    assert heading_anchors("# Results\n## AVX2 EPYC, float32: vLLM's `eagle3` chain\n## Results\n") == {
        "results", "avx2-epyc-float32-vllms-eagle3-chain", "results-1"
    }


@pytest.mark.parametrize("document", linked_documents(), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_relative_links_lead_somewhere(document: Path) -> None:
    broken = []
    for target in LINK.findall(document.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path_part, _, anchor = target.partition("#")
        path = (document.parent / path_part).resolve() if path_part else document
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path.read_text()):
            broken.append(target)
    assert not broken, f"{document.relative_to(ROOT)} links to what does not exist: {broken}"


def test_make_targets_the_documents_name_exist() -> None:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE))
    mentions = re.compile(r"(?:`|^)make ([\w-]+)", flags=re.MULTILINE)  # `make x` in prose, or a line of code
    named = {target for path in linked_documents() for target in mentions.findall(path.read_text())}
    assert named <= targets, f"the documents name make targets the Makefile lacks: {sorted(named - targets)}"


def test_benchmark_commands_the_documents_name_exist() -> None:
    from benchmarks.__main__ import COMMANDS

    mentions = re.compile(r"python -m benchmarks ([a-z][\w-]*)")
    named = {name for path in linked_documents() for name in mentions.findall(path.read_text())}
    assert named <= set(COMMANDS), f"the documents name benchmarks the front door lacks: {sorted(named - set(COMMANDS))}"
