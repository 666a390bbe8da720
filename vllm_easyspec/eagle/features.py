"""Target features for EAGLE training, extracted once with transformers and cached.

Per sequence the cache holds (bf16 unless asked otherwise):

* ``final``: the target's final, post-norm hidden state (what vLLM hands an
  ``eagle`` head, and the input to the target's lm_head);
* ``aux``: the residual stream entering layers ``aux_layer_ids`` concatenated
  ([L, 3h]; vLLM's EAGLE-3 aux hidden state ``i`` == HF ``hidden_states[i]``);
* ``top1``: the target's greedy next token at every position.

The cache directory is keyed by the target, the sequences and the layer ids, so
re-running the trainer reuses it; a new sequence set takes the features of any
sequence an earlier cache of the same target already holds.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from .errors import HiddenSizeMismatchError


def target_config(target: str) -> dict:
    return json.loads((Path(target) / "config.json").read_text())


def cache_key(target: str, seqs: list[dict], aux_layer_ids: list[int], dtype: str) -> str:
    h = hashlib.sha256()
    cfg = (Path(target) / "config.json").read_text()
    h.update(os.path.realpath(target).encode())
    h.update(cfg.encode())
    for f in sorted(Path(target).glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}".encode())
    h.update(json.dumps([aux_layer_ids, dtype]).encode())
    for s in seqs:
        h.update(json.dumps([s["tokens"], s["loss_start"]]).encode())
    return h.hexdigest()[:20]


def load_target_embed_and_head(target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens.weight, lm_head.weight) as float32, read straight from safetensors."""
    from safetensors import safe_open

    files = sorted(Path(target).glob("*.safetensors"))
    emb = head = None
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                if k.endswith("embed_tokens.weight"):
                    emb = sf.get_tensor(k).float()
                elif k == "lm_head.weight":
                    head = sf.get_tensor(k).float()
    if emb is None:
        raise FileNotFoundError(f"no embed_tokens.weight in {target}")
    if head is None:  # tied embeddings
        head = emb
    return emb, head


