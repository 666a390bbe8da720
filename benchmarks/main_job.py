"""The main job on built-in defaults: fetch the default models and compare, side by side in one run, vanilla
vLLM with vLLM's best built-in speculative method and the plugin's fastest setup on the same prompts.

Run from the repository root: ``python -m benchmarks main`` (``make demo`` runs it).

- Default (13-14 minutes in bf16 on the 2-core AVX-512 machine, 19-31 in float32 on AVX2-only ones, after
  the one-time model fetch): vanilla, vLLM's ``eagle3`` with this project's committed head, the plugin's
  EAGLE-2 tree with that head merged with prompt lookup, and the plugin's speculation controller
  (``easyspec.tree.auto``) cutting that tree per request and step. The draft-model setups are left out: each
  engine process costs about a minute on that machine, so three more setups would add about 10 minutes.
- The dtype is bf16 where the CPU computes it natively (AVX-512 BF16 or AMX), else float32 (``--dtype``
  overrides); the times above are bf16 on an AVX-512 machine.
- ``--full`` (about 25 minutes): all seven setups, adding vLLM's built-in ``draft_model``, the plugin's
  EasySpec chain drafter and its token tree with the same draft.
- A ``--target`` without the committed EAGLE head (any target but the default) compares the draft-model
  setups instead: by default vanilla, vLLM's ``draft_model`` and the plugin's token tree; ``--full`` adds the
  EasySpec chain drafter.
- ``--json`` (``benchmarks.main_json``): the same setups on the same prompts asking for a JSON answer (vLLM
  structured output), beside the same prompts without it in the same engine processes; ``--batch-size 1 8``
  runs once per batch size into one report.

Invariants:
- Both modes run the same prompts, tokens, batch, dtype and engine processes per setup (``--repeats``,
  interleaved by the harness), so a setup's row in the default run compares with its row in the full run.
- The default run writes ``benchmarks/results/main_job.{json,md,png}``, ``--full`` ``main_job_full.*``
  (``--stem`` overrides either), so the quick run never overwrites the full comparison.
- Before any model is fetched, it prints the setups, the workload and an estimate of the run time.
- Exit code 1 when a setup's outputs fail the lossless check against vanilla, 2 when a model cannot be had.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.defaults import HEAD3
from benchmarks.harness.processes import run_setups
from benchmarks.harness.report import command_line, markdown_table, write_results
from benchmarks.harness.setups import (
    DEFAULT_REPEATS,
    VANILLA,
    Setup,
    Workload,
    cpu_native_dtype,
    load_prompts,
)
from vllm_easyspec.models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    MODELS,
    ModelFetchError,
    fetch_model,
    is_fetched,
    model_dir,
)
from vllm_easyspec.tree.config import TreeConfig

# The plugin's drafter as the main job runs it: EasySpec fused fuzzy drafting, groups of 2, calibrated.
PLUGIN_ADDITIONAL_CONFIG: dict = {"easyspec": {"layer_parallel_size": 2, "mode": "fused"}}
PLUGIN_DESCRIPTION = "vllm-easyspec EasySpec drafter (fused, N=2, every_round calibration), same draft"
# The plugin's token tree as the main job runs it: the fastest tree on this pair in
# benchmarks/results/tree_compare_c_retokenize.md (python -m benchmarks easyspec tree-compare --pairs c --budgets 8 16
# --merged --retokenize): the four most likely root children (one draft forward per step) plus up to 4
# prompt-lookup nodes, the vocabularies bridged by text.
PLUGIN_TREE: dict = {"choices": [[0], [1], [2], [3]], "sources": {"prompt_lookup": {"nodes": 4}}, "retokenize": True}
PLUGIN_TREE_DESCRIPTION = "vllm-easyspec token tree (4 root children + 4 prompt-lookup nodes, retokenized), same draft"
EAGLE3_HEAD = HEAD3
# The fastest k at batch 1 in benchmarks/results/eagle_speed_b1.md (python -m benchmarks eagle speed).
EAGLE3_K = 3
# The plugin's EAGLE proposer as the main job runs it: the fastest setup of
# benchmarks/results/eagle_tree_speed_b1.md (python -m benchmarks eagle speed --tree-budgets 4 8
# --lookup-nodes 4): an EAGLE-2 tree of 4 head nodes merged with up to 4 prompt-lookup nodes.
EAGLE3_TREE: dict = {"top_k": 2, "depth": 3, "budget": 4, "sources": {"prompt_lookup": {"nodes": 4}}}
# The speculation controller (easyspec.tree.auto) cutting that same merged tree per request and step: at batch 1
# level with the fixed tree or ahead of it on both CPU kinds, and ahead of auto on a larger 16 + 4 candidate
# (README, "The controller against the best fixed setting").
EAGLE3_AUTO_TREE: dict = EAGLE3_TREE | {"auto": True}

# Setups of the quick default run, by name; --full runs every setup of main_setups.
DEFAULT_EAGLE_SETUPS = (VANILLA, "eagle3-head", "eagle3-tree", "eagle3-auto")
DEFAULT_DRAFT_MODEL_SETUPS = (VANILLA, "vllm-draft_model", "easyspec-tree")
DEFAULT_STEM = "main_job"
FULL_STEM = "main_job_full"

# Constants of the printed run-time estimate, from the timed default run on the 2-core CPU machine (10 min 31 s;
# benchmarks/results/main_job.json, each engine process's end taken from its log's modification time in
# benchmarks/results/logs/): every engine process took 44 s [42-46] besides its timed generate call
# (interpreter start, imports, engine start-up, warm-up), and the generate calls, vanilla's identity replay
# included, took 0.06 s per generated token (0.042 for eagle3 at 24 tok/s, 0.099 for a vanilla run slowed
# to 10 tok/s). With them --full comes to about 1,230 s; its last recorded run took 1,169 s (README, Timings).
SECONDS_PER_ENGINE_PROCESS = 44.0
SECONDS_PER_GENERATED_TOKEN = 0.06


def model_folder(name_or_path: str) -> str:
    """Where a model lives without fetching it: a catalogue name's cache folder, else the path as given.
    ``resolve_model`` returns the same folder once the model is there."""
    if name_or_path in MODELS:
        return str(model_dir(name_or_path))
    return str(Path(name_or_path).expanduser())


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


def eagle_head_available(target_is_default: bool) -> bool:
    """The committed EAGLE head was trained for the default target only."""
    return target_is_default and (EAGLE3_HEAD / "config.json").is_file()


def main_setups(draft: str, k: int, with_eagle: bool) -> list[Setup]:
    """Every setup of the full comparison, vanilla first; the EAGLE setups only ``with_eagle``."""
    speculative = {
        "method": "draft_model",
        "model": draft,
        "num_speculative_tokens": k,
        "use_heterogeneous_vocab": True,
    }
    setups = [
        Setup(VANILLA, "vLLM without speculation"),
        Setup("vllm-draft_model", f"vLLM built-in draft_model, k={k}", speculative_config=speculative),
        Setup("easyspec", PLUGIN_DESCRIPTION, speculative_config=speculative, additional_config=PLUGIN_ADDITIONAL_CONFIG),
        Setup(
            "easyspec-tree", PLUGIN_TREE_DESCRIPTION,
            speculative_config=speculative | {"num_speculative_tokens": TreeConfig(**PLUGIN_TREE).num_nodes},
            additional_config={"easyspec": {"tree": PLUGIN_TREE}},
        ),
    ]
    if with_eagle:
        eagle3 = {"method": "eagle3", "model": str(EAGLE3_HEAD), "num_speculative_tokens": EAGLE3_K}
        setups.append(Setup("eagle3-head", f"vLLM eagle3 with this project's head, k={EAGLE3_K}", eagle3))
        setups.append(Setup(
            "eagle3-tree", "vllm-easyspec EAGLE-2 tree (4 head nodes + 4 prompt-lookup nodes), same head",
            speculative_config={"method": "eagle3", "model": str(EAGLE3_HEAD)},
            additional_config={"easyspec": {"tree": EAGLE3_TREE}},
        ))
        setups.append(Setup(
            "eagle3-auto", "vllm-easyspec speculation controller (auto) on the same 4 + 4 merged EAGLE-2 tree",
            speculative_config={"method": "eagle3", "model": str(EAGLE3_HEAD)},
            additional_config={"easyspec": {"tree": EAGLE3_AUTO_TREE}},
        ))
    return setups


def chosen_setups(all_setups: list[Setup], full: bool, with_eagle: bool) -> list[Setup]:
    """All setups with ``full``; else vanilla, vLLM's best built-in method and the plugin's fastest setup:
    the EAGLE pair when the head is there, else vLLM's draft_model and the plugin's draft-model tree."""
    if full:
        return all_setups
    names = DEFAULT_EAGLE_SETUPS if with_eagle else DEFAULT_DRAFT_MODEL_SETUPS
    return [setup for setup in all_setups if setup.name in names]


def uses_draft_model(setups: list[Setup]) -> bool:
    """Whether any setup drafts with the draft model (so the draft must be fetched)."""
    return any((s.speculative_config or {}).get("method") == "draft_model" for s in setups)


def estimated_seconds(processes: int, generated_tokens: int) -> float:
    """Rough wall time of the comparison (no model fetch): a fixed cost per engine process plus a cost per
    generated token, both calibrated at batch 1 (larger batches generate faster, so this overestimates
    them). ``generated_tokens`` counts every timed generate call and vanilla's replay for the identity
    check."""
    return processes * SECONDS_PER_ENGINE_PROCESS + generated_tokens * SECONDS_PER_GENERATED_TOKEN


def plan_text(
    setups: list[Setup], left_out: list[Setup], workload: Workload, repeats: int, models_to_fetch: list[str],
    runs: int = 1, cells: int = 1,
) -> str:
    """What the run will do and roughly how long it takes (``runs`` harness runs, ``cells`` workloads timed in
    all of them per setup and round), printed before anything is fetched."""
    processes = len(setups) * repeats * runs
    tokens_per_process = len(workload.prompts) * workload.max_tokens * cells / runs
    estimate_minutes = estimated_seconds(processes, (processes + 1) * tokens_per_process) / 60
    width = max(len(s.name) for s in setups)
    lines = [
        f"main job: {len(setups)} setups x {repeats} engine processes each, run interleaved "
        f"(speeds are medians with their min-max):",
        *(f"  {s.name:<{width}}  {s.description}" for s in setups),
        f"workload: {Path(workload.target).name}, {len(workload.prompts)} prompts x {workload.max_tokens} "
        f"tokens, batch {workload.batch_size}, {workload.dtype}, greedy",
        f"estimated time: about {max(round(estimate_minutes), 1)} minutes on a 2-core CPU for {processes} "
        f"engine processes"
        + (f", plus a one-time fetch of {', '.join(models_to_fetch)} (a few minutes)" if models_to_fetch else ""),
    ]  # fmt: skip
    if left_out:
        lines.append(f"left out (run them with --full): {', '.join(s.name for s in left_out)}")
    return "\n".join(lines)


def main(argv: list[str], prog: str = "python -m benchmarks main") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="all seven setups (about 25 minutes on a 2-core CPU)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="catalogue name or HF folder")
    parser.add_argument(
        "--draft", default=DEFAULT_DRAFT,
        help="catalogue name or HF folder; used by the draft-model setups (--full, or a target without the EAGLE head)",
    )  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1],
                        help="with --json, several: one harness run each, one report")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=3, help="draft_model chain length")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="default: bfloat16 where the CPU computes it natively (AVX-512 BF16, AMX), else float32")
    parser.add_argument(
        "--stem", help=f"file name stem under benchmarks/results/ (default {DEFAULT_STEM}, {FULL_STEM} with --full)"
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=DEFAULT_REPEATS,
        help="engine processes per setup, run interleaved; speeds are medians with their min-max",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true",
                        help="the prompts ask for a JSON answer, served with vLLM structured output (stem main_job_json)")
    parser.add_argument("--engine-args", type=json.loads, default={},
                        help='more LLM() arguments for every setup, as JSON (e.g. \'{"disable_hybrid_kv_cache_manager": '
                             'true}\' for Gemma 3 with a draft model: vLLM 0.32 needs a draft\'s layers in one KV cache group)')
    parser.add_argument("--plain", action=argparse.BooleanOptionalAction, default=True,
                        help="with --json, also time the prompts without JSON in the same processes (default)")
    args = parser.parse_args(argv)
    if len(args.batch_size) > 1 and not args.json:
        parser.error("several --batch-size values need --json; run the main job once per batch size")
    args.dtype = args.dtype or cpu_native_dtype()

    with_eagle = eagle_head_available(target_is_default=args.target == DEFAULT_TARGET)
    all_setups = main_setups(model_folder(args.draft), args.num_speculative_tokens, with_eagle)
    setups = chosen_setups(all_setups, args.full, with_eagle)
    needs_draft = uses_draft_model(setups)
    workload = Workload(
        target=model_folder(args.target),
        prompts=load_prompts(args.num_prompts),
        max_tokens=args.max_tokens,
        batch_size=args.batch_size[0],
        dtype=args.dtype,
        engine_options=args.engine_args,
    )
    models = [args.target, args.draft] if needs_draft else [args.target]
    to_fetch = [name for name in models if name in MODELS and not is_fetched(name)]
    left_out = [s for s in all_setups if s not in setups]
    runs, cells = (len(args.batch_size), len(args.batch_size) + (args.plain and 1 in args.batch_size)) if args.json else (1, 1)
    print(plan_text(setups, left_out, workload, args.repeats, to_fetch, runs, cells))
    if args.json:
        print(f"--json: one harness run per batch size ({', '.join(map(str, args.batch_size))}), each timing the "
              f"prompts asking for JSON{' (at batch 1 also without)' if args.plain and 1 in args.batch_size else ''}")
    if args.target != DEFAULT_TARGET:
        print(f"no EAGLE setups: the committed head {EAGLE3_HEAD.name} is for {DEFAULT_TARGET} only")
    elif not with_eagle:
        print(f"no EAGLE setups: the committed head {EAGLE3_HEAD} has no config.json")
    elif not needs_draft and args.draft != DEFAULT_DRAFT:
        print(f"note: --draft {args.draft} is used by the draft-model setups only; add --full to run them")
    print(flush=True)
    try:
        for name in models:
            resolve_model(name)
    except ModelFetchError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2

    command = command_line("main", argv)
    drafters = ([f"draft {Path(model_folder(args.draft)).name}"] if needs_draft else []) + (
        [f"EAGLE head {EAGLE3_HEAD.name}"] if any(s.name.startswith("eagle3") for s in setups) else []
    )
    title = (
        f"{Path(workload.target).name} with {' and '.join(drafters)}: {len(workload.prompts)} prompts, "
        f"{args.max_tokens} tokens, batch {' and '.join(map(str, args.batch_size))}, {args.dtype}, greedy"
    )
    if args.json:
        from benchmarks.main_json import JSON_STEM, run_json

        return run_json(setups, workload, args.batch_size, args.repeats, args.stem or JSON_STEM,
                        f"JSON requests: {title}", command, plain=args.plain)
    rows = run_setups(setups, workload, repeats=args.repeats)
    stem = args.stem or (FULL_STEM if args.full else DEFAULT_STEM)
    paths = write_results(rows, stem, title, command.strip())
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
    if left_out:
        print(f"left out of this run: {', '.join(s.name for s in left_out)} (python -m benchmarks main --full)")
    print("results: " + ", ".join(str(p) for p in paths.values()))
    if failed:
        print(f"LOSSLESS CHECK FAILED for: {', '.join(failed)} (see the lines above)", file=sys.stderr)
        return 1
    return 0

