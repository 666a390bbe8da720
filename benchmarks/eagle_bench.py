"""EAGLE heads vs the other drafts on Qwen2.5-Coder-0.5B-Instruct, through the shared harness.

    python -m benchmarks.eagle_bench speed [--batch 1 4] [--ks 2 3 4 5 6] [--max-tokens 96] [--dtype float32]
        [--tree-budgets 4 8 16 32] [--lookup-nodes 4] [--lookup-budgets 4] [--policy '{"4": {"chain": 2}, "8": 0}' ...]
        [--prompts heldout|edit|chat|mixed] [--no-draft-model] [--no-eagle1] [--auto 16 ...]
    python -m benchmarks.eagle_bench replay            # offline acceptance: held-out vs training prompts
    python -m benchmarks.eagle_bench distribution      # T=0.7 engine-level chi-square with EAGLE drafts (tiny target)

Setups (one fresh engine each, same held-out prompts, greedy): vanilla; vLLM ngram (k=4, lookup
2..4); vLLM draft_model with SmolLM2-135M across vocabularies (k=3); vLLM eagle3 with our head
``heads/qwen2.5-coder-0.5b-instruct-eagle3`` at k = 2..6; with ``--tree-budgets``, the plugin's EAGLE-2
trees with the same head (``EAGLE_TREES``), merged with prompt lookup with ``--lookup-nodes``; with ``--auto``, the
merged tree of each budget given as the candidate of ``easyspec.tree.auto`` (the controller chooses every
request's nodes every step); and, for
drafting cost only, an untrained EAGLE-1 head (full-vocabulary lm_head) at k=3.  The prompts are
``vllm_easyspec_train.prompts.HELDOUT_PROMPTS``: tasks that appear in no training prompt.
Results: ``benchmarks/results/eagle_speed_b{B}.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from benchmarks.harness import (
    DEFAULT_REPEATS,
    RESULTS_DIR,
    Setup,
    Workload,
    load_prompts,
    run_setups,
    select_setups,
    write_results,
)
from vllm_easyspec.models import fetch_model
from vllm_easyspec_train.prompts import HELDOUT_PROMPTS

ROOT = Path(__file__).resolve().parents[1]
HEAD3 = ROOT / "heads" / "qwen2.5-coder-0.5b-instruct-eagle3"
QWEN = "qwen2.5-coder-0.5b-instruct"
SMOL = "smollm2-135m-instruct"


def _untrained_eagle1(target: str) -> Path:
    """A random EAGLE-1 head in the reference layout (drafting-cost measurement only)."""
    import torch

    from vllm_easyspec_train.checkpoint import save_head
    from vllm_easyspec_train.model import EagleHead, head_config_from_target

    out = RESULTS_DIR / "eagle1_untrained_head"
    if not (out / "model.safetensors").exists():
        cfg = json.loads((Path(target) / "config.json").read_text())
        torch.manual_seed(0)
        save_head(EagleHead(head_config_from_target(cfg, "eagle", intermediate_size=2432)), out)
    return out


# The plugin's EAGLE-2 dynamic trees at node budgets 4..32: top_k children per kept node, depth levels,
# budget nodes kept after reranking by cumulative draft log-probability.
EAGLE_TREES = {
    4: {"top_k": 2, "depth": 3, "budget": 4},
    8: {"top_k": 3, "depth": 4, "budget": 8},
    16: {"top_k": 4, "depth": 5, "budget": 16},
    32: {"top_k": 6, "depth": 6, "budget": 32},
}


def _head_setups(label: str, head: str, batch: int, ks: list[int], ks_batched: list[int] | None,
                 tree_budgets: list[int], lookup_nodes: int, lookup_budgets: list[int] | None,
                 policies: list[dict], auto_budgets: list[int]) -> list[Setup]:
    """Every EAGLE setup of one head: vLLM's eagle3 chains, the plugin's trees, merged, with policies, auto.
    ``label``: prefixed to the setup names (``LABEL:eagle3-k3``) when several heads run side by side."""
    setups: list[Setup] = []
    spec = {"method": "eagle3", "model": head}
    whose = f"head {label}" if label else "our head"

    def add(name: str, description: str, speculative: dict, additional: dict | None = None) -> None:
        setups.append(Setup(f"{label}:{name}" if label else name, description, speculative, additional))

    for k in (ks if batch == 1 or not ks_batched else ks_batched):
        add(f"eagle3-k{k}", f"vLLM eagle3, {whose}", spec | {"num_speculative_tokens": k})
    for budget in tree_budgets:
        tree = EAGLE_TREES[budget]
        add(f"eagle3-tree-{budget}", f"plugin EAGLE-2 tree, {whose}", spec, {"easyspec": {"tree": tree}})
        if lookup_nodes and (lookup_budgets is None or budget in lookup_budgets):
            merged = tree | {"sources": {"prompt_lookup": {"nodes": lookup_nodes}}}
            add(f"eagle3-tree-{budget}+lookup-{lookup_nodes}", f"plugin EAGLE-2 tree merged with prompt lookup, {whose}",
                spec, {"easyspec": {"tree": merged}})
            for policy in policies if batch > 1 else ():
                table = ",".join(f"{k}:{v['chain'] if isinstance(v, dict) else v}{'c' if isinstance(v, dict) else ''}"
                                 for k, v in policy.items())
                add(f"eagle3-tree-{budget}+lookup-{lookup_nodes}@{table}",
                    f"the merged tree, node limit following the batch (budget_by_batch), {whose}",
                    spec, {"easyspec": {"tree": merged | {"budget_by_batch": policy}}})
    for budget in auto_budgets:
        candidate = EAGLE_TREES[budget] | {"sources": {"prompt_lookup": {"nodes": max(lookup_nodes, 4)}}}
        add(f"eagle3-tree-{budget}+lookup@auto", f"the controller on the merged tree (auto), {whose}",
            spec, {"easyspec": {"tree": candidate | {"auto": True}}})
    return setups


def speed(batches: list[int], ks: list[int], max_tokens: int, num_prompts: int, eagle1: bool,
          ks_batched: list[int] | None = None, dtype: str = "bfloat16",
          repeats: int = DEFAULT_REPEATS, tree_budgets: list[int] = (), draft_model: bool = True,
          lookup_nodes: int = 0, lookup_budgets: list[int] | None = None, policies: list[dict] = (),
          prompt_set: str = "heldout", only: str | None = None, auto_budgets: list[int] = (),
          heads: list[tuple[str, Path]] | None = None) -> None:
    """``heads``: (label, folder) of each head to run side by side; default the committed head, unlabelled."""
    heads = heads or [("", HEAD3)]
    target = str(fetch_model(QWEN))
    smol = str(fetch_model(SMOL))
    command = "python -m benchmarks.eagle_bench " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    for b in batches:
        setups = [
            Setup("vanilla", "no speculation"),
            Setup("ngram-k4", "vLLM ngram, lookup 2..4",
                  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
        ]
        if draft_model:
            setups.append(Setup("smollm2-k3", "vLLM draft_model SmolLM2-135M, heterogeneous vocab",
                                {"method": "draft_model", "model": smol, "num_speculative_tokens": 3,
                                 "use_heterogeneous_vocab": True}))
        for label, head in heads:
            setups += _head_setups(label if len(heads) > 1 else "", str(head), b, ks, ks_batched, tree_budgets,
                                   lookup_nodes, lookup_budgets, policies, auto_budgets)
        if eagle1 and b == 1:
            setups.append(Setup("eagle1-untrained-k3", "vLLM eagle, random head: drafting cost only",
                                {"method": "eagle", "model": str(_untrained_eagle1(target)),
                                 "num_speculative_tokens": 3}))
        prompts = _prompts(prompt_set, max(num_prompts, b))
        setups = select_setups(setups, only)
        wl = Workload(target=target, prompts=prompts, max_tokens=max_tokens, batch_size=b, dtype=dtype)
        rows = run_setups(setups, wl, repeats=repeats)
        stem = (f"eagle_{'auto_' if auto_budgets else ''}{'tree_' if tree_budgets else ''}speed"
                f"{'' if prompt_set == 'heldout' else '_' + prompt_set}{'_heads' if len(heads) > 1 else ''}_b{b}"
                + ("" if dtype == "bfloat16" else f"_{dtype}"))
        described = {"edit": "code-edit", "heldout": "held-out"}.get(prompt_set, prompt_set)
        paths = write_results(rows, stem,
                              f"EAGLE on Qwen2.5-Coder-0.5B, batch {b}, {dtype}, greedy, {len(prompts)} {described} "
                              "prompts", command)
        print(paths["md"].read_text())


def _prompts(prompt_set: str, count: int) -> list[str]:
    """``heldout``: the EAGLE benchmark's held-out tasks; ``edit``: code edits (the answer repeats the prompt's
    code, where lookup should win); ``chat``: the main job's chat prompts; ``mixed``: the three interleaved."""
    classes = {
        "heldout": lambda n: HELDOUT_PROMPTS[:n],
        "edit": lambda n: load_prompts(limit=n, kinds=("edit",)),
        "chat": lambda n: load_prompts(limit=n),
    }
    if prompt_set != "mixed":
        return classes[prompt_set](count)
    per_class = [classes[name](count) for name in ("heldout", "edit", "chat")]
    return [p for group in zip(*per_class) for p in group][:count]


