"""A broad, deterministic prompt corpus for self-distilling EAGLE heads.

``build_corpus(n_items, seed)`` returns about ``n_items`` chat items in six categories:

* ``coding``: the project's 712 hand-written prompts (``prompts.train_prompts()``, a prefix
  when fewer are asked for);
* ``explain``: explain a real function, class or module, or a chat-style question about it;
* ``edit``: refactor / annotate / add error handling / rename / convert to a dataclass ...,
  given a real function's or class's source;
* ``complete_function``: a real signature with its docstring; the target writes the body;
* ``complete_class``: a real class with one method removed; the target writes the method;
* ``followup``: a second user turn ("Now write unit tests for it.") asked after the target's
  own answer to a first turn.

The code comes from the Python standard library (PSF licence) and from installed
distributions whose licence metadata is permissive (MIT, BSD, Apache-2.0, PSF, ISC and
their SPDX variants; ``classify_licence``).  Everything else is left out, and so are tests,
vendored code, this project itself, and anything whose name suggests a public evaluation
set.  No item shares an 8-word shingle or a task phrase with the EAGLE benchmark's held-out
prompts (``prompts.HELDOUT_PROMPTS``), the main job's chat, code and math prompts or the
code-edit benchmark prompts (``benchmarks/prompts.json``); ``ExclusionFilter`` counts what it
removed.

Invariants:

* an item's ``messages`` hold user turns only: an assistant turn is always the target's own
  answer, added by the data stage (``data.self_distill_items``) when it builds the second
  round of a follow-up from the first round's generated answer;
* the same (environment, ``n_items``, ``seed``, ``roots``) gives the same items in the same
  order and the same manifest;
* every item names its source root, the file it was cut from (relative to the root) and the
  sha256 of that file's text; the manifest lists every root used with its licence, the files
  used, the items, the characters and a sha256 over the used files' contents.

Run ``python -m vllm_easyspec_train.corpus`` for the sizes and a token estimate.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata as md
import json
import os
import random
import re
import sys
import sysconfig
import textwrap
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

CATEGORIES = ("coding", "explain", "edit", "complete_function", "complete_class", "followup")
DEFAULT_N_ITEMS = 10000
# Shares of n_items; ``coding`` is capped at the prompts train_prompts() has (712).  At the
# default size: 712 coding, 2600 explain, 2200 edit, 2300 complete_function, 1188
# complete_class and 1000 follow-ups.
DEFAULT_MIX = {"coding": 0.0712, "explain": 0.26, "edit": 0.22, "complete_function": 0.23,
               "complete_class": 0.1188, "followup": 0.10}

FN_LINES = (5, 80)  # a function or method, decorators to last line
CLASS_LINES = (10, 100)
MAX_SNIPPET_CHARS = 2400  # a function: about 700 target tokens, so a round-2 prompt stays well below 2048
MAX_CLASS_CHARS = 3000
MAX_FILE_BYTES = 400_000
PER_FILE_FUNCTIONS = 6
PER_FILE_CLASSES = 4
SCAN_MARGIN = 1.3  # scan until each unit pool holds this multiple of what the categories need
SHINGLE_WORDS = 8

PROJECT_NAME = "vllm-easyspec"
PROJECT_LICENCE = "Apache-2.0"
STDLIB_LICENCE = "PSF-2.0"

Message = dict[str, str]

# --------------------------------------------------------------------------- items


@dataclass(frozen=True)
class CorpusItem:
    """One prompt of the corpus.

    ``messages`` is the conversation the target answers first: user turns only (one for a
    single-turn item).  ``followup`` is set exactly for category ``followup``: the second
    user turn, asked after the target's own answer to ``messages`` (see
    ``second_round``).  ``source_root`` / ``source_path`` / ``source_sha256`` name the root,
    the file relative to it and the sha256 of that file's text; ``source_ref`` says which
    part of the file (qualified name and line range)."""

    category: str
    messages: tuple[Message, ...]
    source_root: str
    source_path: str
    source_sha256: str
    source_ref: str = ""
    followup: str | None = None

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown category {self.category!r}")
        if not self.messages or any(m.get("role") not in ("system", "user") for m in self.messages):
            raise ValueError("an item's messages hold user (or system) turns only; assistant turns are "
                             "the target's own answers, added by the data stage")
        if (self.category == "followup") != (self.followup is not None):
            raise ValueError("exactly the follow-up items carry a second user turn")

    def first_round_prompt(self) -> str | list[Message]:
        """What the data stage generates for first: the plain text when ``messages`` is one user
        turn (rendered with the chat template exactly like the 712 coding prompts, so the same
        text shares its cached answer), else the message list."""
        if len(self.messages) == 1 and self.messages[0]["role"] == "user":
            return self.messages[0]["content"]
        return [dict(m) for m in self.messages]

    def second_round(self, first_answer: str) -> list[Message]:
        """The follow-up conversation: ``messages``, the target's answer to them, then ``followup``."""
        if self.followup is None:
            raise ValueError(f"a {self.category} item has no second round")
        return [dict(m) for m in self.messages] + [{"role": "assistant", "content": first_answer},
                                                   {"role": "user", "content": self.followup}]

    def text(self) -> str:
        """Every user-written character of the item (what the exclusion filter checks)."""
        return "\n\n".join([m["content"] for m in self.messages] + ([self.followup] if self.followup else []))

    def to_dict(self) -> dict[str, Any]:
        return {"category": self.category, "messages": [dict(m) for m in self.messages],
                "followup": self.followup, "source": {"root": self.source_root, "path": self.source_path,
                                                      "sha256": self.source_sha256, "ref": self.source_ref}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CorpusItem:
        src = d["source"]
        return cls(d["category"], tuple(dict(m) for m in d["messages"]), src["root"], src["path"], src["sha256"],
                   src.get("ref", ""), d.get("followup"))


@dataclass
class Corpus:
    """The items (single-turn first, in a seeded order, then the follow-ups) and the manifest.
    ``seconds`` is the build time (kept out of the manifest so that it is reproducible)."""

    items: list[CorpusItem]
    manifest: dict[str, Any]
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        c = Counter(it.category for it in self.items)
        return {cat: c.get(cat, 0) for cat in CATEGORIES}

    def write_jsonl(self, path: str | Path) -> None:
        """One JSON line ``{"corpus_manifest": ...}``, then one line per item (gzip-compressed when
        ``path`` ends in ``.gz``): the file a GPU machine trains from (``read_jsonl``)."""
        with _open_text(path, "w") as f:
            f.write(json.dumps({"corpus_manifest": self.manifest}, ensure_ascii=False) + "\n")
            for it in self.items:
                f.write(json.dumps(it.to_dict(), ensure_ascii=False) + "\n")

    def subset(self, keep: Sequence[int], reason: str) -> Corpus:
        """The items at positions ``keep`` (in that order); the manifest keeps the full corpus's and
        records which corpus the subset came from and why."""
        items = [self.items[i] for i in keep]
        part = Corpus(items, {})
        manifest = {**self.manifest, "n_items": len(items), "items_sha256": items_sha256(items),
                    "subset_of": {"n_items": len(self.items), "items_sha256": self.manifest["items_sha256"],
                                  "categories": part.counts(), "reason": reason}}
        return Corpus(items, manifest)

    @classmethod
    def read_jsonl(cls, path: str | Path) -> Corpus:
        """The corpus ``write_jsonl`` wrote; refuses a file whose items do not hash to its manifest's
        ``items_sha256``."""
        with _open_text(path, "r") as f:
            first = json.loads(f.readline() or "{}")
            if "corpus_manifest" not in first:
                raise ValueError(f"{path}: the first line is not a corpus manifest; write the file with "
                                 "`python -m vllm_easyspec_train.corpus --out FILE`")
            items = [CorpusItem.from_dict(json.loads(line)) for line in f if line.strip()]
        manifest = first["corpus_manifest"]
        if items_sha256(items) != manifest.get("items_sha256"):
            raise ValueError(f"{path}: its items do not match the manifest's items_sha256 (a damaged or edited "
                             "file); write it again")
        return cls(items, manifest)


def items_sha256(items: Sequence[CorpusItem]) -> str:
    return sha256_text("\n".join(json.dumps(it.to_dict(), sort_keys=True) for it in items))


def _open_text(path: str | Path, mode: str):
    if str(path).endswith(".gz"):
        import gzip

        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def sha256_text(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8", "surrogatepass")).hexdigest()


# --------------------------------------------------------------------------- licences

_PERMISSIVE_IDS = {"mit", "mit-0", "mit-cmu", "bsd", "0bsd", "bsd-2-clause", "bsd-3-clause", "bsd-3-clause-clear",
                   "bsd-2-clause-patent", "apache-2.0", "psf-2.0", "python-2.0", "isc"}
_ALLOWED_EXCEPTIONS = {"llvm-exception"}
_ALIASES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^(the )?mit( license)?$"), "MIT"),
    (re.compile(r"^(new |modified |simplified |revised )?bsd( license)?$"), "BSD"),
    (re.compile(r"^(bsd[- ]?3[- ]clause|3[- ]clause bsd)( license)?$"), "BSD-3-Clause"),
    (re.compile(r"^(bsd[- ]?2[- ]clause|2[- ]clause bsd)( license)?$"), "BSD-2-Clause"),
    (re.compile(r"^apache( software)?( license)?(,? version)?( 2(\.0)?)?( license)?$"), "Apache-2.0"),
    (re.compile(r"^(psf|python software foundation)( license)?( 2(\.0)?)?$"), "PSF-2.0"),
    (re.compile(r"^isc( license)?( \(iscl\))?$"), "ISC"),
]
_CLASSIFIERS = {
    "MIT License": "MIT", "MIT No Attribution License (MIT-0)": "MIT-0", "BSD License": "BSD",
    "Apache Software License": "Apache-2.0", "Python Software Foundation License": "PSF-2.0",
    "ISC License (ISCL)": "ISC", "0BSD": "0BSD",
}


def _spdx_permissive(expr: str) -> bool | None:
    """Whether an SPDX expression allows use under a permissive licence: ``OR`` needs one
    permissive side, ``AND`` both, ``X WITH e`` a permissive X and an allowed exception.  None
    when the text is not an SPDX expression (free text such as ``Apache 2.0 License``)."""
    toks = re.findall(r"\(|\)|[A-Za-z0-9.+:-]+", expr)
    if not toks:
        return None
    pos = 0

    def peek() -> str:
        return toks[pos].upper() if pos < len(toks) else ""

    def ident() -> bool:
        nonlocal pos
        if pos >= len(toks) or toks[pos] in "()" or peek() in ("AND", "OR", "WITH"):
            raise ValueError
        t = toks[pos].lower().rstrip("+")
        pos += 1
        if t not in _PERMISSIVE_IDS and not re.search(r"[0-9-]", t):
            raise ValueError  # a bare word such as "Apache": free text, not SPDX
        return t in _PERMISSIVE_IDS

    def factor() -> bool:
        nonlocal pos
        if pos < len(toks) and toks[pos] == "(":
            pos += 1
            v = disj()
            if pos >= len(toks) or toks[pos] != ")":
                raise ValueError
            pos += 1
            return v
        v = ident()
        if peek() == "WITH":
            pos += 1
            if pos >= len(toks):
                raise ValueError
            exc = toks[pos].lower()
            pos += 1
            v = v and exc in _ALLOWED_EXCEPTIONS
        return v

    def conj() -> bool:
        nonlocal pos
        v = factor()
        while peek() == "AND":
            pos += 1
            v = factor() and v
        return v

    def disj() -> bool:
        nonlocal pos
        v = conj()
        while peek() == "OR":
            pos += 1
            v = conj() or v
        return v

    try:
        v = disj()
    except ValueError:
        return None
    return v if pos == len(toks) else None


def _alias(text: str) -> str | None:
    t = re.sub(r"\s+", " ", text.strip().lower().rstrip("."))
    for rx, spdx in _ALIASES:
        if rx.match(t):
            return spdx
    return None


def classify_licence(meta: Any) -> tuple[str | None, str]:
    """(licence, how) from a distribution's metadata; licence is None unless it is permissive.

    Order: ``License-Expression`` (SPDX); a one-line ``License`` field (SPDX or a known
    spelling such as "Apache 2.0"); the ``License ::`` classifiers (all of them must be
    permissive); the first line of a long ``License`` text.  A recognised non-permissive
    answer at any step ends the search (it is never overridden by a later step)."""
    expr = (meta.get("License-Expression") or "").strip()
    if expr:
        ok = _spdx_permissive(expr)
        return (expr if ok else None), f"License-Expression: {expr}"
    raw = (meta.get("License") or "").strip()
    if raw and "\n" not in raw and len(raw) <= 100:
        ok = _spdx_permissive(raw)
        if ok is not None:
            return (raw if ok else None), f"License: {raw}"
        spdx = _alias(raw)
        if spdx:
            return spdx, f"License: {raw}"
    lic_cls = [c.split("::")[-1].strip() for c in (meta.get_all("Classifier") or [])
               if c.startswith("License ::") and c.strip() not in ("License :: OSI Approved", "License :: DFSG approved")]
    if lic_cls:
        mapped = [_CLASSIFIERS.get(c) for c in lic_cls]
        if all(mapped):
            return " OR ".join(dict.fromkeys(m for m in mapped if m)), "Classifier: " + "; ".join(lic_cls)
        return None, "Classifier: " + "; ".join(lic_cls)
    if raw:
        first = next((line for line in raw.splitlines() if line.strip()), "")
        spdx = _alias(first) or _alias(re.sub(r"\blicen[cs]e\b.*$", "", first, flags=re.I))
        if spdx:
            return spdx, f"License text: {first.strip()[:80]}"
        return None, f"License text not recognised: {first.strip()[:80]}"
    return None, "no licence metadata"


# --------------------------------------------------------------------------- roots

SKIP_DIRS = {"test", "tests", "testing", "_testing", "idle_test", "__pycache__", "site-packages", "dist-packages",
             "_vendor", "vendor", "vendored", "_vendored", "third_party", "thirdparty", "_bundled", "externals",
             "extern", "_extern", "lib2to3", "turtledemo", "node_modules", "_distutils_hack"}
# Substrings of a path component, distribution or snippet that suggest a public evaluation set.
EVAL_SET_MARKERS = ("humaneval", "human_eval", "human-eval", "mbpp", "mt_bench", "mt-bench", "mtbench", "ds1000",
                    "ds-1000", "lm_eval", "lm-eval", "lm_evaluation", "evalplus", "bigcode_eval", "livecodebench",
                    "swe_bench", "swe-bench", "swebench", "gsm8k", "mmlu", "alpaca_eval", "arena_hard",
                    "arena-hard")
# Whole names (path component stems, distribution names) that are evaluation sets or their caches.
EVAL_SET_NAMES = {"apps", "datasets", "evaluate", "human_eval", "humaneval", "mbpp"}


@dataclass(frozen=True)
class SourceRoot:
    """A tree of Python sources under one permissive licence.

    ``files`` are the candidate ``.py`` files, relative to ``path``, with tests, vendored
    code and evaluation-set names already left out.  ``weight`` is how many files the
    scan takes from this root per round (the standard library gets more than one package)."""

    name: str
    path: Path
    licence: str
    files: tuple[str, ...]
    kind: str = "site-packages"
    version: str = ""
    licence_source: str = ""
    weight: int = 1
    eval_named_files: int = 0


def _eval_name(name: str) -> bool:
    n = name.lower().replace("-", "_")
    stem = n[:-3] if n.endswith(".py") else n
    return stem in EVAL_SET_NAMES or any(m.replace("-", "_") in n for m in EVAL_SET_MARKERS)


def _path_verdict(parts: Sequence[str]) -> str | None:
    """None to keep a file; else why it is left out ("skip" for tests / vendored code, "eval" for
    a name that suggests an evaluation set)."""
    if any(_eval_name(p) for p in parts):
        return "eval"
    name = parts[-1]
    if any(p in SKIP_DIRS or p.startswith(("config-", ".")) for p in parts[:-1]):
        return "skip"
    if name.startswith("test_") or name.endswith("_test.py") or name in ("conftest.py", "setup.py"):
        return "skip"
    return None


def stdlib_root(path: str | Path | None = None) -> SourceRoot:
    """The Python standard library's own sources (``sysconfig.get_paths()["stdlib"]``)."""
    base = Path(path or sysconfig.get_paths()["stdlib"])
    files: list[str] = []
    n_eval = 0
    for dp, dns, fns in os.walk(base):
        dns[:] = sorted(d for d in dns if d not in SKIP_DIRS and not d.startswith(("config-", ".")))
        rel = Path(dp).relative_to(base).parts
        for fn in sorted(fns):
            if fn.endswith(".py"):
                v = _path_verdict((*rel, fn))
                n_eval += v == "eval"
                if v is None:
                    files.append("/".join((*rel, fn)))
    return SourceRoot("stdlib", base, STDLIB_LICENCE, tuple(sorted(files)), kind="stdlib",
                      version=sys.version.split()[0], licence_source="Python Software Foundation License",
                      eval_named_files=n_eval)


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def site_package_roots(site_dirs: Iterable[str | Path]) -> tuple[list[SourceRoot], list[dict[str, str]]]:
    """(roots, skipped): one root per installed distribution in ``site_dirs`` whose licence is
    permissive, with its ``.py`` files from ``RECORD``; ``skipped`` says why each other
    distribution was left out (licence, this project, an evaluation-set name, no sources)."""
    roots: list[SourceRoot] = []
    skipped: list[dict[str, str]] = []
    seen: set[str] = set()
    for d in site_dirs:
        dists = sorted(md.distributions(path=[str(d)]), key=lambda x: _canon(x.metadata["Name"] or ""))
        for dist in dists:
            name = dist.metadata["Name"] or ""
            key = _canon(name)
            if not key or key in seen:
                continue
            seen.add(key)
            if key == PROJECT_NAME:
                skipped.append({"name": name, "reason": "this project (it holds the benchmark prompts)"})
                continue
            if _eval_name(key):
                skipped.append({"name": name, "reason": "name suggests an evaluation set"})
                continue
            lic, how = classify_licence(dist.metadata)
            if lic is None:
                skipped.append({"name": name, "reason": f"licence not permissive or unknown ({how})"})
                continue
            files, n_eval = [], 0
            for f in dist.files or []:
                parts = f.parts
                if f.suffix != ".py" or ".." in parts or any(p.endswith((".dist-info", ".egg-info")) for p in parts):
                    continue
                v = _path_verdict(parts)
                n_eval += v == "eval"
                if v is None:
                    files.append("/".join(parts))
            if not files:
                skipped.append({"name": name, "reason": "no Python sources in RECORD"})
                continue
            roots.append(SourceRoot(name, Path(dist.locate_file("")), lic, tuple(sorted(set(files))),
                                    version=dist.version or "", licence_source=how, eval_named_files=n_eval))
    return roots, skipped


def default_site_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(p for p in (paths.get("purelib"), paths.get("platlib")) if p and os.path.isdir(p)))


