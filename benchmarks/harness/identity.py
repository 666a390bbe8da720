"""Identity against vanilla: a differing token is a near-tie only within the rounding of the run's dtype."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.harness.report import fmt

# Significand bits including the implicit one, and the smallest normal exponent, per logits dtype.
_FLOAT_FORMATS = {"bfloat16": (8, -126), "float16": (11, -14), "float32": (24, -126)}
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
    "float": "float32",
    "fp32": "float32",
}


def _float_format(dtype: str) -> tuple[int, int]:
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _FLOAT_FORMATS:
        raise ValueError(f"no rounding model for dtype {dtype!r}; known: {', '.join(_FLOAT_FORMATS)}")
    return _FLOAT_FORMATS[name]


def ulp(x: float, dtype: str) -> float:
    """Spacing of ``dtype`` values at ``|x|``: 2**(floor(log2|x|) - (significand bits - 1)); subnormal
    spacing below the smallest normal. bfloat16: 2**(floor(log2|x|) - 7)."""
    bits, min_exponent = _float_format(dtype)
    exponent = math.frexp(abs(x))[1] - 1 if x else min_exponent  # frexp: |x| = m * 2**e, m in [0.5, 1)
    return 2.0 ** (max(exponent, min_exponent) - (bits - 1))


def near_tie_threshold(top_logit: float, dtype: str) -> float:
    """Largest logit margin that rounding of the run's dtype can flip: 2 ulp of the top logit."""
    return 2 * ulp(top_logit, dtype)


def classify_identity(
    setup_ids: list[list[int]],
    vanilla_ids: list[list[int]],
    vanilla_top: list[list[list[list[float]]]] | None,
    dtype: str,
) -> dict[str, Any]:
    """Pure verdict for one run: ``identity`` is "identical", "near-tie" or "FAILED", with one divergence per
    differing prompt ({prompt, position, margin, threshold, vanilla_top, vanilla_token, setup_token,
    near_tie}). ``vanilla_top[prompt][position]`` is vanilla's [[token, logit], ...] there, best first.

    A divergence is a near-tie only when, at the first position where the two differ, (a) the setup's token
    is among vanilla's recorded top tokens, (b) vanilla's own token is its (possibly tied) first choice, and
    (c) the margin, vanilla's first logit minus its logit of the setup's token, is <= ``near_tie_threshold``
    for ``dtype``. Usually the setup's token is vanilla's second choice; in a three-way tie it can be the
    third. ``vanilla_top`` of the divergence lists vanilla's choices down to the setup's token (at least
    two). A missing record, or one output ending where the other goes on, is a failure."""
    if len(setup_ids) != len(vanilla_ids):
        raise ValueError(f"{len(setup_ids)} outputs vs vanilla's {len(vanilla_ids)}")
    divergences = []
    for prompt, (ours, theirs) in enumerate(zip(setup_ids, vanilla_ids, strict=True)):
        if ours == theirs:
            continue
        position = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))
        )
        setup_token = ours[position] if position < len(ours) else None
        vanilla_token = theirs[position] if position < len(theirs) else None
        divergence: dict[str, Any] = {
            "prompt": prompt, "position": position, "margin": None, "threshold": None, "vanilla_top": None,
            "vanilla_token": vanilla_token, "setup_token": setup_token, "near_tie": False,
        }  # fmt: skip
        record = None
        if vanilla_top is not None and prompt < len(vanilla_top) and position < len(vanilla_top[prompt]):
            record = vanilla_top[prompt][position]
        if record is not None and len(record) >= 2 and setup_token is not None and vanilla_token is not None:
            # Best first; on an exact tie vanilla's own token counts as its first choice.
            ranked = sorted(
                ((int(t), float(v)) for t, v in record), key=lambda tv: (-tv[1], tv[0] != vanilla_token)
            )
            first_id, first_logit = ranked[0]
            threshold = near_tie_threshold(first_logit, dtype)
            rank = next((i for i, (t, _) in enumerate(ranked) if t == setup_token), None)
            shown = ranked[: max(2, (rank or 0) + 1)]
            divergence |= {"threshold": threshold, "vanilla_top": [[t, v] for t, v in shown]}
            if rank is not None:
                margin = first_logit - ranked[rank][1]
                divergence |= {
                    "margin": margin,
                    "near_tie": first_id == vanilla_token and margin <= threshold,
                }
            else:  # not even among vanilla's recorded choices: at least the margin to the last of them
                divergence["margin"] = first_logit - ranked[-1][1]
        divergences.append(divergence)
    return {"identity": identity_verdict(divergences), "divergences": divergences}


def identity_verdict(divergences: list[dict[str, Any]]) -> str:
    """"identical" without divergences, "near-tie" when every one is a near-tie, else "FAILED"."""
    if not divergences:
        return "identical"
    return "near-tie" if all(d["near_tie"] for d in divergences) else "FAILED"


def identity_failures(rows: list[dict[str, Any]]) -> list[str]:
    """One "LOSSLESS CHECK FAILED ..." line per failing divergence of every row."""
    lines = []
    for row in rows:
        for d in row.get("divergences") or []:
            if d["near_tie"]:
                continue
            if d.get("reason"):
                lines.append(f"LOSSLESS CHECK FAILED: setup {row['setup']}: {d['reason']}")
                continue
            lines.append(
                f"LOSSLESS CHECK FAILED: setup {row['setup']}, prompt {d['prompt']}, position {d['position']}, "
                f"margin {fmt(d['margin'], '.6g')} (near-tie threshold {fmt(d['threshold'], '.6g')}), "
                f"vanilla top {d['vanilla_top']}, vanilla token {d['vanilla_token']}, "
                f"setup token {d['setup_token']}"
            )
    return lines


def report_identity(rows: list[dict[str, Any]]) -> int:
    """Print failures loudly, near-ties and disagreeing repeats quietly; return the number of failures."""
    failures = identity_failures(rows)
    for row in rows:
        if row.get("repeats_agree") is False:
            print(
                f"REPEATS DISAGREE: setup {row['setup']}: its {row['repeats']} runs did not all give the same tokens"
            )
        for d in row.get("divergences") or []:
            if d["near_tie"]:
                print(
                    f"near-tie (lossless): setup {row['setup']}, prompt {d['prompt']}, position {d['position']}, "
                    f"margin {d['margin']:.6g} <= {d['threshold']:.6g}, vanilla top {d['vanilla_top']}"
                )
    for line in failures:
        print(line, flush=True)
    return len(failures)

