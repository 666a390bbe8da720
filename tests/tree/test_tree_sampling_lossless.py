"""Proof by test that the tree rejection sampler is lossless, and that the same test catches a
biased verifier.

Statistical design (identical for every case, including the biased verifier):

* Target and draft are context-dependent random logit tables over a vocabulary of 5-6 tokens
  (``tree_testlib.ContextTable``), so the exact sequential distribution of the first two generated
  tokens, ``P(x1, x2) = p(x1) p(x2 | x1)`` with temperature / top-k / top-p applied, is known in
  closed form. Trees have depth 3 and branching up to 3; the draft is only loosely correlated with
  the target, so many drafts are rejected and every branch of the sampler is exercised.
* ``n = 200_000`` independent seeded runs. A run that emits a single token continues with a second
  verify step on a fresh tree rooted at that token, so every run yields (x1, x2).
* Pearson's chi-square over the K cells with positive probability (K - 1 = 11..24 degrees of freedom,
  smallest expected count ~ 100). Under H0 ("the sampler is lossless") the statistic is chi-square
  distributed and the p-value uniform; we reject at p < 1e-4. The seeds are fixed, so the test is
  deterministic; a correct sampler under an arbitrary seed would fail with probability 1e-4.
  A sample that lands in a zero-probability cell rejects outright.
* Secondary bound on total variation: E[TV] <= 0.5 sqrt(2 K / (pi n)) ~ 0.0045 for K = 25 and
  TV moves by at most 1/n per sample, so by McDiarmid P(TV > E[TV] + 0.0055) <= exp(-2 n 0.0055^2)
  ~ 6e-6. We require TV < 0.01.
* Power: the per-path verifier of the public EasySpec code has TV ~ 0.2-0.3 from the target here;
  its noncentrality n * sum((p_b - p)^2 / p) is ~ 1e4-1e5, so p < 1e-4 holds with certainty. The
  test asserts that rejection.
"""

from __future__ import annotations

import pytest

from tests.tree.tree_testlib import (
    LosslessCase,
    chi_square,
    expected_two_token_distribution,
    sample_first_two_tokens,
)

NUM_SAMPLES = 200_000
ALPHA = 1e-4
MAX_TV = 0.01

# branching 3 at the root, 2 below, depth 3
CHOICES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]

CASES = {
    # SpecInfer MSS on i.i.d. children (duplicates among siblings are possible)
    "iid_static_t1": LosslessCase("iid_static_t1", {"choices": CHOICES, "mode": "iid_from_draft"}),
    # recursive rejection sampling on deterministic top-k children, with target top-k and top-p
    "topk_static_t0.8_k4_p0.9": LosslessCase(
        "topk_static_t0.8_k4_p0.9", {"choices": CHOICES, "mode": "without_replacement"},
        temperature=0.8, top_k=4, top_p=0.9),
    # EAGLE-2 dynamic tree (top-k 2, depth 3, budget 6) at a high temperature with top-p
    "eagle2_t1.3_p0.8": LosslessCase("eagle2_t1.3_p0.8", {"eagle": (2, 3, 6)}, vocab=6, temperature=1.3,
                                     top_p=0.8),
}
SLOW_CASES = {
    "iid_static_t0.6_k3": LosslessCase(
        "iid_static_t0.6_k3", {"choices": CHOICES, "mode": "iid_from_draft"}, temperature=0.6, top_k=3,
        draft_temperature=1.4),
    "eagle2_wide_t0.5": LosslessCase("eagle2_wide_t0.5", {"eagle": (3, 3, 9)}, vocab=6, temperature=0.5,
                                     draft_mix=0.8),
}


def _run(case: LosslessCase, seed: int, biased: bool) -> tuple[float, float, float, int]:
    counts, target = sample_first_two_tokens(case, NUM_SAMPLES, seed=seed, biased=biased)
    assert counts.sum() == NUM_SAMPLES
    stat, pvalue, tv, dof = chi_square(counts, expected_two_token_distribution(case, target))
    print(f"{case.name} biased={biased}: chi2={stat:.1f} dof={dof} p={pvalue:.3g} TV={tv:.4f}")
    return stat, pvalue, tv, dof


@pytest.mark.parametrize("name", list(CASES))
def test_tree_sampler_matches_sequential_target(name):
    _, pvalue, tv, _ = _run(CASES[name], seed=0, biased=False)
    assert pvalue > ALPHA
    assert tv < MAX_TV


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_tree_sampler_matches_sequential_target_more_settings(name):
    _, pvalue, tv, _ = _run(SLOW_CASES[name], seed=1, biased=False)
    assert pvalue > ALPHA
    assert tv < MAX_TV


def test_same_test_rejects_per_path_biased_verifier():
    """Verifying each root-to-leaf path independently by chain speculative sampling and keeping the
    longest accepted one is not lossless: the identical test must reject it."""
    _, pvalue, tv, _ = _run(CASES["topk_static_t0.8_k4_p0.9"], seed=0, biased=True)
    assert pvalue < ALPHA
    assert tv > MAX_TV


@pytest.mark.slow
@pytest.mark.parametrize("name", ["iid_static_t1", "eagle2_t1.3_p0.8"])
def test_same_test_rejects_biased_verifier_other_modes(name):
    _, pvalue, tv, _ = _run(CASES[name], seed=0, biased=True)
    assert pvalue < ALPHA
    assert tv > MAX_TV
