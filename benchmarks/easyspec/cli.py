"""``python -m benchmarks easyspec PART``: EasySpec drafting studies (``benchmarks.easyspec``)."""

from __future__ import annotations

import argparse

import benchmarks.easyspec
from benchmarks.harness.report import command_line
from benchmarks.harness.setups import DEFAULT_REPEATS

PAIR_NAMES = ("a", "b", "c")


def chain_flags() -> argparse.ArgumentParser:
    """The flags of ``acceptance``, ``tp`` and ``e2e``."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--pairs", nargs="*", default=["a", "b", "c"], choices=PAIR_NAMES)
    flags.add_argument("--prompts", type=int, default=8)
    flags.add_argument("--max-tokens", type=int, default=64)
    flags.add_argument("--batch", type=int, default=8)
    flags.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    flags.add_argument("--n", type=int, default=2, help="EasySpec N for the e2e run")
    flags.add_argument("--dtype", default="bfloat16")
    flags.add_argument(
        "--repeats", type=int, default=DEFAULT_REPEATS,
        help="engine processes per setup, run interleaved; speeds are medians with their min-max",
    )  # fmt: skip
    return flags


def tree_flags() -> argparse.ArgumentParser:
    """The flags of the ``tree-*`` parts."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--pairs", nargs="*", default=["c", "a", "b"], choices=PAIR_NAMES)
    flags.add_argument("--budgets", type=int, nargs="*", default=[2, 4, 8, 16])
    flags.add_argument("--extra-chains", type=int, nargs="*", default=[1], help="compare: shorter chains too")
    flags.add_argument("--nodes", type=int, nargs="*", default=[4, 8, 16, 32], help="verify: node counts")
    flags.add_argument("--prompts", type=int, default=8)
    flags.add_argument("--max-tokens", type=int, default=64)
    flags.add_argument("--batch", type=int, default=1)
    flags.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    flags.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    flags.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    flags.add_argument("--ablation-pair", default="b", choices=PAIR_NAMES)
    flags.add_argument("--chain-k", type=int, default=1, help="e2e: k of the chains (the fastest chain: 1)")
    flags.add_argument("--n", type=int, default=2, help="e2e: EasySpec layer_parallel_size")
    flags.add_argument("--wide", type=int, default=4, help="e2e, lookup: root children of the depth-1 tree")
    flags.add_argument("--lookup-nodes", type=int, default=4, help="lookup: prompt-lookup nodes (and ngram's k)")
    flags.add_argument("--merged", action="store_true",
                       help="compare: also the draft's tree plus 4 prompt-lookup nodes in the same budget")
    flags.add_argument("--retokenize", action="store_true",
                       help="compare, e2e: also the trees bridged by text (tree.retokenize), on pairs across vocabularies")
    flags.add_argument("--only", help="compare, e2e: run only the setups whose name matches this regex (and vanilla)")
    flags.add_argument("--sets", nargs="*", default=["default", "edit"], choices=("default", "edit"),
                       help="lookup: prompt sets (edit: code edits, which repeat their input after some prose)")
    return flags


def main(argv: list[str], prog: str = "python -m benchmarks easyspec") -> None:
    from benchmarks.easyspec import chains, table4, trees

    parser = argparse.ArgumentParser(prog=prog, description=benchmarks.easyspec.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True, metavar="PART")
    for name, module, run in (("acceptance", chains, chains.acceptance), ("tp", chains, chains.tp),
                              ("e2e", chains, chains.e2e)):
        parts.add_parser(name, parents=[chain_flags()], help=run.__doc__.splitlines()[0],
                         description=module.__doc__).set_defaults(run=run)
    cosine = parts.add_parser("table4", help="cosine of exact and fuzzy states", description=table4.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    table4.add_flags(cosine)
    cosine.set_defaults(run=table4.table4)
    for name, run in (("verify", trees.verify), ("compare", trees.compare), ("ablation", trees.ablation),
                      ("e2e", trees.e2e), ("lookup", trees.lookup)):
        parts.add_parser(f"tree-{name}", parents=[tree_flags()], help=run.__doc__.splitlines()[0],
                         description=trees.__doc__).set_defaults(run=run)
    args = parser.parse_args(argv)
    args.command = command_line("easyspec", argv)
    args.run(args)