# --------------------------------------------------------------------------- exclusions

_GENERIC_WORDS = set("""a an the this that these those to of in on for and or with is are be it its as by from at
into write implement create python function functions class method code return returns whole full given which
should if not all each any what how does do i you your me my use using s t show give please can could would
here below above following new""".split())
_LEAD_WORDS = {"write", "implement", "create", "a", "an", "the", "python", "function", "class", "script", "program",
               "iterator", "that", "which", "for"}


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9_]+", text.lower())


def _shingles(words: list[str], n: int) -> set[tuple[str, ...]]:
    return set(zip(*(words[i:] for i in range(n))))


def _task_phrase(text: str) -> list[str]:
    """The task a protected prompt asks for: its instruction (the text before any code block)
    without the leading "Write a Python function that" and a trailing "and return the whole
    ..."; empty when fewer than four words remain."""
    head = text.split("```", 1)[0]
    head = re.split(r"\band return\b", head, maxsplit=1, flags=re.I)[0]
    w = _words(head)
    i = 0
    while i < len(w) and i < 6 and w[i] in _LEAD_WORDS:
        i += 1
    w = w[i:]
    return w if len(w) >= 4 else []


class ExclusionFilter:
    """Rejects any text that shares with a protected text (a) an ``n``-word shingle with at
    least three non-generic words (so that "write a python function that checks whether a"
    alone is not a match), or (b) a protected prompt's task phrase (``_task_phrase``).
    ``removed`` counts rejections per protected set."""

    def __init__(self, protected: dict[str, list[str]], n: int = SHINGLE_WORDS):
        self.n = n
        self.shingles: dict[tuple[str, ...], str] = {}
        self.phrases: list[tuple[str, str]] = []
        for name, texts in protected.items():
            for t in texts:
                for sh in _shingles(_words(t), n):
                    if sum(w not in _GENERIC_WORDS for w in sh) >= 3:
                        self.shingles.setdefault(sh, name)
                ph = _task_phrase(t)
                if ph:
                    self.phrases.append((" " + " ".join(ph) + " ", name))
        self.removed: Counter[str] = Counter()

    def match(self, text: str) -> str | None:
        """The protected set ``text`` overlaps, or None."""
        w = _words(text)
        hit = _shingles(w, self.n) & self.shingles.keys()
        if hit:
            return self.shingles[min(hit)]
        joined = " " + " ".join(w) + " "
        for ph, name in self.phrases:
            if ph in joined:
                return name
        return None

    def rejects(self, text: str) -> bool:
        name = self.match(text)
        if name is not None:
            self.removed[name] += 1
        return name is not None


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def protected_texts() -> dict[str, list[str]]:
    """The texts no training item may overlap: the EAGLE benchmark's held-out prompts, the main job's
    chat prompts (``benchmarks/prompts.json``, every kind but ``edit``: the chat, code and math prompts
    ``python -m benchmarks main`` answers) and the code-edit benchmark prompts (kind ``edit``)."""
    from .prompts import HELDOUT_PROMPTS

    pj = _repo_root() / "benchmarks" / "prompts.json"
    if not pj.exists():
        raise FileNotFoundError(f"{pj} (the benchmark prompts) is missing; build the corpus from a checkout of "
                                "the repository or pass protected= explicitly")
    entries = json.loads(pj.read_text())["prompts"]
    return {"heldout": list(HELDOUT_PROMPTS),
            "main_job": [e["text"] for e in entries if e["kind"] != "edit"],
            "code_edit": [e["text"] for e in entries if e["kind"] == "edit"]}


