"""Target features for EAGLE training, extracted once with transformers and cached.

Per sequence the cache holds (bf16 unless asked otherwise):

* ``final``: the target's final, post-norm hidden state (what vLLM hands an
  ``eagle`` head, and the input to the target's lm_head);
* ``aux``: the residual stream entering layers ``aux_layer_ids`` concatenated
  ([L, 3h]; vLLM's EAGLE-3 aux hidden state ``i`` == HF ``hidden_states[i]``);
* ``top1``: the target's greedy next token at every position.

The cache directory is keyed by the target, the sequences and the layer ids, so
re-running the trainer reuses it; a new sequence set takes the features of any
sequence an earlier cache of the same target already holds. It is written in
shards of about ``SHARD_TOKENS`` tokens, so extraction resumes after an
interruption and its memory stays bounded by one shard.

On a GPU the features can stay in its memory instead (``extract_to_memory``, a
``MemoryFeatureStore``: about 7 KB per token for a 0.5B target's EAGLE-3 features, so 5M
tokens take 36 GB), extracted there with the target on the same device; nothing is written.
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


SHARD_TOKENS = 65536  # tokens per shard: about 0.5 GB of bf16 EAGLE-3 features for a 0.5B target


class FeatureStore:
    """Features of many sequences, read through mmap from the cache's shards (``shard-*.pt``, or one
    ``features.pt`` in caches written before shards): a batch reads its own rows, nothing more stays in RAM."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.meta = json.loads((self.path / "meta.json").read_text())
        files = sorted(self.path.glob("shard-*.pt")) or [self.path / "features.pt"]
        self._shards = [torch.load(f, mmap=True, weights_only=True) for f in files]
        self.offsets = [0]
        self.loss_start: list[int] = []
        self._where: list[tuple[int, int]] = []  # sequence -> (shard, its index there)
        self._local_offsets = [shard["offsets"].tolist() for shard in self._shards]
        for k, (shard, local) in enumerate(zip(self._shards, self._local_offsets, strict=True)):
            for i in range(len(local) - 1):
                self._where.append((k, i))
                self.offsets.append(self.offsets[-1] + local[i + 1] - local[i])
            self.loss_start += shard["loss_start"].tolist()
        first = self._shards[0]
        self.feature_dtype = first["final"].dtype
        self.has_aux = first.get("aux") is not None

    def __len__(self) -> int:
        return len(self.loss_start)

    def sequence_length(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def _span(self, i: int) -> tuple[dict, int, int]:
        """Sequence ``i``'s shard and its rows ``[a, b)`` there."""
        shard, local = self._where[i]
        offsets = self._local_offsets[shard]
        return self._shards[shard], offsets[local], offsets[local + 1]

    def tokens_of(self, i: int) -> list[int]:
        data, a, b = self._span(i)
        return data["tokens"][a:b].tolist()

    def get(self, i: int) -> dict:
        data, a, b = self._span(i)
        out = {"tokens": data["tokens"][a:b].long(), "final": data["final"][a:b],
               "top1": data["top1"][a:b].long(), "loss_start": self.loss_start[i]}
        if self.has_aux:
            out["aux"] = data["aux"][a:b]
        return out

    @property
    def hidden_size(self) -> int:
        return int(self._shards[0]["final"].shape[-1])


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
        if fs.feature_dtype != store_dtype or fs.has_aux != bool(aux_layer_ids):
            continue
        own = [{"tokens": fs.tokens_of(i), "loss_start": fs.loss_start[i]} for i in range(len(fs))]
        if f"features-{cache_key(target, own, aux_layer_ids, dtype)}" != path.name:
            continue
        for i, s in enumerate(own):
            found.setdefault(tuple(s["tokens"]), (fs, i))
    return found


def shard_ranges(seqs: list[dict], shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive ``[a, b)`` ranges of ``seqs``, each of at most ``shard_tokens`` tokens (or one sequence)."""
    ranges, start, tokens = [], 0, 0
    for j, s in enumerate(seqs):
        n = len(s["tokens"])
        if j > start and tokens + n > shard_tokens:
            ranges.append((start, j))
            start, tokens = j, 0
        tokens += n
    if start < len(seqs):
        ranges.append((start, len(seqs)))
    return ranges


@torch.no_grad()
def extract(target: str, seqs: list[dict], cache_root: Path, aux_layer_ids: list[int],
            dtype: str = "bfloat16", store_dtype: torch.dtype = torch.bfloat16,
            batch_tokens: int = 4096, log=print, device: str | torch.device = "cpu") -> FeatureStore:
    """The features of ``seqs``, from their cache when it is complete; else extracted shard by shard into
    ``features-KEY.partial`` (a finished shard is never redone: an interrupted run resumes at the next one),
    taking the features of sequences that earlier caches of the target hold, then moved to ``features-KEY``.
    The target runs on ``device``; the shards are written from the host."""
    from tqdm.auto import tqdm

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
    partial = Path(str(path) + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    ranges = shard_ranges(seqs, SHARD_TOKENS)
    shard_files = [partial / f"shard-{k:05d}.pt" for k in range(len(ranges))]
    done = sum(f.exists() for f in shard_files)
    if done:
        log(f"[eagle] features: resuming, {done} of {len(ranges)} shards already extracted in {partial}")
    known = _reusable_sequences(target, cache_root, aux_layer_ids, dtype, store_dtype)
    model_cache: dict = {"device": device}
    n_reused = 0
    bar = tqdm(total=sum(len(s["tokens"]) for s in seqs), desc="features", unit="tok", mininterval=5)
    for (a, b), shard_file in zip(ranges, shard_files, strict=True):
        shard_seqs = seqs[a:b]
        if shard_file.exists():
            bar.update(sum(len(s["tokens"]) for s in shard_seqs))
            continue
        finals: list = [None] * len(shard_seqs)
        auxs: list = [None] * len(shard_seqs)
        top1s: list = [None] * len(shard_seqs)
        for j, s in enumerate(shard_seqs):
            hit = known.get(tuple(s["tokens"]))
            if hit is not None:
                fs, i = hit
                got = fs.get(i)
                finals[j] = got["final"].clone()
                top1s[j] = got["top1"].to(torch.int32)
                if aux_layer_ids:
                    auxs[j] = got["aux"].clone()
                bar.update(len(s["tokens"]))
        todo = [j for j in range(len(shard_seqs)) if finals[j] is None]
        n_reused += len(shard_seqs) - len(todo)
        if todo:
            _extract_into(target, shard_seqs, todo, aux_layer_ids, dtype, store_dtype, batch_tokens, finals,
                          auxs, top1s, model_cache, bar)
        _save_shard(shard_file, shard_seqs, finals, auxs, top1s, aux_layer_ids)
    bar.close()
    if n_reused:
        log(f"[eagle] features: {n_reused} of {len(seqs)} sequences reused from earlier caches")
    (partial / "meta.json").write_text(json.dumps({
        "target": os.path.realpath(target), "aux_layer_ids": aux_layer_ids, "dtype": dtype,
        "n_sequences": len(seqs), "n_tokens": sum(len(s["tokens"]) for s in seqs), "n_shards": len(ranges),
        "sources": sorted({s["source"].split(":")[0] for s in seqs}), "n_reused": n_reused,
    }))
    if path.exists():
        import shutil
        shutil.rmtree(path)
    os.replace(partial, path)
    return FeatureStore(path)


def _save_shard(shard_file: Path, seqs: list[dict], finals: list, auxs: list, top1s: list,
                aux_layer_ids: list[int]) -> None:
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
    tmp = Path(str(shard_file) + ".tmp")
    torch.save(data, tmp)
    os.replace(tmp, shard_file)


def load_target_model(target: str, dtype: str, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The target as a transformers causal LM in ``dtype`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    return AutoModelForCausalLM.from_pretrained(target, dtype=tdt).to(device).eval()


def _target_batches(model: torch.nn.Module, seqs: list[dict], todo: list[int], aux_layer_ids: list[int],
                    batch_tokens: int, deadline: float | None = None):
    """Run ``model`` over ``seqs[todo]`` (longest first, right-padded batches of about ``batch_tokens``
    tokens, on the model's device) and yield ``(j, final, aux, top1)`` per sequence: its rows only, on that
    device, ``aux`` None without ``aux_layer_ids``. No batch starts once ``time.time()`` passes ``deadline``."""
    import time

    inner = model.model
    lm_head = model.get_output_embeddings()
    device = next(model.parameters()).device
    n_layers = model.config.num_hidden_layers
    for a in aux_layer_ids:
        if not 0 <= a <= n_layers:
            raise ValueError(f"aux layer id {a} out of range for {n_layers} layers")
    order = sorted(todo, key=lambda i: -len(seqs[i]["tokens"]))
    i = 0
    while i < len(order) and (deadline is None or time.time() < deadline):
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
        out = inner(input_ids=ids.to(device), attention_mask=att.to(device),
                    output_hidden_states=bool(aux_layer_ids))
        final = out.last_hidden_state
        top1 = lm_head(final).argmax(-1)
        for r, j in enumerate(batch):
            n = len(seqs[j]["tokens"])
            aux = torch.cat([out.hidden_states[a][r, :n] for a in aux_layer_ids], -1) if aux_layer_ids else None
            yield j, final[r, :n], aux, top1[r, :n]


def _extract_into(target: str, seqs: list[dict], todo: list[int], aux_layer_ids: list[int], dtype: str,
                  store_dtype: torch.dtype, batch_tokens: int, finals: list, auxs: list, top1s: list,
                  model_cache: dict, bar) -> None:
    """Run the target (loaded into ``model_cache`` on first use, on ``model_cache.get("device", "cpu")``)
    over ``seqs[todo]`` and fill the lists with host tensors."""
    if "model" not in model_cache:
        model_cache["model"] = load_target_model(target, dtype, model_cache.get("device", "cpu"))
    for j, final, aux, top1 in _target_batches(model_cache["model"], seqs, todo, aux_layer_ids, batch_tokens):
        finals[j] = final.to("cpu", store_dtype).clone()
        top1s[j] = top1.to("cpu", torch.int32).clone()
        if aux is not None:
            auxs[j] = aux.to("cpu", store_dtype).clone()
        bar.update(len(seqs[j]["tokens"]))


class MemoryFeatureStore:
    """The features of ``seqs`` in the memory of one device (``FeatureStore``'s interface): one tensor per
    field over all sequences' rows; ``available`` lists, in ascending order, the sequences whose rows are
    filled (``extract_to_memory`` may stop at a deadline before all are)."""

    def __init__(self, seqs: list[dict], hidden_size: int, aux_width: int, dtype: torch.dtype,
                 device: str | torch.device):
        self.path = f"memory:{torch.device(device)}"
        self.offsets = [0]
        for s in seqs:
            self.offsets.append(self.offsets[-1] + len(s["tokens"]))
        n = self.offsets[-1]
        self.loss_start = [s["loss_start"] for s in seqs]
        self.tokens = torch.tensor([t for s in seqs for t in s["tokens"]], dtype=torch.int32, device=device)
        self.final = torch.empty(n, hidden_size, dtype=dtype, device=device)
        self.aux = torch.empty(n, aux_width, dtype=dtype, device=device) if aux_width else None
        self.top1 = torch.empty(n, dtype=torch.int32, device=device)
        self.has_aux = bool(aux_width)
        self.feature_dtype = dtype
        self._filled = [False] * len(seqs)

    def __len__(self) -> int:
        return len(self.loss_start)

    @property
    def available(self) -> list[int]:
        return [i for i, done in enumerate(self._filled) if done]

    @property
    def hidden_size(self) -> int:
        return int(self.final.shape[-1])

    def sequence_length(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def tokens_of(self, i: int) -> list[int]:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]].tolist()

    def put(self, i: int, final: torch.Tensor, aux: torch.Tensor | None, top1: torch.Tensor) -> None:
        a, b = self.offsets[i], self.offsets[i + 1]
        self.final[a:b] = final
        self.top1[a:b] = top1
        if self.aux is not None:
            self.aux[a:b] = aux
        self._filled[i] = True

    def get(self, i: int) -> dict:
        if not self._filled[i]:
            raise KeyError(f"sequence {i}'s features were not extracted (the extraction stopped at its deadline)")
        a, b = self.offsets[i], self.offsets[i + 1]
        out = {"tokens": self.tokens[a:b].long(), "final": self.final[a:b], "top1": self.top1[a:b].long(),
               "loss_start": self.loss_start[i]}
        if self.aux is not None:
            out["aux"] = self.aux[a:b]
        return out


@torch.no_grad()
def extract_to_memory(target: str, seqs: list[dict], aux_layer_ids: list[int], dtype: str = "bfloat16",
                      device: str | torch.device = "cpu", store_dtype: torch.dtype = torch.bfloat16,
                      batch_tokens: int = 4096, order: list[int] | None = None, deadline: float | None = None,
                      log=print) -> MemoryFeatureStore:
    """The features of ``seqs``, extracted with the target on ``device`` and kept there.

    Sequences are taken in ``order`` (default: as given), a window of about ``SHARD_TOKENS`` tokens at a
    time (longest first inside a window); once ``time.time()`` passes ``deadline`` no further batch starts,
    and the store's ``available`` says which sequences have features."""
    import time

    from tqdm.auto import tqdm

    cfg = target_config(target)
    hidden = int(cfg["hidden_size"])
    store = MemoryFeatureStore(seqs, hidden, hidden * len(aux_layer_ids), store_dtype, device)
    model = load_target_model(target, dtype, device)
    order = list(range(len(seqs))) if order is None else list(order)
    windows = shard_ranges([seqs[j] for j in order], SHARD_TOKENS)
    t0 = time.time()
    n_tok = 0
    bar = tqdm(total=store.offsets[-1], desc="features", unit="tok", mininterval=5, disable=None)
    for a, b in windows:
        for j, final, aux, top1 in _target_batches(model, seqs, order[a:b], aux_layer_ids, batch_tokens, deadline):
            store.put(j, final.to(store_dtype), None if aux is None else aux.to(store_dtype), top1.to(torch.int32))
            n_tok += len(seqs[j]["tokens"])
            bar.update(len(seqs[j]["tokens"]))
        if deadline is not None and time.time() >= deadline:
            log(f"[eagle] features: deadline reached after {len(store.available)} of {len(seqs)} sequences")
            break
    bar.close()
    del model
    seconds = time.time() - t0
    log(f"[eagle] features: {n_tok} tokens on {device} in {seconds:.1f} s ({n_tok / max(seconds, 1e-9):.0f} tok/s)")
    return store