def load_target_tensor(target: str, suffix: str) -> torch.Tensor | None:
    """The first tensor whose name ends with ``suffix`` (e.g. ``model.norm.weight``)."""
    from safetensors import safe_open

    for f in sorted(Path(target).glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                if k == suffix or k.endswith("." + suffix):
                    return sf.get_tensor(k).float()
    return None


class FeatureStore:
    """Features of many sequences, held in RAM (bf16) after one extraction."""

    def __init__(self, path: Path):
        self.path = Path(path)
        data = torch.load(self.path / "features.pt", mmap=True, weights_only=True)
        self.meta = json.loads((self.path / "meta.json").read_text())
        self.offsets = data["offsets"].tolist()
        self.tokens = data["tokens"]
        self.loss_start = data["loss_start"].tolist()
        self.final = data["final"]
        self.aux = data.get("aux")
        self.top1 = data["top1"]

    def __len__(self) -> int:
        return len(self.loss_start)

    def get(self, i: int) -> dict:
        a, b = self.offsets[i], self.offsets[i + 1]
        out = {"tokens": self.tokens[a:b].long(), "final": self.final[a:b],
               "top1": self.top1[a:b].long(), "loss_start": self.loss_start[i]}
        if self.aux is not None:
            out["aux"] = self.aux[a:b]
        return out

    @property
    def hidden_size(self) -> int:
        return int(self.final.shape[-1])


def _reusable_sequences(target: str, cache_root: Path, aux_layer_ids: list[int], dtype: str,
                        store_dtype: torch.dtype) -> dict[tuple, tuple[FeatureStore, int]]:
    """Sequences (by tokens) whose features an earlier cache of this target holds.

    A cache counts only if its directory key recomputes from its own sequences
    with this target, layer ids and dtype.
    """
    found: dict[tuple, tuple[FeatureStore, int]] = {}
    for meta in sorted(Path(cache_root).glob("features-*/meta.json")):
        path = meta.parent
        try:
            fs = FeatureStore(path)
        except (OSError, RuntimeError, KeyError, json.JSONDecodeError):
            continue
        if fs.final.dtype != store_dtype or (fs.aux is None) != (not aux_layer_ids):
            continue
        own = [{"tokens": fs.tokens[fs.offsets[i]:fs.offsets[i + 1]].tolist(), "loss_start": fs.loss_start[i]}
               for i in range(len(fs))]
        if f"features-{cache_key(target, own, aux_layer_ids, dtype)}" != path.name:
            continue
        for i, s in enumerate(own):
            found.setdefault(tuple(s["tokens"]), (fs, i))
    return found


@torch.no_grad()
def extract(target: str, seqs: list[dict], cache_root: Path, aux_layer_ids: list[int],
            dtype: str = "bfloat16", store_dtype: torch.dtype = torch.bfloat16,
            batch_tokens: int = 4096, log=print) -> FeatureStore:
    key = cache_key(target, seqs, aux_layer_ids, dtype)
    path = Path(cache_root) / f"features-{key}"
    if (path / "meta.json").exists():
        log(f"[eagle] reusing cached features {path}")
        fs = FeatureStore(path)
        want = int(target_config(target)["hidden_size"])
        if fs.hidden_size != want:
            raise HiddenSizeMismatchError(
                f"feature cache {path} has hidden size {fs.hidden_size}, target has {want}")
        return fs
    finals: list = [None] * len(seqs)
    auxs: list = [None] * len(seqs)
    top1s: list = [None] * len(seqs)
    known = _reusable_sequences(target, cache_root, aux_layer_ids, dtype, store_dtype)
    for j, s in enumerate(seqs):
        hit = known.get(tuple(s["tokens"]))
        if hit is not None:
            fs, i = hit
            got = fs.get(i)
            finals[j] = got["final"].clone()
            top1s[j] = got["top1"].to(torch.int32)
            if aux_layer_ids:
                auxs[j] = got["aux"].clone()
    todo = [j for j in range(len(seqs)) if finals[j] is None]
    n_reused = len(seqs) - len(todo)
    if n_reused:
        log(f"[eagle] features: {n_reused} of {len(seqs)} sequences reused from earlier caches")
    del known
    if todo:
        _extract_into(target, seqs, todo, aux_layer_ids, dtype, store_dtype, batch_tokens, finals, auxs, top1s)
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s["tokens"]))
    data = {
        "offsets": torch.tensor(offsets, dtype=torch.long),
        "tokens": torch.tensor([t for s in seqs for t in s["tokens"]], dtype=torch.int32),
        "loss_start": torch.tensor([s["loss_start"] for s in seqs], dtype=torch.long),
        "final": torch.cat(finals),
        "top1": torch.cat(top1s),
    }
    if aux_layer_ids:
        data["aux"] = torch.cat(auxs)
    tmp = Path(str(path) + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    torch.save(data, tmp / "features.pt")
    (tmp / "meta.json").write_text(json.dumps({
        "target": os.path.realpath(target), "aux_layer_ids": aux_layer_ids, "dtype": dtype,
        "n_sequences": len(seqs), "n_tokens": offsets[-1],
        "sources": sorted({s["source"].split(":")[0] for s in seqs}), "n_reused": n_reused,
    }))
    if path.exists():
        import shutil
        shutil.rmtree(path)
    os.replace(tmp, path)
    return FeatureStore(path)


def _extract_into(target: str, seqs: list[dict], todo: list[int], aux_layer_ids: list[int], dtype: str,
                  store_dtype: torch.dtype, batch_tokens: int, finals: list, auxs: list, top1s: list) -> None:
    """Run the target over ``seqs[todo]`` (longest first, padded batches) and fill the lists."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=tdt).eval()
    inner = model.model
    lm_head = model.get_output_embeddings()
    n_layers = model.config.num_hidden_layers
    for a in aux_layer_ids:
        if not 0 <= a <= n_layers:
            raise ValueError(f"aux layer id {a} out of range for {n_layers} layers")
    order = sorted(todo, key=lambda i: -len(seqs[i]["tokens"]))
    bar = tqdm(total=sum(len(seqs[j]["tokens"]) for j in todo), desc="features", unit="tok", mininterval=5)
    i = 0
    while i < len(order):
        L = len(seqs[order[i]]["tokens"])
        nb = max(1, batch_tokens // L)
        batch = order[i:i + nb]
        i += nb
        maxlen = max(len(seqs[j]["tokens"]) for j in batch)
        ids = torch.full((len(batch), maxlen), 0, dtype=torch.long)
        att = torch.zeros((len(batch), maxlen), dtype=torch.long)
        for r, j in enumerate(batch):
            t = seqs[j]["tokens"]
            ids[r, :len(t)] = torch.tensor(t)
            att[r, :len(t)] = 1
        out = inner(input_ids=ids, attention_mask=att, output_hidden_states=bool(aux_layer_ids))
        final = out.last_hidden_state
        top1 = lm_head(final).argmax(-1)
        for r, j in enumerate(batch):
            n = len(seqs[j]["tokens"])
            finals[j] = final[r, :n].to(store_dtype).clone()
            top1s[j] = top1[r, :n].to(torch.int32).clone()
            if aux_layer_ids:
                auxs[j] = torch.cat([out.hidden_states[a][r, :n] for a in aux_layer_ids], -1).to(store_dtype).clone()
            bar.update(n)
    bar.close()