# --------------------------------------------------------------------------- units cut from source


@dataclass
class _Unit:
    """A function, method, class or module docstring cut from one file."""

    kind: str  # "function" | "class" | "module"
    root: SourceRoot
    relpath: str
    file_sha: str
    module: str
    name: str
    qualname: str
    code: str  # dedented source (module: the docstring)
    lines: tuple[int, int] = (0, 0)
    stub: str = ""  # functions: decorators, signature and docstring
    class_name: str = ""
    imports: str = ""
    removed: tuple[str, str, str] | None = None  # classes: (method name, its signature + docstring, class without it)
    dataclass_like: bool = False
    public: bool = True
    used: bool = field(default=False, compare=False)

    def ref(self) -> str:
        return f"{self.qualname}:{self.lines[0]}-{self.lines[1]}" if self.kind != "module" else "<module docstring>"


def _module_name(relpath: str) -> str:
    parts = relpath[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or relpath


def _is_stub(body: list[ast.stmt]) -> bool:
    for st in body:
        if isinstance(st, ast.Pass) or (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)):
            continue
        if isinstance(st, ast.Raise) and st.exc is not None and "NotImplementedError" in ast.unparse(st.exc):
            continue
        return False
    return True


def _has_docstring(node: ast.AST) -> bool:
    body = getattr(node, "body", [])
    return bool(body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str) and len(body[0].value.value.strip()) >= 10