def distribution(num_samples: int) -> None:
    """Engine-level chi-square at T=0.7 with trained EAGLE / EAGLE-3 drafts on the tiny test target
    (the foundation's helper ``tests/distribution.py``: exact two-token law vs seeded samples)."""
    import os
    import random
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "tests" / "eagle"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from distribution import run_distribution_test
    from eagle_helpers import train_args
    from tiny_models import build_tiny_model, build_tiny_tokenizer
    from vllm import LLM

    from vllm_easyspec.instruments.metrics import read_spec_decode_counters
    from vllm_easyspec_train.trainer import train

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = build_tiny_tokenizer(tmp / "tok")
        target = build_tiny_model(tmp / "llama", tok, "llama", num_layers=4, seed=1)
        text = tmp / "text"
        text.mkdir()
        rng = random.Random(0)
        for i in range(24):
            (text / f"f{i}.py").write_text(" ".join(f"w{rng.randrange(3, 64)}" for _ in range(200)))
        for fmt in ("eagle", "eagle3"):
            extra = ["--max-steps", "40", "--eval-every", "40", "--save-every", "40", "--lr", "3e-3"]
            if fmt == "eagle3":
                extra += ["--draft-vocab-size", "48"]
            res = train(train_args(target, tmp / f"head_{fmt}", tmp / "work", text, fmt, extra))
            llm = LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
                      max_num_seqs=64, disable_log_stats=False,
                      speculative_config={"method": fmt, "model": str(tmp / f"head_{fmt}"),
                                          "num_speculative_tokens": 3})
            before = read_spec_decode_counters(llm)
            chi = run_distribution_test(llm, target, temperature=0.7, num_samples=num_samples)
            c = read_spec_decode_counters(llm) - before
            rows.append({"method": fmt, "statistic": chi.statistic, "dof": chi.degrees_of_freedom,
                         "p_value": chi.p_value, "num_samples": chi.num_samples, "passes": chi.passes,
                         "heldout_agreement": res["heldout"]["agreement"],
                         "acceptance_rate": c.acceptance_rate,
                         "per_position_acceptance": c.per_position_acceptance})
            llm.llm_engine.engine_core.shutdown()
            del llm
    out = RESULTS_DIR / "eagle_distribution.json"
    out.write_text(json.dumps({"temperature": 0.7, "target": "tiny llama (tests/tiny_models.py)",
                               "command": "python -m benchmarks.eagle_bench distribution", "rows": rows},
                              indent=2) + "\n")
    print(json.dumps(rows, indent=2))


