"""vLLM's GPU wheel from the package registry, as a source tree the seam check reads: downloaded once with
``pip download vllm==VERSION --no-deps`` (about 336 MB for 0.33.0) and unpacked, Python files and the wheel's
metadata only (about 60 MB), under ``$VLLM_EASYSPEC_CACHE`` (default ``~/.cache/vllm-easyspec``), never in the
repository. Invariant: a tree in the cache is complete (it is unpacked beside it and renamed into place)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("VLLM_EASYSPEC_CACHE", Path.home() / ".cache" / "vllm-easyspec"))


def unpacked_wheel(version: str) -> Path:
    """The folder holding ``vllm/`` of vLLM's GPU wheel ``version``, fetched and unpacked on first use."""
    tree = cache_root() / "vllm-src" / f"vllm-{version}"
    if (tree / "vllm" / "__init__.py").is_file():
        return tree
    wheels = cache_root() / "vllm-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    if not found:
        print(f"downloading vllm=={version} (the GPU wheel, no dependencies) into {wheels} ...", file=sys.stderr)
        done = subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps",
                               "--only-binary=:all:", "--disable-pip-version-check", "-q", "-d", str(wheels)])
        found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
        if done.returncode != 0 or not found:
            raise SystemExit(f"could not download vllm=={version} from the package registry (pip exit status "
                             f"{done.returncode}); is that release published?")
    partial = tree.with_name(tree.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(found[-1]) as wheel:
        members = [name for name in wheel.namelist()
                   if (name.startswith("vllm/") and name.endswith(".py")) or name.endswith(".dist-info/METADATA")]
        wheel.extractall(partial, members)
    partial.rename(tree)
    return tree