def _start(node: ast.AST) -> int:
    decs = getattr(node, "decorator_list", [])
    return min([node.lineno] + [d.lineno for d in decs])  # type: ignore[attr-defined]


def _snippet(lines: list[str], a: int, b: int) -> str:
    return textwrap.dedent("\n".join(lines[a - 1:b])).strip("\n")


def _function_unit(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str], base: dict[str, Any],
                   qualname: str, class_name: str) -> _Unit | None:
    if not _has_docstring(node):
        return None
    a, b = _start(node), node.end_lineno or node.lineno
    doc = node.body[0]
    if not (FN_LINES[0] <= b - a + 1 <= FN_LINES[1]) or doc.lineno <= node.lineno or len(node.body) < 2:
        return None
    if _is_stub(node.body[1:]) or b - (doc.end_lineno or doc.lineno) < 2:
        return None
    code = _snippet(lines, a, b)
    if len(code) > MAX_SNIPPET_CHARS or "\t" in code:
        return None
    stub = _snippet(lines, a, doc.end_lineno or doc.lineno)
    return _Unit("function", name=node.name, qualname=qualname, code=code, lines=(a, b), stub=stub,
                 class_name=class_name, public=not node.name.startswith("_") and not class_name.startswith("_"),
                 **base)


def _dataclass_like(node: ast.ClassDef) -> bool:
    if node.decorator_list or any(not (isinstance(b, ast.Name) and b.id == "object") for b in node.bases):
        return False
    init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
    if init is None:
        return False
    body = init.body[1:] if _has_docstring(init) else init.body
    n = 0
    for st in body:
        tgts = st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, ast.AnnAssign) else None
        if not tgts or not all(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                               for t in tgts):
            return False
        n += 1
    return n >= 2


