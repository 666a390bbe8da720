"""python -m benchmarks NAME [ARGS] (each NAME has its own --help; benchmarks/README.md says which answers what):

  main      the main job (what `make demo` runs): vanilla, vLLM's eagle3 chain, the plugin's EAGLE-2 tree and
            its speculation controller, side by side; --full adds the draft-model setups
  matrix    the speculation controller against every fixed setup, by prompt class and batch size;
            `matrix controller-cost`: the controller's own time per step; `matrix moe-cost`: its cost curves
  kernels   tree-attention kernel timings: the CPU path (default); `kernels gpu`: the Triton kernel on a GPU
  easyspec  EasySpec drafting with a draft model: acceptance, drafting time, speed, Table-4 cosines, token trees
  eagle     the committed EAGLE-3 head: speed against vLLM's chains, replay, agreement curve, step profile
"""

from __future__ import annotations

import sys
from importlib import import_module

COMMANDS = {
    "main": "benchmarks.main_job",
    "matrix": "benchmarks.matrix.cli",
    "kernels": "benchmarks.kernels.cli",
    "easyspec": "benchmarks.easyspec.cli",
    "eagle": "benchmarks.eagle.cli",
}


def main(argv: list[str]) -> int:
    """Runs ``argv[0]``'s ``main`` with the rest of ``argv``; its return value (None: 0) is the exit code."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"python -m benchmarks: unknown name {name!r}; choose one of {', '.join(COMMANDS)} (--help says "
              "what each measures)", file=sys.stderr)
        return 2
    return int(import_module(COMMANDS[name]).main(rest, prog=f"python -m benchmarks {name}") or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
