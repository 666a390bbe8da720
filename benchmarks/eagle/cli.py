"""``python -m benchmarks eagle PART``: the EAGLE-3 head's studies (``benchmarks.eagle``)."""

from __future__ import annotations

import argparse

import benchmarks.eagle
from benchmarks.harness.report import command_line


def main(argv: list[str], prog: str = "python -m benchmarks eagle") -> int | None:
    from benchmarks.eagle import agreement, profile, replay, speed

    parser = argparse.ArgumentParser(prog=prog, description=benchmarks.eagle.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True, metavar="PART")
    for name, module in (("speed", speed), ("replay", replay), ("agreement", agreement), ("profile", profile)):
        part = parts.add_parser(name, help=module.run.__doc__.splitlines()[0], description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_flags(part)
        part.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    args.command = command_line("eagle", argv)
    return args.run(args)