def _class_unit(node: ast.ClassDef, lines: list[str], base: dict[str, Any], rng: random.Random) -> _Unit | None:
    if not _has_docstring(node):
        return None
    a, b = _start(node), node.end_lineno or node.lineno
    if not (CLASS_LINES[0] <= b - a + 1 <= CLASS_LINES[1]):
        return None
    code = _snippet(lines, a, b)
    if len(code) > MAX_CLASS_CHARS or "\t" in code:
        return None
    methods = [s for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if len(methods) < 2:
        return None
    removable = [m for m in methods if (m.end_lineno or m.lineno) - m.lineno >= 3 and not _is_stub(
        m.body[1:] if _has_docstring(m) else m.body) and m.body[0].lineno > m.lineno]
    removed = None
    if removable:
        m = rng.choice(removable)
        ma, mb = _start(m), m.end_lineno or m.lineno
        if mb < len(lines) and not lines[mb].strip():
            mb += 1  # the blank line after the method
        sig_end = (m.body[0].end_lineno if _has_docstring(m) else m.body[0].lineno - 1) or m.lineno
        sig = _snippet(lines, ma, sig_end)
        rest = "\n".join(lines[a - 1:ma - 1] + lines[mb:b])
        removed = (m.name, sig, textwrap.dedent(rest).strip("\n"))
    return _Unit("class", name=node.name, qualname=node.name, code=code, lines=(a, b), removed=removed,
                 dataclass_like=_dataclass_like(node), public=not node.name.startswith("_"), **base)


def _file_units(root: SourceRoot, relpath: str, rng: random.Random, counters: Counter[str]) -> list[_Unit]:
    p = root.path / relpath
    try:
        if p.stat().st_size > MAX_FILE_BYTES:
            return []
        text = p.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return []
    lines = text.splitlines()
    module = _module_name(relpath)
    import_nodes = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))][:10]
    imports = "\n".join(line for s in import_nodes for line in lines[s.lineno - 1:s.end_lineno or s.lineno])
    base = {"root": root, "relpath": relpath, "file_sha": sha256_text(text), "module": module, "imports": imports}
    funcs: list[_Unit] = []
    classes: list[_Unit] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            u = _function_unit(node, lines, base, node.name, "")
            if u:
                funcs.append(u)
        elif isinstance(node, ast.ClassDef):
            u = _class_unit(node, lines, base, rng)
            if u:
                classes.append(u)
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    u = _function_unit(sub, lines, base, f"{node.name}.{sub.name}", node.name)
                    if u:
                        funcs.append(u)
    units = rng.sample(funcs, min(len(funcs), PER_FILE_FUNCTIONS)) + rng.sample(classes, min(len(classes),
                                                                                            PER_FILE_CLASSES))
    doc = ast.get_docstring(tree)
    if doc and len(doc.strip()) >= 60:
        first = doc.strip().split("\n\n")[0][:600]
        units.append(_Unit("module", name=module, qualname=module, code=first, **base))
    kept = []
    for u in units:
        low = u.code.lower()
        if any(m in low for m in EVAL_SET_MARKERS):
            counters["eval_name_in_text"] += 1
            continue
        kept.append(u)
    return kept


# --------------------------------------------------------------------------- templates