def replay(num_prompts: int, k: int, max_tokens: int) -> None:
    """Offline acceptance of the committed head (transformers, float32, greedy) on the held-out prompts and
    on as many training prompts: separates how well the head generalises from how vLLM runs it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_easyspec.models import prompt_token_ids
    from vllm_easyspec_train.checkpoint import load_head
    from vllm_easyspec_train.prompts import train_prompts
    from vllm_easyspec_train.simulate import replay_acceptance

    target = str(fetch_model(QWEN))
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    head = load_head(HEAD3)
    result = {"command": "python -m benchmarks.eagle_bench " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
              "k": k, "max_tokens": max_tokens}
    for name, prompts in (("heldout", HELDOUT_PROMPTS[:num_prompts]), ("train", train_prompts()[:num_prompts])):
        accepted, rounds = [0] * k, 0
        for text in prompts:
            ids = prompt_token_ids(tokenizer, text)
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
            r = replay_acceptance(head, target, ids, out[0, len(ids):].tolist(), k, model=model)
            rounds += r["rounds"]
            accepted = [a + b for a, b in zip(accepted, r["accepted_per_pos"], strict=True)]
        result[name] = {"num_prompts": len(prompts), "per_position_acceptance": [a / rounds for a in accepted],
                        "mean_acceptance_length": 1 + sum(accepted) / rounds}
        print(name, json.dumps(result[name]))
    (RESULTS_DIR / "eagle_replay.json").write_text(json.dumps(result, indent=2) + "\n")


def _heads(specs: list[str]) -> list[tuple[str, Path]]:
    heads = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not (Path(path) / "config.json").exists():
            raise SystemExit(f"--heads takes LABEL=HEAD_FOLDER (a folder with config.json); got {spec!r}")
        heads.append((label, Path(path)))
    return heads


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    s.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    s.add_argument("--max-tokens", type=int, default=96)
    s.add_argument("--num-prompts", type=int, default=4)
    s.add_argument("--ks-batched", type=int, nargs="+", default=None, help="k values for batch > 1")
    s.add_argument("--no-eagle1", action="store_true")
    s.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="float32 makes output identity with vanilla exact at batch > 1")
    s.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help="engine processes per setup, run interleaved; speeds are medians with their min-max")
    s.add_argument("--tree-budgets", type=int, nargs="*", default=[], choices=sorted(EAGLE_TREES),
                   help="also run the plugin's EAGLE-2 dynamic trees at these node budgets")
    s.add_argument("--lookup-nodes", type=int, default=0,
                   help="also run each tree merged with this many prompt-lookup nodes")
    s.add_argument("--lookup-budgets", type=int, nargs="*", default=None,
                   help="merge lookup into the trees of these budgets only (default: every --tree-budgets)")
    s.add_argument("--policy", type=json.loads, nargs="*", default=[],
                   help='at batch > 1 also run each merged tree with each of these budget_by_batch tables, e.g. '
                        '\'{"4": {"chain": 2}, "8": 0}\'')
    s.add_argument("--auto", type=int, nargs="*", default=[], choices=sorted(EAGLE_TREES),
                   help="tree budgets whose merged tree is the candidate of an easyspec.tree.auto setup")
    s.add_argument("--prompts", choices=("heldout", "edit", "chat", "mixed"), default="heldout",
                   help="held-out EAGLE prompts (default) or the code-edit set, where prompt lookup should matter")
    s.add_argument("--no-draft-model", action="store_true", help="skip the SmolLM2 draft_model setup")
    s.add_argument("--heads", nargs="+", default=None, metavar="LABEL=HEAD",
                   help="run every EAGLE setup with each of these heads side by side (setup names get LABEL:); "
                        f"default: {HEAD3.relative_to(ROOT)}")
    s.add_argument("--only", default=None, help="run only the setups whose name matches this regex (and vanilla)")
    r = sub.add_parser("replay")
    r.add_argument("--num-prompts", type=int, default=8)
    r.add_argument("-k", type=int, default=3)
    r.add_argument("--max-tokens", type=int, default=64)
    d = sub.add_parser("distribution")
    d.add_argument("--num-samples", type=int, default=2000)
    a = ap.parse_args()
    if a.cmd == "speed":
        speed(a.batch, a.ks, a.max_tokens, a.num_prompts, not a.no_eagle1, a.ks_batched, a.dtype, a.repeats,
              a.tree_budgets, not a.no_draft_model, a.lookup_nodes, a.lookup_budgets, a.policy, a.prompts, a.only,
              a.auto, _heads(a.heads) if a.heads else None)
    elif a.cmd == "replay":
        replay(a.num_prompts, a.k, a.max_tokens)
    else:
        distribution(a.num_samples)
