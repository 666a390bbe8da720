"""Engine-level distribution test for temperature > 0.

The exact joint law of the first two generated tokens is computed from the target's own forward passes
(transformers, float64); many seeded samples are drawn through ``LLM.generate`` with speculation on, and a
chi-square goodness-of-fit test compares the two. The second token is produced by the rejection sampler
(the drafter proposes after the prefill step), so a sampler that is not lossless shifts its law.

Cells whose expected count is below ``MIN_EXPECTED`` are pooled into one cell, the usual validity rule of
the chi-square approximation. With a fixed seed list the statistic is deterministic, so the test is
reproducible; ``ALPHA`` is its false-alarm rate for a correct sampler.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

ALPHA = 1e-3
MIN_EXPECTED = 5.0
PROMPT_TOKEN_IDS = [1, 17, 42, 5, 33, 9]


@dataclass(frozen=True)
class ChiSquareResult:
    statistic: float
    degrees_of_freedom: int
    p_value: float
    num_samples: int

    @property
    def passes(self) -> bool:
        return self.p_value >= ALPHA


def exact_two_token_law(model_dir: Path, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(t1, t2 | prompt) as a [V, V] float64 tensor, from the target itself."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1]
        p1 = torch.softmax(first / temperature, dim=-1)
        vocab = p1.shape[0]
        batch = torch.tensor([prompt + [token] for token in range(vocab)])
        second = model(batch).logits[:, -1]
        p2 = torch.softmax(second / temperature, dim=-1)
    return p1[:, None] * p2


def sample_two_tokens(llm, prompt: list[int], temperature: float, num_samples: int,
                      n: int = 1) -> list[tuple[int, int]]:
    """``num_samples`` first two tokens after ``prompt``: one seeded request each, or, with ``n`` > 1,
    ``num_samples / n`` requests of ``n`` completions each (vLLM's parallel sampling, unseeded)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if n > 1:
        params = [SamplingParams(temperature=temperature, max_tokens=2, min_tokens=2, n=n, ignore_eos=True)
                  for _ in range(num_samples // n)]
    else:
        params = [SamplingParams(temperature=temperature, max_tokens=2, min_tokens=2, seed=seed, ignore_eos=True)
                  for seed in range(num_samples)]
    prompts = [TokensPrompt(prompt_token_ids=prompt)] * len(params)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [tuple(completion.token_ids[:2]) for output in outputs for completion in output.outputs]


def chi_square_against(law: torch.Tensor, samples: list[tuple[int, int]]) -> ChiSquareResult:
    from scipy.stats import chi2

    counts = Counter(samples)
    total = len(samples)
    expected = law.flatten() * total
    observed = torch.zeros_like(expected)
    vocab = law.shape[1]
    for (first, second), count in counts.items():
        observed[first * vocab + second] = count
    keep = expected >= MIN_EXPECTED
    pooled_expected = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    pooled_observed = torch.cat([observed[keep], observed[~keep].sum().reshape(1)])
    if pooled_expected[-1] < MIN_EXPECTED:  # fold a too-small pooled cell into the smallest kept one
        smallest = int(torch.argmin(pooled_expected[:-1]))
        pooled_expected[smallest] += pooled_expected[-1]
        pooled_observed[smallest] += pooled_observed[-1]
        pooled_expected, pooled_observed = pooled_expected[:-1], pooled_observed[:-1]
    statistic = float(((pooled_observed - pooled_expected) ** 2 / pooled_expected).sum())
    dof = int(pooled_expected.numel()) - 1
    return ChiSquareResult(statistic, dof, float(chi2.sf(statistic, dof)), total)


def run_distribution_test(
    llm, model_dir: Path, temperature: float = 1.0, num_samples: int = 4000, prompt: list[int] | None = None,
    n: int = 1,
) -> ChiSquareResult:
    prompt = PROMPT_TOKEN_IDS if prompt is None else prompt
    law = exact_two_token_law(model_dir, prompt, temperature)
    samples = sample_two_tokens(llm, prompt, temperature, num_samples, n)
    return chi_square_against(law, samples)


# ---- A deliberately biased verifier, installed into the workers through LLM.collective_rpc ----

DRAFT_LOGIT_BOOST = 1.5


def install_biased_rejection_sampler(worker) -> str:
    """Replace the runner's rejection sampler by one that favours draft tokens: before vLLM's (lossless)
    sampler runs, each draft token's target logit is raised by ``DRAFT_LOGIT_BOOST``, i.e. drafts are
    accepted more often than the target's probabilities allow."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    runner = worker.model_runner
    original = runner.rejection_sampler

    class DraftFavouringRejectionSampler(RejectionSampler):
        def forward(self, metadata, draft_probs, logits, sampling_metadata):
            logits = logits.clone()
            logits[metadata.target_logits_indices, metadata.draft_token_ids.long()] += DRAFT_LOGIT_BOOST
            return super().forward(metadata, draft_probs, logits, sampling_metadata)

    biased = DraftFavouringRejectionSampler.__new__(DraftFavouringRejectionSampler)
    biased.__dict__.update(original.__dict__)
    runner.rejection_sampler = biased
    return type(biased).__name__


def restore_rejection_sampler(worker) -> str:
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    runner = worker.model_runner
    sampler = runner.rejection_sampler
    restored = RejectionSampler.__new__(RejectionSampler)
    restored.__dict__.update(sampler.__dict__)
    runner.rejection_sampler = restored
    return type(restored).__name__


def install_biased_tree_sampler(worker) -> str:
    """The tree counterpart of :func:`install_biased_rejection_sampler`: before the plugin's (lossless) tree
    sampler runs, every node's token gets ``DRAFT_LOGIT_BOOST`` added to its target logit in its parent's
    row, so tree drafts are accepted more often than the target's probabilities allow."""
    from vllm_easyspec.integration.tree_sampler import TreeRejectionSampler

    runner = worker.model_runner
    original = runner.tree_sampler

    class DraftFavouringTreeSampler(TreeRejectionSampler):
        def verify(self, step, metadata, logits, sampling_metadata):
            logits = logits.clone()
            drafts = torch.tensor(metadata.num_draft_tokens)
            first_row = metadata.cu_num_sampled_tokens.long().cpu() - drafts - 1
            for request in step.requests:
                base = int(first_row[request.batch_row])
                for token, parent in zip(request.tokens, request.parents, strict=True):
                    logits[base + parent + 1, token] += DRAFT_LOGIT_BOOST
            return super().verify(step, metadata, logits, sampling_metadata)

    biased = DraftFavouringTreeSampler.__new__(DraftFavouringTreeSampler)
    biased.__dict__.update(original.__dict__)
    runner.easyspec_unbiased_sampler = original
    runner.tree_sampler = biased
    return type(biased).__name__


def restore_tree_sampler(worker) -> str:
    runner = worker.model_runner
    runner.tree_sampler = runner.easyspec_unbiased_sampler
    return type(runner.tree_sampler).__name__