_FENCE = "```python\n{code}\n```"
EXPLAIN_FUNCTION = [
    "Explain what this Python function from `{module}` does:\n\n" + _FENCE,
    "What does the following code do? Walk me through it step by step.\n\n" + _FENCE,
    "I came across `{name}` in {where}. Can you explain how it works and when I would use it?\n\n" + _FENCE,
    "Summarize the purpose of `{name}` in a few sentences, then describe its parameters, its return value and "
    "any edge cases.\n\n" + _FENCE,
    "Is there anything subtle or surprising in this function? Point out the tricky parts.\n\n" + _FENCE,
    "What is the time and space complexity of this function? Explain your reasoning.\n\n" + _FENCE,
    "Explain this code to a junior developer who knows basic Python.\n\n" + _FENCE,
    "What could go wrong if `{name}` received unexpected input? Look at the code below.\n\n" + _FENCE,
]
EXPLAIN_CLASS = [
    "Explain the design of this class: what state it keeps and how its methods use it.\n\n" + _FENCE,
    "What is the `{name}` class from `{module}` for? Describe its responsibilities.\n\n" + _FENCE,
    "Give a short usage example of this class and explain what each call does.\n\n" + _FENCE,
    "How would you describe `{name}` to someone reviewing {where}? Mention anything unusual.\n\n" + _FENCE,
]
EXPLAIN_API = [  # chat-style questions about the standard library's public API, no code given
    "In Python's `{module}` module, what does `{qualname}` do? When would I use it?",
    "How do I use `{module}.{qualname}`? Give a short example.",
    "What are common mistakes people make with `{module}.{qualname}`?",
]
EXPLAIN_MODULE_STDLIB = [
    "What is the Python module `{module}` for? Give a short example of using it.",
    "I'm new to `{module}`. What problems does it solve, and what are its most important functions?",
    "When should I reach for the `{module}` module instead of writing the code myself?",
]
EXPLAIN_MODULE_PACKAGE = [
    "What does the `{module}` module of the {dist} package do? Its docstring begins:\n\n{code}\n\n"
    "Explain it in plain words.",
    "Here is the module docstring of `{module}` ({dist}):\n\n{code}\n\nWhat would I use this module for?",
]
EDIT_FUNCTION = [
    "Refactor this function so it is easier to read, without changing what it does. Show the complete "
    "refactored function.\n\n" + _FENCE,
    "Annotate this function with type hints for every parameter and for the return value. Give me the full "
    "annotated version.\n\n" + _FENCE,
    "Add error handling to `{name}`: check its arguments and raise exceptions with clear messages where the "
    "input is invalid. Show the updated code.\n\n" + _FENCE,
    "Give the local variables in this function more descriptive names and show the renamed function in "
    "full.\n\n" + _FENCE,
    "Rewrite the docstring of this function in Google style (Args, Returns, Raises) and keep the code as it "
    "is.\n\n" + _FENCE,
    "Add debug logging with the `logging` module at the main steps of this function. Show the full "
    "function.\n\n" + _FENCE,
    "Split this function into smaller helper functions where that makes sense, and show all of them.\n\n"
    + _FENCE,
    "Rename `{name}` to `{new_name}` and update every reference to it in the code below.\n\n" + _FENCE,
    "Strip the comments and the docstring from this function and show only the code.\n\n" + _FENCE,
]
EDIT_CLASS = [
    "Annotate the methods of this class with type hints and show the complete class.\n\n" + _FENCE,
    "Refactor this class to make it easier to read without changing its behaviour. Show all of it.\n\n" + _FENCE,
    "Add input validation to the methods of `{name}` that take arguments, raising clear exceptions. Show the "
    "updated class.\n\n" + _FENCE,
]
EDIT_DATACLASS = [
    "Convert this class to a `@dataclass`, keeping its behaviour. Show the whole converted class.\n\n" + _FENCE,
    "Can `{name}` be written as a dataclass? Rewrite it with `dataclasses.dataclass` and explain what "
    "changed.\n\n" + _FENCE,
]
COMPLETE_FUNCTION = [
    "Complete the body of this function so that it does what its docstring says:\n\n" + _FENCE,
    "Implement the function below. Keep the signature and the docstring as they are.\n\n" + _FENCE,
    "Here is a function signature with its docstring from `{module}`. Write the implementation.\n\n" + _FENCE,
    "The module starts with these imports:\n\n```python\n{imports}\n```\n\nWrite the body of this "
    "function:\n\n" + _FENCE,
]
COMPLETE_METHOD = [
    "This is a method of the class `{class_name}` in `{module}`. Write its body.\n\n" + _FENCE,
    "Implement this method of `{class_name}` according to its docstring:\n\n" + _FENCE,
]
COMPLETE_CLASS = [
    "The class below is missing its method `{method}`. Write that method so it fits the rest of the "
    "class.\n\n" + _FENCE + "\n\nIts signature is:\n\n```python\n{sig}\n```",
    "Someone deleted the `{method}` method from this class. Based on the remaining code and the docstrings, "
    "write it again.\n\n" + _FENCE,
    "Add the method below to this class, consistent with the other methods.\n\n```python\n{sig}\n```\n\n"
    "The class:\n\n" + _FENCE,
]
FOLLOWUP_CODE = [
    "Now write unit tests for it with pytest.",
    "Can you make it faster?",
    "Add type hints and a docstring to your version.",
    "Can you make it shorter without making it harder to read?",
    "What is the time complexity of your solution?",
    "Now handle invalid input as well.",
    "Explain your code line by line.",
    "Rewrite it without using any imports.",
    "How would you test the edge cases? Write the tests.",
]
FOLLOWUP_EXPLAIN = [
    "Can you show an example of calling it?",
    "How could this code be simplified?",
    "Write a few unit tests for it.",
    "What would happen if the input were empty?",
    "Could you rewrite it in a more modern Python style?",
    "Summarize your explanation in two sentences.",
]


def _where(u: _Unit) -> str:
    if u.root.kind == "stdlib":
        return f"the Python standard library (`{u.module}`)"
    return f"the {u.root.name} package (`{u.module}`)"


# --------------------------------------------------------------------------- the build


def _split(n_items: int) -> dict[str, int]:
    """Category sizes for ``n_items`` (largest remainder over DEFAULT_MIX; coding capped at 712)."""
    from .prompts import train_prompts

    raw = {c: n_items * w for c, w in DEFAULT_MIX.items()}
    out = {c: int(v) for c, v in raw.items()}
    for c in sorted(raw, key=lambda c: (-(raw[c] - out[c]), CATEGORIES.index(c)))[:n_items - sum(out.values())]:
        out[c] += 1
    out["coding"] = min(out["coding"], len(train_prompts()))
    return out


class _Builder:
    def __init__(self, seed: int, filt: ExclusionFilter):
        self.rng = random.Random(f"corpus:{seed}")
        self.filt = filt
        self.items: list[CorpusItem] = []
        self.removed_by_category: Counter[str] = Counter()
        self.seen_text: set[str] = set()

    def add(self, category: str, content: str, u: _Unit | None, *, root: str = "", path: str = "",
            sha: str = "", ref: str = "") -> bool:
        if content in self.seen_text:
            return False
        if self.filt.rejects(content):
            self.removed_by_category[category] += 1
            if u is not None:
                u.used = True  # a unit that overlaps a protected text is never tried again
            return False
        self.seen_text.add(content)
        if u is not None:
            root, path, sha, ref = u.root.name, u.relpath, u.file_sha, u.ref()
            u.used = True
        self.items.append(CorpusItem(category, ({"role": "user", "content": content},), root, path, sha, ref))
        return True

    def fill(self, category: str, want: int, pools: list[tuple[list[_Unit], float]], make) -> int:
        """Take units from ``pools`` (each with the share of ``want`` it should give) until ``want``
        items of ``category`` exist; a short pool's share passes on to the next pools."""
        got = 0
        quota = 0.0
        for i, (pool, share) in enumerate(pools):
            quota += want * share if i < len(pools) - 1 else want - quota
            for u in pool:
                if got >= round(quota):
                    break
                if u.used:
                    continue
                content = make(u)
                if content and self.add(category, content, u):
                    got += 1
        return got


def _fmt(tpl: str, u: _Unit, **kw: str) -> str:
    vals = {"module": u.module, "name": u.name, "qualname": u.qualname, "where": _where(u), "dist": u.root.name,
            "class_name": u.class_name, "imports": u.imports, "code": u.code}
    vals.update(kw)
    return tpl.format(**vals)


