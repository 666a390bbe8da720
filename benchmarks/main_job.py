"""The main job on built-in defaults: fetch the default pair and compare, side by side in one run,
vanilla vLLM, vLLM's built-in ``draft_model``, the plugin's EasySpec chain drafter and its token tree with
the same draft, and (for the default target) vLLM's ``eagle3`` with this project's committed head and the
plugin's EAGLE-2 tree with that head merged with prompt lookup.

Run from the repository root: ``python -m benchmarks.main_job`` (the README's first command does this).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from benchmarks.harness import (
    DEFAULT_REPEATS,
    Setup,
    Workload,
    load_prompts,
    markdown_table,
    run_setups,
    write_results,
)
from vllm_easyspec.models import DEFAULT_DRAFT, DEFAULT_TARGET, MODELS, ModelFetchError, fetch_model
from vllm_easyspec.tree.config import TreeConfig

# The plugin's drafter as the main job runs it: EasySpec fused fuzzy drafting, groups of 2, calibrated.
PLUGIN_ADDITIONAL_CONFIG: dict = {"easyspec": {"layer_parallel_size": 2, "mode": "fused"}}
PLUGIN_DESCRIPTION = "vllm-easyspec EasySpec drafter (fused, N=2, every_round calibration), same draft"
# The plugin's token tree as the main job runs it: the fastest tree on this pair in
# benchmarks/results/tree_compare_c_retokenize.md (python -m benchmarks.tree_bench compare --pairs c --budgets 8 16
# --merged --retokenize): the four most likely root children (one draft forward per step) plus up to 4
# prompt-lookup nodes, the vocabularies bridged by text.
PLUGIN_TREE: dict = {"choices": [[0], [1], [2], [3]], "sources": {"prompt_lookup": {"nodes": 4}}, "retokenize": True}
PLUGIN_TREE_DESCRIPTION = "vllm-easyspec token tree (4 root children + 4 prompt-lookup nodes, retokenized), same draft"
REPO_ROOT = Path(__file__).resolve().parent.parent
EAGLE3_HEAD = REPO_ROOT / "heads" / "qwen2.5-coder-0.5b-instruct-eagle3"
# The fastest k at batch 1 in benchmarks/results/eagle_speed_b1.md (python -m benchmarks.eagle_bench speed).
EAGLE3_K = 3
# The plugin's EAGLE proposer as the main job runs it: the fastest setup of
# benchmarks/results/eagle_tree_speed_b1.md (python -m benchmarks.eagle_bench speed --tree-budgets 4 8
# --lookup-nodes 4): an EAGLE-2 tree of 4 head nodes merged with up to 4 prompt-lookup nodes.
EAGLE3_TREE: dict = {"top_k": 2, "depth": 3, "budget": 4, "sources": {"prompt_lookup": {"nodes": 4}}}


def resolve_model(name_or_path: str) -> str:
    """A catalogue name is fetched (cached); anything else must be an existing HF model folder."""
    if name_or_path in MODELS:
        return str(fetch_model(name_or_path))
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ModelFetchError(
            f"model folder {path} does not exist or has no config.json; pass an HF model folder or one of "
            f"{', '.join(MODELS)}"
        )
    return str(path)


def main_setups(draft: str, k: int, target_is_default: bool) -> list[Setup]:
    speculative = {
        "method": "draft_model",
        "model": draft,
        "num_speculative_tokens": k,
        "use_heterogeneous_vocab": True,
    }
    setups = [
        Setup("vanilla", "vLLM without speculation"),
        Setup("vllm-draft_model", f"vLLM built-in draft_model, k={k}", speculative_config=speculative),
        Setup("easyspec", PLUGIN_DESCRIPTION, speculative_config=speculative, additional_config=PLUGIN_ADDITIONAL_CONFIG),
        Setup(
            "easyspec-tree", PLUGIN_TREE_DESCRIPTION,
            speculative_config=speculative | {"num_speculative_tokens": TreeConfig(**PLUGIN_TREE).num_nodes},
            additional_config={"easyspec": {"tree": PLUGIN_TREE}},
        ),
    ]
    if target_is_default and (EAGLE3_HEAD / "config.json").is_file():
        eagle3 = {"method": "eagle3", "model": str(EAGLE3_HEAD), "num_speculative_tokens": EAGLE3_K}
        setups.append(Setup("eagle3-head", f"vLLM eagle3 with this project's head, k={EAGLE3_K}", eagle3))
        setups.append(Setup(
            "eagle3-tree", "vllm-easyspec EAGLE-2 tree (4 head nodes + 4 prompt-lookup nodes), same head",
            speculative_config={"method": "eagle3", "model": str(EAGLE3_HEAD)},
            additional_config={"easyspec": {"tree": EAGLE3_TREE}},
        ))
    return setups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="catalogue name or HF folder")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="catalogue name or HF folder")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--stem", default="main_job", help="file name stem under benchmarks/results/")
    parser.add_argument(
        "--repeats", type=int, default=DEFAULT_REPEATS,
        help="engine processes per setup, run interleaved; speeds are medians with their min-max",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        target = resolve_model(args.target)
        draft = resolve_model(args.draft)
    except ModelFetchError as exc:
        print(f"main_job: error: {exc}", file=sys.stderr)
        return 2
    workload = Workload(
        target=target,
        prompts=load_prompts(args.num_prompts),
        max_tokens=args.max_tokens,
        batch_size=args.batch_size,
        dtype=args.dtype,
    )
    setups = main_setups(draft, args.num_speculative_tokens, target_is_default=args.target == DEFAULT_TARGET)
    rows = run_setups(setups, workload, repeats=args.repeats)
    command = "python -m benchmarks.main_job " + shlex.join(argv if argv is not None else sys.argv[1:])
    title = (
        f"{Path(target).name} with draft {Path(draft).name}: {len(workload.prompts)} prompts, "
        f"{args.max_tokens} tokens, batch {args.batch_size}, {args.dtype}, greedy"
    )
    paths = write_results(rows, args.stem, title, command.strip())
    print(f"\n{title}\n\n{markdown_table(rows)}\n")
    identical = all(r["outputs_identical_to_vanilla"] for r in rows)
    failed = [r["setup"] for r in rows if r["identity"] == "FAILED"]
    near_ties = [r["setup"] for r in rows if r["identity"] == "near-tie"]
    print(f"all outputs identical to vanilla: {'yes' if identical else 'NO'}")
    if near_ties:
        print(f"near-ties within {args.dtype} rounding (lossless): {', '.join(near_ties)}")
    best = max(rows, key=lambda r: r["decode_tok_per_s"] or 0.0)
    print(
        f"fastest setup in this run: {best['setup']} ({best['description']}), "
        f"{best['speedup_vs_vanilla']:.2f}x vanilla [{best['speedup_min']:.2f}–{best['speedup_max']:.2f}] "
        f"over {best['repeats']} runs"
    )
    print("results: " + ", ".join(str(p) for p in paths.values()))
    if failed:
        print(f"LOSSLESS CHECK FAILED for: {', '.join(failed)} (see the lines above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
