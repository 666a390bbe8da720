"""``python -m benchmarks kernels [gpu]``: tree-attention kernel timings (``benchmarks.kernels``)."""

from __future__ import annotations

import os


def main(argv: list[str], prog: str = "python -m benchmarks kernels") -> None:
    """The CPU timing with the flags ``argv``; a first argument ``gpu`` runs the GPU timing instead."""
    if argv and argv[0] == "gpu":
        if "--small" in argv:  # the interpreter must be on before triton is first imported
            os.environ["TRITON_INTERPRET"] = "1"
        from benchmarks.kernels import gpu

        return gpu.main(argv[1:], prog=f"{prog} gpu")
    from benchmarks.kernels import cpu

    return cpu.main(argv, prog=prog)