def build_corpus(n_items: int = DEFAULT_N_ITEMS, seed: int = 0, roots: Sequence[SourceRoot | str | Path] | None = None,
                 protected: dict[str, list[str]] | None = None, log=None) -> Corpus:
    """Build about ``n_items`` items (category sizes from ``DEFAULT_MIX``) and their manifest.

    ``roots``: None for the standard library plus the permissive installed distributions
    (``default_site_dirs()``); else ``SourceRoot`` objects (used as given) and site-packages
    style directories (each distribution inside is judged by its licence metadata).
    ``protected``: the texts no item may overlap (default ``protected_texts()``).
    A category may come out smaller than asked when the sources run short; the manifest
    records asked and built sizes per category."""
    from .prompts import train_prompts

    t0 = time.time()
    want = _split(n_items)
    protected = protected_texts() if protected is None else protected
    filt = ExclusionFilter(protected)
    skipped: list[dict[str, str]] = []
    src_roots: list[SourceRoot] = []
    for r in ([stdlib_root(), *default_site_dirs()] if roots is None else roots):
        if isinstance(r, SourceRoot):
            src_roots.append(r)
        else:
            rs, sk = site_package_roots([r])
            src_roots += rs
            skipped += sk
    names = [r.name for r in src_roots]
    if len(set(names)) != len(names):
        raise ValueError(f"source root names must be unique: {names}")
    n_pkg = sum(r.kind != "stdlib" for r in src_roots)
    src_roots = [replace(r, weight=max(1, n_pkg // 3)) if r.kind == "stdlib" else r for r in src_roots]
    counters: Counter[str] = Counter()

    # ---- scan: round-robin over roots (weighted), each root's files in a seeded order
    need = {"function": want["explain"] * 0.55 + want["edit"] * 0.85 + want["complete_function"],
            "class": want["explain"] * 0.2 + want["edit"] * 0.05 + want["complete_class"] * 1.15,
            "module": want["explain"] * 0.15}
    queues: dict[str, list[str]] = {}
    for r in src_roots:
        files = list(r.files)
        random.Random(f"corpus:{seed}:{r.name}").shuffle(files)
        queues[r.name] = files
    pools: dict[str, list[_Unit]] = {"function": [], "class": [], "module": []}
    code_seen: set[str] = set()
    file_rng = random.Random(f"corpus-units:{seed}")
    scanned = 0

    def enough() -> bool:
        return all(len(pools[k]) >= need[k] * SCAN_MARGIN for k in pools)

    active = list(src_roots)
    while active and not enough():
        for r in list(active):
            for _ in range(r.weight):
                q = queues[r.name]
                if not q:
                    active.remove(r)
                    break
                scanned += 1
                for u in _file_units(r, q.pop(), file_rng, counters):
                    h = sha256_text(u.code)
                    if h not in code_seen:
                        code_seen.add(h)
                        pools[u.kind].append(u)
            if enough():
                break
    for k in pools:
        random.Random(f"corpus:{seed}:pool:{k}").shuffle(pools[k])
    fns, classes, modules = pools["function"], pools["class"], pools["module"]

    # ---- single-turn items
    b = _Builder(seed, filt)
    rng = b.rng
    coding = train_prompts()[:want["coding"]]
    coding_sha = sha256_text(json.dumps(train_prompts()))
    for i, p in enumerate(coding):
        b.add("coding", p, None, root=PROJECT_NAME, path="vllm_easyspec_train/prompts.py", sha=coding_sha,
              ref=f"train_prompts()[{i}]")

    def explain_fn(u: _Unit) -> str:
        if u.root.kind == "stdlib" and u.public and not u.module.startswith("_") and rng.random() < 0.2:
            return _fmt(rng.choice(EXPLAIN_API), u)
        return _fmt(rng.choice(EXPLAIN_FUNCTION), u)

    def explain_module(u: _Unit) -> str:
        if u.root.kind == "stdlib":
            return "" if u.module.startswith("_") or "._" in u.module else _fmt(rng.choice(EXPLAIN_MODULE_STDLIB), u)
        return _fmt(rng.choice(EXPLAIN_MODULE_PACKAGE), u)

    def edit_fn(u: _Unit) -> str:
        return _fmt(rng.choice(EDIT_FUNCTION), u, new_name=u.name.strip("_") + "_impl")

    def edit_class(u: _Unit) -> str:
        return _fmt(rng.choice(EDIT_DATACLASS if u.dataclass_like else EDIT_CLASS), u)

    def complete_fn(u: _Unit) -> str:
        if u.class_name:
            return _fmt(rng.choice(COMPLETE_METHOD), u, code=u.stub)
        tpls = COMPLETE_FUNCTION if u.imports else COMPLETE_FUNCTION[:3]
        return _fmt(rng.choice(tpls), u, code=u.stub)

    def complete_class(u: _Unit) -> str:
        if u.removed is None:
            return ""
        method, sig, rest = u.removed
        return _fmt(rng.choice(COMPLETE_CLASS), u, code=rest, method=method, sig=sig)

    # classes with a removable method go to complete_class first; dataclass-like ones to edit
    with_method = [u for u in classes if u.removed is not None]
    dc_like = [u for u in classes if u.dataclass_like]
    built = {"coding": len(b.items)}
    built["complete_class"] = b.fill("complete_class", want["complete_class"], [(with_method, 1.0)], complete_class)
    built["edit"] = b.fill("edit", want["edit"], [(dc_like, 0.03), (classes, 0.04), (fns, 0.93)],
                           lambda u: edit_class(u) if u.kind == "class" else edit_fn(u))
    built["explain"] = b.fill("explain", want["explain"], [(modules, 0.15), (classes, 0.2), (fns, 0.65)],
                              lambda u: explain_module(u) if u.kind == "module"
                              else _fmt(rng.choice(EXPLAIN_CLASS), u) if u.kind == "class" else explain_fn(u))
    built["complete_function"] = b.fill("complete_function", want["complete_function"], [(fns, 1.0)], complete_fn)
    singles = b.items
    rng.shuffle(singles)

    # ---- follow-ups: a second turn after the target's answer to a single-turn item
    followups: list[CorpusItem] = []
    order = list(range(len(singles)))
    rng.shuffle(order)
    for i in order:
        if len(followups) >= want["followup"]:
            break
        it = singles[i]
        text = rng.choice(FOLLOWUP_EXPLAIN if it.category == "explain" else FOLLOWUP_CODE)
        cand = CorpusItem("followup", it.messages, it.source_root, it.source_path, it.source_sha256,
                          f"{it.category}:{it.source_ref}", followup=text)
        if filt.rejects(text):
            b.removed_by_category["followup"] += 1
            continue
        followups.append(cand)
    built["followup"] = len(followups)
    items = singles + followups

    # ---- manifest
    by_root: dict[str, dict[str, Any]] = {}
    file_shas: dict[str, dict[str, str]] = {}
    for it in items:
        e = by_root.setdefault(it.source_root, {"items": 0, "characters": 0})
        e["items"] += 1
        e["characters"] += len(it.text())
        file_shas.setdefault(it.source_root, {})[it.source_path] = it.source_sha256
    root_info = {r.name: r for r in src_roots}
    roots_manifest = []
    for name in sorted(by_root, key=lambda n: (n != PROJECT_NAME, n != "stdlib", n.lower())):
        r = root_info.get(name)
        used = file_shas[name]
        entry = {"name": name, "kind": r.kind if r else "project", "version": r.version if r else "",
                 "licence": r.licence if r else PROJECT_LICENCE,
                 "licence_source": r.licence_source if r else "pyproject.toml",
                 "path": str(r.path) if r else "vllm_easyspec_train/prompts.py", "files_used": len(used),
                 "items": by_root[name]["items"], "characters": by_root[name]["characters"],
                 "files_sha256": sha256_text("\n".join(f"{p}\t{used[p]}" for p in sorted(used)))}
        roots_manifest.append(entry)
    eval_files = sum(r.eval_named_files for r in src_roots)
    manifest = {
        "builder": "vllm_easyspec_train.corpus.build_corpus",
        "n_items": len(items), "n_items_requested": n_items, "seed": seed, "python": sys.version.split()[0],
        "categories": {c: {"requested": want[c], "built": built.get(c, 0)} for c in CATEGORIES},
        "n_first_round_prompts": len({json.dumps(it.first_round_prompt()) for it in items}),
        "roots": roots_manifest,
        "roots_available": len(src_roots), "files_scanned": scanned,
        "unit_pools": {k: len(v) for k, v in pools.items()},
        "unit_pools_needed": {k: int(need[k] * SCAN_MARGIN) for k in need},
        "skipped_roots": skipped,
        "exclusions": {
            "protected_sets": {k: len(v) for k, v in protected.items()},
            "protected_sha256": sha256_text(json.dumps(protected, sort_keys=True)),
            "removed_overlapping_protected": {k: filt.removed.get(k, 0) for k in protected},
            "removed_by_category": dict(sorted(b.removed_by_category.items())),
            "eval_named_files": eval_files,
            "eval_named_snippets": counters["eval_name_in_text"],
            "eval_named_roots": [s["name"] for s in skipped if "evaluation set" in s["reason"]],
        },
        "items_sha256": items_sha256(items),
    }
    return Corpus(items, manifest, round(time.time() - t0, 2))


# --------------------------------------------------------------------------- token estimate


def default_tokenizer_dir() -> Path:
    return Path.home() / ".cache" / "vllm-easyspec" / "models" / "qwen2.5-coder-0.5b-instruct-float32"


def estimate_tokens(corpus: Corpus, tokenizer: Any = None, max_answer_tokens: int = 256) -> dict[str, Any]:
    """Upper-bound token count of the self-distilled data: every unique first-round prompt and
    every follow-up's second-round prompt (first prompt + a full answer + the follow-up), each
    with up to ``max_answer_tokens`` answer tokens.  Prompt tokens come from ``tokenizer``
    (with its chat template's per-turn overhead) when given, else characters / 3.5."""
    firsts = list(dict.fromkeys(json.dumps(it.first_round_prompt()) for it in corpus.items))
    first_text = {f: "\n".join(m["content"] for m in it.messages) for it in corpus.items
                  for f in [json.dumps(it.first_round_prompt())]}
    fups = [it for it in corpus.items if it.followup]
    if tokenizer is not None:
        def count(texts: list[str]) -> list[int]:
            return [len(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
        overhead = 0
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                                tokenize=True)
            overhead = len(ids["input_ids"] if hasattr(ids, "keys") else ids) - 1
        how = f"tokenizer {getattr(tokenizer, 'name_or_path', '')}"
    else:
        def count(texts: list[str]) -> list[int]:
            return [int(len(t) / 3.5) + 1 for t in texts]
        overhead = 20
        how = "characters / 3.5"
    n1 = count([first_text[f] for f in firsts])
    p1 = sum(n1) + overhead * len(firsts)
    idx = {f: i for i, f in enumerate(firsts)}
    nf = count([it.followup or "" for it in fups])
    p2 = sum(n1[idx[json.dumps(it.first_round_prompt())]] + max_answer_tokens + k + 2 * overhead
             for it, k in zip(fups, nf))
    answers = (len(firsts) + len(fups)) * max_answer_tokens
    return {"counted_with": how, "first_round_prompts": len(firsts), "second_round_prompts": len(fups),
            "prompt_tokens": p1 + p2, "answer_tokens_at_most": answers, "total_tokens_at_most": p1 + p2 + answers,
            "max_answer_tokens": max_answer_tokens}


def _load_tokenizer(path: str | None) -> Any:
    p = Path(path) if path else default_tokenizer_dir()
    if not (p / "tokenizer_config.json").exists() and not (p / "tokenizer.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_easyspec_train.corpus", description=__doc__.split("\n")[0])
    ap.add_argument("--n-items", type=int, default=DEFAULT_N_ITEMS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default=None, help=f"for the token estimate (default {default_tokenizer_dir()}, "
                                                      "else characters / 3.5)")
    ap.add_argument("--max-answer-tokens", type=int, default=256)
    ap.add_argument("--out", default=None, help="write the manifest and the items as JSON lines here (.gz: "
                                               "compressed); the trainer reads it with --corpus-file")
    ap.add_argument("--manifest", default=None, help="write the manifest here")
    a = ap.parse_args(argv)
    c = build_corpus(a.n_items, a.seed)
    if a.out:
        c.write_jsonl(a.out)
    if a.manifest:
        Path(a.manifest).write_text(json.dumps(c.manifest, indent=2) + "\n")
    m = c.manifest
    print(f"corpus: {len(c.items)} items in {c.seconds:.1f} s from {len(m['roots'])} roots "
          f"({m['files_scanned']} files scanned, {len(m['skipped_roots'])} distributions skipped)")
    for cat, v in m["categories"].items():
        print(f"  {cat:18s} {v['built']:6d} (asked {v['requested']})")
    print("  exclusions:", json.dumps(m["exclusions"]["removed_overlapping_protected"]),
          "eval-named files", m["exclusions"]["eval_named_files"], "snippets", m["exclusions"]["eval_named_snippets"])
    est = estimate_tokens(c, _load_tokenizer(a.tokenizer), a.max_answer_tokens)
    print("  tokens:", json.dumps(est))
    return 0


if __name__ == "__main__":
    sys.exit(main())
