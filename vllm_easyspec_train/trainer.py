"""``vllm-easyspec train-eagle``: train an EAGLE / EAGLE-3 head on a CPU box.

Pipeline: data (self-distillation with vLLM + local text) -> target features
(transformers, cached) -> training (tqdm, held-out agreement, checkpoint/resume)
-> head in the reference format + ``eagle_manifest.json``.

Losses:

* ``eagle`` (EAGLE-1/2 paper): smooth-L1 regression of the next feature plus
  0.1 x cross-entropy against the target's next-token distribution, with uniform
  U(-0.1, 0.1) noise added to the input features.  One draft step by default
  (``--ttt-steps`` unrolls more, as in EAGLE-3's training-time test).
* ``eagle3`` (EAGLE-3 paper): training-time test over ``--ttt-steps`` steps (the
  head consumes its own hidden states), forward-KL to the target's distribution
  restricted to the draft vocabulary, step weights 0.8^(s-1); positions whose
  target token is outside the draft vocabulary are masked.  The draft
  vocabulary is the ``--draft-vocab-size`` most frequent target tokens.

Held-out metric: teacher-forced top-1 agreement with the target at draft steps
1..k, and the acceptance length a greedy chain of k drafts would get on the
held-out sequences (``1 + sum_s P(steps 1..s all agree)``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from .data import (
    default_text_dir,
    load_self_distill,
    self_distill,
    self_distill_items,
    sha256_text,
    split_heldout,
    text_windows,
)
from .errors import EagleTrainError, HiddenSizeMismatchError, NotEnoughDataError
from .features import (
    FeatureStore,
    MemoryFeatureStore,
    extract,
    extract_to_memory,
    load_target_embed_and_head,
    target_config,
)
from .model import FORMATS, EagleHead, head_config_from_target

STATE = "train_state.pt"
MANIFEST = "eagle_manifest.json"


# --------------------------------------------------------------------------- CLI
def add_train_eagle_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target / output")
    g.add_argument("--target", required=True, help="HF folder of a Llama or Qwen2 target")
    g.add_argument("--out", required=True, help="output folder for the head")
    g.add_argument("--format", choices=FORMATS, default="eagle3")
    g.add_argument("--work-dir", default=None,
                   help="cache for generated data and features (default ~/.cache/vllm-easyspec/eagle)")
    g = p.add_argument_group("data")
    g.add_argument("--prompt-set", choices=("coding", "broad"), default="coding",
                   help="coding: the 712 hand-written coding prompts; broad: the corpus of corpus.py (coding, "
                        "explanations, edits, completions cut from permissive local sources, follow-ups; "
                        "about 10,000 items by default)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="coding / --prompts-file: use the first N prompts; broad: build N items")
    g.add_argument("--prompts-file", default=None, help="JSON list or one-per-line prompts instead of the built-in set")
    g.add_argument("--corpus-file", default=None,
                   help="broad: read the corpus from this file (`python -m vllm_easyspec_train.corpus --out FILE`, "
                        "built where its sources are installed) instead of building it; --num-prompts N takes a "
                        "prefix")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--gen-chunk-size", type=int, default=64,
                   help="prompts per generation call; each finished chunk is saved (the resume point)")
    g.add_argument("--data-only", action="store_true",
                   help="stop after the data stage (self-distillation and text windows); rerun to resume it")
    g.add_argument("--no-self-distill", action="store_true")
    g.add_argument("--text-dir", default=None, help="local text (default: the Python stdlib sources)")
    g.add_argument("--text-tokens", type=int, default=60000, help="tokens of local text (0: none)")
    g.add_argument("--seq-len", type=int, default=512)
    g.add_argument("--val-fraction", type=float, default=0.05)
    g.add_argument("--min-train-tokens", type=int, default=2000)
    g.add_argument("--feature-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    g.add_argument("--feature-store", choices=("disk", "memory"), default="disk",
                   help="disk: cached shards under --work-dir (resumable, reused by later runs); memory: extracted "
                        "into --device's memory for this run only (a GPU: about 7 KB per token for a 0.5B target)")
    g.add_argument("--feature-batch-tokens", type=int, default=4096, help="tokens per target forward")
    g.add_argument("--gen-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    g = p.add_argument_group("head")
    g.add_argument("--draft-vocab-size", type=int, default=16384, help="eagle3 reduced vocabulary")
    g.add_argument("--head-intermediate-size", type=int, default=None,
                   help="MLP width of the head (default: the target's)")
    g.add_argument("--aux-layers", default=None, help="eagle3 target layers, e.g. 2,12,21")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=float, default=2.0)
    g.add_argument("--max-steps", type=int, default=None)
    g.add_argument("--batch-size", type=int, default=4)
    g.add_argument("--lr", type=float, default=5e-4)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--ttt-steps", type=int, default=None, help="default: 1 (eagle), 4 (eagle3)")
    g.add_argument("--noise", type=float, default=0.2, help="eagle: uniform noise width (U(-w/2, w/2))")
    g.add_argument("--ce-weight", type=float, default=0.1, help="eagle: weight of the token loss")
    g.add_argument("--eval-steps", type=int, default=5, help="k for held-out agreement at steps 1..k")
    g.add_argument("--eval-every", type=int, default=200)
    g.add_argument("--save-every", type=int, default=200)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--device", default="cpu", help="where features are extracted (memory store) and the head "
                                                   "trains: cpu, cuda, cuda:N; the checkpoint is the same")
    g.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole command: a memory-store extraction stops at half of them (training "
                        "uses the sequences done), the step count is cut to what the measured speed allows (after "
                        "CALIBRATION_STEPS steps, again after each evaluation), and the head is written in time")
    g.add_argument("--amp", choices=("bf16", "none"), default="bf16")
    g.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    g.add_argument("--init-from", default=None, help="start from an existing head folder")
    g.add_argument("--stop-after", type=int, default=None,
                   help="stop (saving the resume state) after this step, as if interrupted")
    g.add_argument("--quiet", action="store_true")


def run_train_eagle(args: argparse.Namespace) -> int:
    try:
        res = train(args)
    except EagleTrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": res["out"], "heldout": res["heldout"], "train_seconds": res["train_seconds"]}))
    return 0


# --------------------------------------------------------------------------- batches
def make_batch(store: FeatureStore | MemoryFeatureStore, idxs: list[int], fmt: str,
               device: str | torch.device = "cpu") -> dict:
    """The sequences ``idxs`` right-padded into one batch on ``device`` (features as float32)."""
    items = [store.get(i) for i in idxs]
    B, T = len(items), max(len(it["tokens"]) for it in items)
    H = store.hidden_size
    tokens = torch.zeros(B, T, dtype=torch.long, device=device)
    final = torch.zeros(B, T, H, device=device)
    top1 = torch.zeros(B, T, dtype=torch.long, device=device)
    valid = torch.zeros(B, T, dtype=torch.bool, device=device)  # position q carries a label
    feats = torch.zeros(B, T, 3 * H, device=device) if fmt == "eagle3" else None
    for r, it in enumerate(items):
        n = len(it["tokens"])
        tokens[r, :n] = it["tokens"]
        final[r, :n] = it["final"].float()
        top1[r, :n] = it["top1"]
        valid[r, it["loss_start"]:n] = True
        if feats is not None:
            feats[r, :n] = it["aux"].float()
    return {"tokens": tokens, "final": final, "top1": top1, "valid": valid, "feats": feats}


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int,
                  window_batches: int = 32) -> list[list[int]]:
    """One epoch's batches over positions ``0..len(lengths)-1``: every position exactly once.

    Positions are shuffled, cut into windows of ``window_batches`` batches, sorted by length within each
    window and split into batches, and the batches are shuffled again. A batch is padded to its longest
    sequence, so sorting within a window keeps the padding small (about 3% on the broad corpus, against
    45% for a plain shuffle at batch 4) while the batch order stays random. Depends only on its
    arguments, so an interrupted epoch resumes with the same batches.
    """
    g = torch.Generator().manual_seed(seed + 7919 * epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    window = batch_size * window_batches
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: lengths[i])
        batches += [chunk[a:a + batch_size] for a in range(0, len(chunk), batch_size)]
    return [batches[int(j)] for j in torch.randperm(len(batches), generator=g)]


def _chunked_soft_ce(pred_in: tuple[torch.Tensor, torch.Tensor], target_logits_fn, draft_logits_fn,
                     chunk: int = 1024):
    """sum over rows of -sum_v p_target(v) log p_draft(v), computed in row chunks with
    activation checkpointing so full-vocab logits never all live at once."""
    from torch.utils.checkpoint import checkpoint

    def f(x, t_in):
        with torch.no_grad():
            pt = torch.softmax(target_logits_fn(t_in).float(), -1)
        lq = torch.log_softmax(draft_logits_fn(x).float(), -1)
        return -(pt * lq).sum()

    x, t_in = pred_in
    total = x.new_zeros((), dtype=torch.float32)
    for a in range(0, x.shape[0], chunk):
        total = total + checkpoint(f, x[a:a + chunk], t_in[a:a + chunk], use_reentrant=False)
    return total


# Rows of the soft cross-entropy computed at once (their full-vocabulary logits live together).
SOFT_CE_CHUNK = {"cpu": 1024, "cuda": 8192}


class Trainer:
    """Losses and held-out evaluation of ``head`` on ``head``'s device (the target's embedding and
    ``lm_head`` are moved there, frozen)."""

    def __init__(self, head: EagleHead, embed_w: torch.Tensor, lm_head_w: torch.Tensor, args):
        self.head = head
        self.cfg = head.cfg
        self.device = next(head.parameters()).device
        self.embed = torch.nn.Embedding.from_pretrained(embed_w.to(self.device), freeze=True)
        self.lm_head_w = lm_head_w.to(self.device)  # [V, h] frozen
        self.args = args
        self.fmt = head.cfg.format
        self.ttt = args.ttt_steps or (4 if self.fmt == "eagle3" else 1)
        self.ce_chunk = SOFT_CE_CHUNK.get(self.device.type, 1024)
        if self.fmt == "eagle3":
            self.draft_lm_w = self.lm_head_w[head.draft_ids()].contiguous()

    def _autocast(self):
        if self.args.amp == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        import contextlib
        return contextlib.nullcontext()

    def loss(self, batch: dict, step: int) -> tuple[torch.Tensor, dict]:
        a = self.args
        tokens, final, valid = batch["tokens"], batch["final"], batch["valid"]
        noise = None
        if self.fmt == "eagle":
            inp = final
            if a.noise > 0:
                g = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
                noise = ((torch.rand(final.shape, generator=g) - 0.5) * a.noise).to(self.device)
        else:
            inp = batch["feats"]
        with self._autocast():
            outs = self.head.forward_steps(self.embed, tokens, inp, self.ttt, noise=noise)
        total = final.new_zeros(())
        logs = {}
        for s, out in enumerate(outs, start=1):
            n = out.shape[1]
            q = slice(s, s + n)
            m = valid[:, q]
            if self.fmt == "eagle3":
                m = m & self.head.t2d[batch["top1"][:, q]]
            cnt = m.sum()
            if cnt == 0:
                continue
            x = out[m].float()
            t_in = final[:, q][m]
            if self.fmt == "eagle":
                reg = F.smooth_l1_loss(x, t_in, reduction="none").mean(-1).sum() / cnt
                ce = _chunked_soft_ce((x, t_in), lambda h: F.linear(h, self.lm_head_w),
                                      lambda h: F.linear(h, self.lm_head_w), self.ce_chunk) / cnt
                ls = reg + a.ce_weight * ce
                logs[f"reg{s}"] = float(reg.detach())
                logs[f"ce{s}"] = float(ce.detach())
            else:
                ce = _chunked_soft_ce((x, t_in), lambda h: F.linear(h, self.draft_lm_w),
                                      lambda h: self.head.lm_head(h), self.ce_chunk) / cnt
                ls = ce
                logs[f"ce{s}"] = float(ce.detach())
            total = total + (0.8 ** (s - 1)) * ls
        return total, logs

    @torch.no_grad()
    def evaluate(self, store: FeatureStore | MemoryFeatureStore, idxs: list[int], k: int, bs: int = 4) -> dict:
        self.head.eval()
        agree = torch.zeros(k, device=self.device)
        count = torch.zeros(k, device=self.device)
        chain_sum = torch.zeros(k, device=self.device)  # P(steps 1..s all agree), over anchors with all k labels
        chain_n = 0
        for i in range(0, len(idxs), bs):
            b = make_batch(store, idxs[i:i + bs], self.fmt, self.device)
            inp = b["final"] if self.fmt == "eagle" else b["feats"]
            with self._autocast():
                outs = self.head.forward_steps(self.embed, b["tokens"], inp, k)
            T = b["tokens"].shape[1]
            corr_all = []
            for s, out in enumerate(outs, start=1):
                n = out.shape[1]
                logits = self.head.logits(out.float(), self.lm_head_w)
                pred = logits.argmax(-1)
                if self.fmt == "eagle3":
                    pred = self.head.draft_ids()[pred]
                lab = b["top1"][:, s:s + n]
                m = b["valid"][:, s:s + n]
                c = (pred == lab) & m
                agree[s - 1] += c.sum()
                count[s - 1] += m.sum()
                corr_all.append((c, m))
            if len(outs) == k:
                n = T - k
                if n > 0:
                    ok = torch.ones_like(corr_all[0][0][:, :n])
                    allm = torch.ones_like(ok)
                    for s in range(k):
                        c, m = corr_all[s]
                        allm &= m[:, :n]
                    for s in range(k):
                        c, _ = corr_all[s]
                        ok = ok & c[:, :n]
                        chain_sum[s] += (ok & allm).sum()
                    chain_n += int(allm.sum())
        self.head.train()
        acc = (agree / count.clamp(min=1)).tolist()
        chain = (chain_sum / max(chain_n, 1)).tolist()
        return {"agreement": [round(x, 4) for x in acc],
                "chain_prefix": [round(x, 4) for x in chain],
                "accept_length_k": round(1 + sum(chain), 3),
                "n_positions": int(count[0])}


def lr_at(step: int, total: int, base: float) -> float:
    warm = max(1, min(100, total // 20))
    if step < warm:
        return base * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def choose_draft_vocab(store: FeatureStore | MemoryFeatureStore, idxs: list[int], size: int, vocab: int
                       ) -> tuple[torch.Tensor, dict]:
    counts = torch.zeros(vocab, dtype=torch.long)
    for i in idxs:
        it = store.get(i)
        lab = it["top1"][it["loss_start"]:].cpu()
        counts += torch.bincount(lab, minlength=vocab)
    # also count the input tokens so the vocabulary is never tiny on small data
    order = sorted(range(vocab), key=lambda t: (-int(counts[t]), t))
    chosen = torch.tensor(sorted(order[:size]), dtype=torch.long)
    tot = int(counts.sum())
    cov = int(counts[chosen].sum()) / max(tot, 1)
    return chosen, {"draft_vocab_size": size, "label_coverage_train": round(cov, 4),
                    "distinct_labels_train": int((counts > 0).sum())}


@torch.no_grad()
def init_from_head(head: EagleHead, src: EagleHead, target_lm_head: torch.Tensor) -> dict:
    """Start ``head`` from ``src``'s trained weights, keeping ``head``'s own draft vocabulary.

    Every weight but the eagle3 output map is copied. A draft token's ``lm_head`` row is ``src``'s trained
    row where ``src``'s vocabulary has the token, and the target's ``lm_head`` row otherwise (as a fresh head
    starts). Returns how many draft tokens the two vocabularies share."""
    differ = [f for f in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                          "head_dim", "vocab_size", "target_num_layers")
              if getattr(src.cfg, f) != getattr(head.cfg, f)]
    if differ:
        raise HiddenSizeMismatchError(
            "--init-from head differs from the head to train in " + ", ".join(
                f"{f} ({getattr(src.cfg, f)} vs {getattr(head.cfg, f)})" for f in differ)
            + "; pass matching --head-intermediate-size, or train without --init-from")
    output_map = {"lm_head.weight", "d2t", "t2d"}
    own = {k: v for k, v in src.state_dict().items() if k not in output_map}
    loaded = head.load_state_dict(own, strict=False)
    assert set(loaded.missing_keys) <= output_map and not loaded.unexpected_keys, loaded
    if not head.is3:
        return {"shared_draft_tokens": None}
    new_ids, src_ids = head.draft_ids(), src.draft_ids()
    src_row = torch.full((head.cfg.vocab_size,), -1, dtype=torch.long)
    src_row[src_ids] = torch.arange(src_ids.numel())
    rows = src_row[new_ids]
    shared = rows >= 0
    head.lm_head.weight.copy_(target_lm_head[new_ids].to(head.lm_head.weight.dtype))
    head.lm_head.weight[shared] = src.lm_head.weight[rows[shared]].to(head.lm_head.weight.dtype)
    return {"shared_draft_tokens": int(shared.sum()), "draft_vocab_size": int(new_ids.numel())}


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__)).stdout.strip() or None
    except OSError:
        return None


def _command_line(args) -> str:
    argv = getattr(args, "_argv", None)
    if argv is None:
        argv = sys.argv[1:]
        if argv and argv[0] == "train-eagle":
            argv = argv[1:]
    return "vllm-easyspec train-eagle " + " ".join(shlex.quote(a) for a in argv)


def _read_prompts(args) -> tuple[list[str], str]:
    """(prompts, name) for ``--prompt-set coding`` or ``--prompts-file``; ``--num-prompts`` takes a prefix."""
    from .prompts import train_prompts

    if getattr(args, "prompt_set", "coding") != "coding" and args.prompts_file:
        raise EagleTrainError("--prompts-file replaces the built-in prompt set; use it with --prompt-set coding")
    if args.prompts_file:
        text = Path(args.prompts_file).read_text()
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError:
            prompts = [line.strip() for line in text.splitlines() if line.strip()]
        name = f"file:{args.prompts_file}"
    else:
        prompts = train_prompts()
        name = "vllm_easyspec_train.prompts.train_prompts"
    if args.num_prompts is not None:
        prompts = prompts[: args.num_prompts]
    return prompts, name


def _read_corpus(args, log=print):
    """``--prompt-set broad``: the corpus in ``--corpus-file`` (its first ``--num-prompts`` items), or
    the one ``corpus.build_corpus`` builds with ``--num-prompts`` items (default
    ``corpus.DEFAULT_N_ITEMS``) and ``--seed``."""
    from .corpus import DEFAULT_N_ITEMS, Corpus, build_corpus

    if args.prompts_file:
        raise EagleTrainError("--prompts-file replaces the built-in prompt set; use it with --prompt-set coding")
    if getattr(args, "corpus_file", None):
        try:
            c = Corpus.read_jsonl(args.corpus_file)
        except (OSError, ValueError) as e:
            raise EagleTrainError(f"--corpus-file: {e}") from e
        if args.num_prompts is not None and args.num_prompts < len(c.items):
            c = c.subset(range(args.num_prompts), f"--num-prompts {args.num_prompts}")
        log(f"[eagle] corpus file {args.corpus_file}: {len(c.items)} items {c.counts()}")
        return c
    c = build_corpus(args.num_prompts if args.num_prompts is not None else DEFAULT_N_ITEMS, args.seed)
    log(f"[eagle] broad corpus: {len(c.items)} items {c.counts()} from {len(c.manifest['roots'])} sources "
        f"({c.seconds:.0f} s)")
    return c


# --------------------------------------------------------------------------- main
CALIBRATION_STEPS = 10  # --time-budget: steps timed (after the first) before the step count is fitted
FEATURE_SHARE = 0.5  # --time-budget: the most of it a memory-store extraction may take
SAVE_RESERVE_SECONDS = 5.0  # --time-budget: kept for writing the head after the final evaluation


def _log_fn(args):
    return (lambda *a, **k: None) if args.quiet else (lambda *a, **k: print(*a, **k, file=sys.stderr, flush=True))


def _load_tokenizer(target: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(target)
    if (Path(target) / "tokenizer.json").exists() and not tok("def f(x): return x", add_special_tokens=False)["input_ids"]:
        # a model-type tokenizer class that ignores this tokenizer.json (seen with word-level test vocabularies)
        tok = PreTrainedTokenizerFast.from_pretrained(target)
    return tok


def _data_stage(args, target: str, work: Path, log) -> tuple[list[dict], dict]:
    """(sequences, provenance): the self-distilled answers (cached and resumable) and the local text."""
    seqs: list[dict] = []
    provenance: dict = {"sources": []}
    if not args.no_self_distill:
        chunk = getattr(args, "gen_chunk_size", 64)
        corpus_info = {}
        if getattr(args, "prompt_set", "coding") == "broad":
            corpus = _read_corpus(args, log)
            prompts = [it.to_dict() for it in corpus.items]
            pname = (f"file:{Path(args.corpus_file).name}" if getattr(args, "corpus_file", None)
                     else "vllm_easyspec_train.corpus.build_corpus")
            corpus_info = {"corpus": corpus.manifest}
            jl, info = self_distill_items(target, corpus.items, work, args.max_new_tokens, args.seed,
                                          args.gen_dtype, log, chunk_size=chunk)
        else:
            prompts, pname = _read_prompts(args)
            jl, info = self_distill(target, prompts, work, args.max_new_tokens, args.seed, args.gen_dtype, log,
                                    chunk_size=chunk)
        sd_stats: dict = {}
        sd = load_self_distill(jl, args.seq_len, sd_stats)
        if sd_stats["dropped"]:
            log(f"[eagle] {sd_stats['dropped']} of {sd_stats['records']} answers left out: empty, or the prompt "
                f"fills --seq-len {args.seq_len}")
        seqs += sd
        provenance["sources"].append({
            "kind": "self-distillation", "prompt_set": pname, "n_prompts": len(prompts),
            "prompts_sha256": sha256_text(json.dumps(prompts)), "generator": "vLLM, target itself", **corpus_info,
            "sampling": {"temperature": 0.0, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                         "dtype": args.gen_dtype},
            "n_sequences": len(sd), "n_tokens": sum(len(s["tokens"]) for s in sd),
            "n_response_tokens": sum(len(s["tokens"]) - s["loss_start"] - 1 for s in sd),
            "generation_info": info})
    if args.text_tokens > 0:
        tdir = args.text_dir or default_text_dir()
        tw, tinfo = text_windows(_load_tokenizer(target), tdir, args.text_tokens, args.seq_len, args.seed)
        seqs += tw
        provenance["sources"].append({"kind": "local-text", "python": platform.python_version(), **tinfo})
    return seqs, provenance


def _feature_stage(args, target: str, all_seqs: list[dict], n_train: int, work: Path, aux_layer_ids: list[int],
                   deadline: float | None, log) -> tuple[FeatureStore | MemoryFeatureStore, list[int], list[int]]:
    """(store, train indices, held-out indices) over ``all_seqs`` (its first ``n_train`` are training
    sequences). The memory store extracts the held-out sequences first, so that a cut at ``deadline``
    leaves the evaluation whole and trains on the training sequences extracted in time."""
    tr_idx, va_idx = list(range(n_train)), list(range(n_train, len(all_seqs)))
    if args.feature_store == "disk":
        store = extract(target, all_seqs, work, aux_layer_ids, args.feature_dtype, log=log,
                        batch_tokens=args.feature_batch_tokens, device=args.device)
        return store, tr_idx, va_idx
    store_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.feature_dtype]
    store = extract_to_memory(target, all_seqs, aux_layer_ids, args.feature_dtype, args.device, store_dtype,
                              args.feature_batch_tokens, order=va_idx + tr_idx, deadline=deadline, log=log)
    done = set(store.available)
    if len(done) < len(all_seqs):
        tr_idx, va_idx = [i for i in tr_idx if i in done], [i for i in va_idx if i in done]
        log(f"[eagle] features in time for {len(tr_idx)} of {n_train} training sequences and {len(va_idx)} "
            f"of {len(all_seqs) - n_train} held-out ones")
        if not tr_idx or not va_idx:
            raise NotEnoughDataError(f"--time-budget {args.time_budget}: features for {len(tr_idx)} training and "
                                     f"{len(va_idx)} held-out sequences only; allow more time or use less data")
    return store, tr_idx, va_idx


def _build_head(args, hcfg, store, tr_idx: list[int], lm_w: torch.Tensor) -> tuple[EagleHead, dict, dict]:
    """(head on ``--device``, draft-vocabulary info, ``--init-from`` info): built on the host, so a seed
    gives the same initial head on every device."""
    vocab_info: dict = {}
    if hcfg.format == "eagle3":
        n_distinct = int(torch.unique(torch.cat([store.get(i)["top1"] for i in tr_idx])).numel())
        if hcfg.draft_vocab_size > hcfg.vocab_size:
            hcfg.draft_vocab_size = hcfg.vocab_size
        draft_ids, vocab_info = choose_draft_vocab(store, tr_idx, hcfg.draft_vocab_size, hcfg.vocab_size)
        vocab_info["distinct_target_tokens_train"] = n_distinct
    torch.manual_seed(args.seed)
    head = EagleHead(hcfg)
    if hcfg.format == "eagle3":
        head.set_draft_vocab(draft_ids)
        # Start from the target's own output map (its lm_head rows of the draft vocabulary).
        # The final norm starts at 1, not at the target's (Qwen2.5's is ~7 on average, which
        # makes the first logits so large that training stalls).
        with torch.no_grad():
            head.lm_head.weight.copy_(lm_w[draft_ids])
    init_info: dict = {}
    if args.init_from:
        src = ckpt.load_head(args.init_from)
        if src.cfg.hidden_size != hcfg.hidden_size or src.cfg.format != hcfg.format:
            raise HiddenSizeMismatchError(
                f"--init-from head has format {src.cfg.format}, hidden size {src.cfg.hidden_size}; "
                f"target needs {hcfg.format}, {hcfg.hidden_size}")
        init_info = init_from_head(head, src, lm_w)
    return head.to(args.device), vocab_info, init_info


def fit_steps(step: int, total: int, seconds_left: float, step_seconds: float, eval_every: int = 0,
              eval_seconds: float = 0.0, margin: float = 0.9) -> int:
    """The step count a run at ``step`` of ``total`` can reach in ``seconds_left`` (``margin`` of it) at
    ``step_seconds`` a step plus an evaluation of ``eval_seconds`` every ``eval_every`` steps: never below
    ``step + 1`` nor above ``total``."""
    per_step = step_seconds + (eval_seconds / eval_every if eval_every else 0.0)
    return max(step + 1, min(total, step + int(margin * max(0.0, seconds_left) / max(per_step, 1e-9))))


def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def train(args: argparse.Namespace) -> dict:
    torch.set_num_threads(max(1, args.threads))
    torch.manual_seed(args.seed)
    log = _log_fn(args)
    target = str(Path(args.target).resolve())
    out = Path(args.out)
    tcfg = target_config(target)
    aux = [int(x) for x in args.aux_layers.split(",")] if args.aux_layers else None
    hcfg = head_config_from_target(tcfg, args.format, args.draft_vocab_size, aux, args.head_intermediate_size)
    work = Path(args.work_dir or Path.home() / ".cache" / "vllm-easyspec" / "eagle")
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    if args.feature_store == "memory" and (args.resume or args.stop_after is not None):
        raise EagleTrainError("--feature-store memory keeps no features between runs; --resume and --stop-after "
                              "need --feature-store disk")

    # ---- data
    seqs, provenance = _data_stage(args, target, work, log)
    if getattr(args, "data_only", False):
        n_tok = sum(len(s["tokens"]) for s in seqs)
        log(f"[eagle] data stage done: {len(seqs)} sequences, {n_tok} tokens (--data-only)")
        return {"out": str(out), "heldout": None, "train_seconds": 0.0, "manifest": None,
                "data": {**provenance, "n_sequences": len(seqs), "n_tokens": n_tok}}
    train_seqs, val_seqs = split_heldout(seqs, args.val_fraction, args.seed, args.min_train_tokens)
    all_seqs = train_seqs + val_seqs
    log(f"[eagle] data: {len(train_seqs)} train / {len(val_seqs)} held-out sequences, "
        f"{sum(len(s['tokens']) for s in all_seqs)} tokens")

    # ---- features
    t_feat = time.time()
    deadline = None if args.time_budget is None else t_start + args.time_budget
    feature_deadline = None if deadline is None else t_start + FEATURE_SHARE * args.time_budget
    store, tr_idx, va_idx = _feature_stage(args, target, all_seqs, len(train_seqs), work, hcfg.aux_layer_ids,
                                           feature_deadline, log)
    feat_s = time.time() - t_feat
    if store.hidden_size != hcfg.hidden_size:
        raise HiddenSizeMismatchError(f"features have hidden size {store.hidden_size}, target {hcfg.hidden_size}")
    embed_w, lm_w = load_target_embed_and_head(target)
    if embed_w.shape[1] != hcfg.hidden_size or lm_w.shape[1] != hcfg.hidden_size:
        raise HiddenSizeMismatchError(
            f"target embeddings are {tuple(embed_w.shape)}, config hidden_size is {hcfg.hidden_size}")

    # ---- head
    head, vocab_info, init_info = _build_head(args, hcfg, store, tr_idx, lm_w)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    trainer = Trainer(head, embed_w, lm_w, args)
    run = _train_loop(args, hcfg, head, opt, trainer, store, tr_idx, va_idx, out, deadline, log)
    if run.get("stopped") is not None:
        return {"out": str(out), "heldout": run["last_eval"], "train_seconds": run["seconds"], "manifest": None,
                "stopped": run["stopped"]}

    # ---- write head + manifest
    used = {"train": [all_seqs[i] for i in tr_idx], "heldout": [all_seqs[i] for i in va_idx]}
    manifest = {
        "format": hcfg.format,
        "target": {"path": target, "architectures": tcfg.get("architectures"),
                   "config_sha256": sha256_text((Path(target) / "config.json").read_text()),
                   "hidden_size": hcfg.hidden_size, "num_layers": hcfg.target_num_layers},
        "head_config": hcfg.to_dict(),
        "draft_vocab": vocab_info,
        "data": {**provenance, "train_sequences": len(used["train"]), "heldout_sequences": len(used["heldout"]),
                 "train_tokens": sum(len(s["tokens"]) for s in used["train"]),
                 "heldout_tokens": sum(len(s["tokens"]) for s in used["heldout"]),
                 "feature_dtype": args.feature_dtype, "feature_cache": str(store.path)},
        "training": {"steps": run["step"], "batch_size": args.batch_size, "lr": args.lr, "ttt_steps": trainer.ttt,
                     "noise": args.noise if hcfg.format == "eagle" else None,
                     "ce_weight": args.ce_weight if hcfg.format == "eagle" else None,
                     "seed": args.seed, "amp": args.amp, "threads": args.threads, "init_from": init_info or None,
                     "train_seconds": round(run["seconds"], 1), "feature_seconds": round(feat_s, 1),
                     "total_seconds": round(time.time() - t_start, 1), **run["budget"],
                     "device": args.device, "cpu": _device_name(args.device), "torch": torch.__version__},
        "heldout": run["last_eval"],
        "history": run["history"],
        "command": _command_line(args),
        "stages": run["stages"],
        "git_commit": _git_commit(),
    }
    ckpt.save_head(head, out, torch.bfloat16, {MANIFEST: json.dumps(manifest, indent=2) + "\n"})
    return {"out": str(out), "heldout": run["last_eval"], "train_seconds": round(run["seconds"], 1),
            "manifest": manifest}


def _train_loop(args, hcfg, head: EagleHead, opt, trainer: Trainer, store, tr_idx: list[int], va_idx: list[int],
                out: Path, deadline: float | None, log) -> dict:
    """Train until the step count (``--max-steps``, else ``--epochs``; fitted to ``deadline`` when there is
    one), saving the resume state every ``--save-every`` steps and evaluating every ``--eval-every``. Returns
    the final step, seconds, history, stages, last evaluation, budget record and ``stopped`` (the step of a
    ``--stop-after``)."""
    train_lengths = [store.sequence_length(i) for i in tr_idx]
    steps_per_epoch = len(epoch_batches(train_lengths, args.batch_size, args.seed, 0))
    total = args.max_steps or max(1, int(round(args.epochs * steps_per_epoch)))
    budget = {"planned_steps": total, **({"time_budget": args.time_budget} if deadline is not None else {})}
    step = 0
    seen = {"tokens": 0, "loss_tokens": 0}  # sequence tokens and loss positions the steps so far trained on
    history: list = []
    stages: list = []  # every command that trained this head, with the steps it ran
    train_s_prev = 0.0
    out.mkdir(parents=True, exist_ok=True)
    if args.resume and (out / STATE).exists():
        st = torch.load(out / STATE, weights_only=False, map_location=args.device)
        if st["head_config"]["hidden_size"] != hcfg.hidden_size or st["head_config"]["format"] != hcfg.format:
            raise HiddenSizeMismatchError(
                f"resume state in {out} is for format {st['head_config']['format']} / hidden size "
                f"{st['head_config']['hidden_size']}, target needs {hcfg.format} / {hcfg.hidden_size}")
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        step, history, train_s_prev = st["step"], st["history"], st.get("train_seconds", 0.0)
        seen = st.get("seen", seen)
        stages = st.get("stages", [])
        log(f"[eagle] resumed at step {step}/{total}")

    stages.append({"command": _command_line(args), "from_step": step, "to_step": step})
    t_train = time.time()
    calibrate_from = (step + 1, 0.0)  # (step, time) after the first step of this run, which warms up
    step_s = eval_s = 0.0  # measured: seconds a step, seconds an evaluation

    def fit(reason: str) -> None:
        nonlocal total
        left = deadline - time.time() - eval_s - SAVE_RESERVE_SECONDS
        fitted = fit_steps(step, total, left, step_s, args.eval_every, eval_s)
        if fitted < total:
            log(f"\n[eagle] {reason}: {step_s:.3f} s a step, {eval_s:.1f} s an evaluation; {fitted} of {total} "
                f"steps fit in --time-budget {args.time_budget}")
            total = bar.total = fitted
        budget.update({"step_seconds": round(step_s, 4), "eval_seconds": round(eval_s, 2), "steps_fitted": total})

    def save_state():
        stages[-1]["to_step"] = step
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "history": history,
                    "stages": stages, "seen": seen,
                    "head_config": hcfg.to_dict(), "train_seconds": train_s_prev + (time.time() - t_train)},
                   out / (STATE + ".tmp"))
        os.replace(out / (STATE + ".tmp"), out / STATE)

    head.train()
    bar = tqdm(total=total, initial=step, desc=f"train {hcfg.format}", unit="step",
               disable=True if args.quiet else None, mininterval=2)  # None: shown on a terminal only
    last_eval = history[-1]["heldout"] if history else None
    batches, batches_epoch = [], -1
    while step < total:
        epoch, within = divmod(step, steps_per_epoch)
        if epoch != batches_epoch:
            batches, batches_epoch = epoch_batches(train_lengths, args.batch_size, args.seed, epoch), epoch
        bidx = [tr_idx[j] for j in batches[within]]
        batch = make_batch(store, bidx, hcfg.format, trainer.device)
        seen["tokens"] += sum(store.sequence_length(i) for i in bidx)
        seen["loss_tokens"] += int(batch["valid"].sum())
        for gp in opt.param_groups:
            gp["lr"] = lr_at(step, total, args.lr)
        loss, logs = trainer.loss(batch, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        step += 1
        if deadline is not None:
            if step == calibrate_from[0]:
                calibrate_from = (step, time.time())
            elif step == calibrate_from[0] + CALIBRATION_STEPS:
                step_s = (time.time() - calibrate_from[1]) / CALIBRATION_STEPS
                fit("calibrated")
            if time.time() + eval_s + SAVE_RESERVE_SECONDS >= deadline and step < total:
                log(f"\n[eagle] --time-budget {args.time_budget} reached at step {step} of {total}")
                budget["stopped_at_deadline"] = step
                total = step
        post = {"loss": f"{float(loss.detach()):.3f}"}
        if last_eval:
            post["agree@1"] = last_eval["agreement"][0]
        bar.set_postfix(post)
        bar.update(1)
        if step % args.eval_every == 0 or step == total:
            t_eval = time.time()
            last_eval = trainer.evaluate(store, va_idx, args.eval_steps)
            eval_s = time.time() - t_eval
            if deadline is not None and step_s and step < total:
                fit("after an evaluation")
            history.append({"step": step, "tokens_seen": seen["tokens"], "loss_tokens_seen": seen["loss_tokens"],
                            "loss": float(loss.detach()), **logs, "heldout": last_eval})
            log(f"\n[eagle] step {step}: loss {float(loss.detach()):.4f} held-out agreement@1..{args.eval_steps} "
                f"{last_eval['agreement']} accept_len(k={args.eval_steps}) {last_eval['accept_length_k']}")
        if args.feature_store == "disk" and (step % args.save_every == 0 or step == total):
            save_state()
        if args.stop_after is not None and step >= args.stop_after and step < total:
            save_state()
            bar.close()
            log(f"[eagle] stopped after step {step}; continue with --resume")
            return {"step": step, "seconds": round(time.time() - t_train, 1), "last_eval": last_eval,
                    "stopped": step}
    bar.close()
    stages[-1]["to_step"] = step
    if last_eval is None:
        last_eval = trainer.evaluate(store, va_idx, args.eval_steps)
    return {"step": step, "seconds": train_s_prev + (time.time() - t_train), "history": history, "stages": stages,
            "last_eval": last_eval, "budget": budget, "stopped": None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-easyspec train-eagle", description=__doc__.split("\n")[0])
    add_train_eagle_arguments(p)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    args._argv = argv
    return run_train_eagle(args)


if __name__ == "__main__":
    sys.exit(main())
