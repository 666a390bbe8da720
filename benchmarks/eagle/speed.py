"""The EAGLE-3 head against the other drafts on Qwen2.5-Coder-0.5B-Instruct, through the shared harness.

Setups (one fresh engine each, same held-out prompts, greedy): vanilla; vLLM ngram (k=4, lookup 2..4); vLLM
draft_model with SmolLM2-135M across vocabularies (k=3); vLLM eagle3 with the committed head
``heads/qwen2.5-coder-0.5b-instruct-eagle3`` at k = 2..6; with ``--tree-budgets``, the plugin's EAGLE-2 trees with
the same head (``benchmarks.defaults.EAGLE_TREES``), merged with prompt lookup with ``--lookup-nodes``; with
``--auto``, the merged tree of each budget given as the candidate of ``easyspec.tree.auto`` (the controller
chooses every request's nodes every step); and, for drafting cost only, an untrained EAGLE-1 head
(full-vocabulary lm_head) at k=3, built for the run in a temporary folder. The prompts (``--prompts``) are
``benchmarks.defaults.class_prompts``: by default the held-out tasks, which appear in no training prompt.
Results: ``benchmarks/results/eagle_speed_b{B}.{json,md,png}`` (``eagle_tree_speed_*`` with trees, ...).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.defaults import EAGLE_TREES, HEAD3, PROMPT_CLASSES, QWEN, REPO_ROOT, SMOL, class_prompts
from benchmarks.harness.processes import run_setups
from benchmarks.harness.report import write_results
from benchmarks.harness.setups import DEFAULT_REPEATS, Setup, Workload, select_setups
from vllm_easyspec.models import fetch_model


def _untrained_eagle1(target: str, scratch: Path) -> Path:
    """A random EAGLE-1 head in the reference layout (drafting-cost measurement only), in ``scratch``."""
    import torch

    from vllm_easyspec_train.checkpoint import save_head
    from vllm_easyspec_train.model import EagleHead, head_config_from_target

    out = scratch / "eagle1_untrained_head"
    if not (out / "model.safetensors").exists():
        cfg = json.loads((Path(target) / "config.json").read_text())
        torch.manual_seed(0)
        save_head(EagleHead(head_config_from_target(cfg, "eagle", intermediate_size=2432)), out)
    return out


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
          heads: list[tuple[str, Path]] | None = None, command: str = "") -> None:
    """``heads``: (label, folder) of each head to run side by side; default the committed head, unlabelled.
    ``command``: the command line the result files name."""
    heads = heads or [("", HEAD3)]
    target = str(fetch_model(QWEN))
    smol = str(fetch_model(SMOL))
    with tempfile.TemporaryDirectory(prefix="eagle1-untrained-") as scratch:  # built once, if asked for
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
                                    {"method": "eagle", "model": str(_untrained_eagle1(target, Path(scratch))),
                                     "num_speculative_tokens": 3}))
            prompts = class_prompts(prompt_set, max(num_prompts, b))
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


def _heads(specs: list[str]) -> list[tuple[str, Path]]:
    heads = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not (Path(path) / "config.json").exists():
            raise SystemExit(f"--heads takes LABEL=HEAD_FOLDER (a folder with config.json); got {spec!r}")
        heads.append((label, Path(path)))
    return heads


def add_flags(s: argparse.ArgumentParser) -> None:
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
    s.add_argument("--prompts", choices=PROMPT_CLASSES, default="heldout",
                   help="held-out EAGLE prompts (default) or the code-edit set, where prompt lookup should matter")
    s.add_argument("--no-draft-model", action="store_true", help="skip the SmolLM2 draft_model setup")
    s.add_argument("--heads", nargs="+", default=None, metavar="LABEL=HEAD",
                   help="run every EAGLE setup with each of these heads side by side (setup names get LABEL:); "
                        f"default: {HEAD3.relative_to(REPO_ROOT)}")
    s.add_argument("--only", default=None, help="run only the setups whose name matches this regex (and vanilla)")


def run(a: argparse.Namespace) -> None:
    """vLLM's eagle3 chains, the plugin's EAGLE-2 trees and its controller against vanilla and other drafts."""
    speed(a.batch, a.ks, a.max_tokens, a.num_prompts, not a.no_eagle1, a.ks_batched, a.dtype, a.repeats,
          a.tree_budgets, not a.no_draft_model, a.lookup_nodes, a.lookup_budgets, a.policy, a.prompts, a.only,
          a.auto, _heads(a.heads) if a.heads else None, command=a.command)
