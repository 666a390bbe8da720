"""The README's quick start runs. Its commands are read out of README.md, so the README and these tests cannot
drift: the serving command, the `curl` call and the `LLM()` program of the "Quick start" section.

- In the default suite, with the tiny test models in place of the real ones (a tiny Qwen2 target, an EAGLE-3
  head in the reference layout for it) and float32 in place of bfloat16, each output must equal vanilla's.
- In the `slow` lane, as written: the real models, the README's dtype and memory settings, the committed head.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.serving import free_port, serving

ROOT = Path(__file__).resolve().parent.parent
QUICK_START_HEADING = "## Quick start"
TARGET_FETCH = "$(vllm-easyspec models fetch qwen2.5-coder-0.5b-instruct)"
TARGET_IN_PYTHON = 'str(fetch_model("qwen2.5-coder-0.5b-instruct"))'
HEAD = "heads/qwen2.5-coder-0.5b-instruct-eagle3"
SERVE = "vllm-easyspec serve"
DEFAULT_ADDRESS = "localhost:8000"
# Settings the test session gives every engine (conftest.py); a reader's shell has none of them.
SESSION_ENGINE_SETTINGS = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                           "VLLM_ENABLE_V1_MULTIPROCESSING")


def quick_start_blocks() -> dict[str, str]:
    """The Quick start section's code blocks by what they do: ``serve`` (bash), ``curl`` (bash), ``llm``
    (python). Each must be there exactly once."""
    text = (ROOT / "README.md").read_text()
    start = text.index(QUICK_START_HEADING)
    end = text.find("\n## ", start + len(QUICK_START_HEADING))
    section = text[start:end if end > 0 else None]
    blocks = re.findall(r"```(bash|python)\n(.*?)```", section, flags=re.DOTALL)
    found = {
        "serve": [code for language, code in blocks if language == "bash" and SERVE in code],
        "curl": [code for language, code in blocks if language == "bash" and code.lstrip().startswith("curl ")],
        "llm": [code for language, code in blocks if language == "python" and "LLM(" in code],
    }
    for kind, codes in found.items():
        assert len(codes) == 1, f"README.md's Quick start should have one {kind} block, found {len(codes)}"
    return {kind: codes[0] for kind, codes in found.items()}


def substituted(code: str, replacements: dict[str, str]) -> str:
    """``code`` with each key replaced; a key the README no longer has fails here, naming it."""
    for old, new in replacements.items():
        assert old in code, f"the README's quick start no longer contains {old!r}; update tests/test_readme.py"
        code = code.replace(old, new)
    return code


def completion_request(curl_block: str) -> dict:
    """The JSON body the README's `curl` call sends."""
    body = re.search(r"-d '(\{.*\})'", curl_block, flags=re.DOTALL)
    assert body, "the README's curl call sends no -d '{...}' body"
    return json.loads(body.group(1))


def reader_environment() -> dict[str, str]:
    """This process's environment as a reader's shell would have it: the venv's commands on PATH, none of the
    engine settings the test session adds."""
    environment = {key: value for key, value in os.environ.items() if key not in SESSION_ENGINE_SETTINGS}
    environment["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), environment.get("PATH", "")])
    return environment


def serve_and_ask(serve_block: str, curl_block: str, log_path: Path, environment: dict[str, str]) -> tuple[dict, str]:
    """Start the README's server (on a free port), send the README's request; the response's JSON and the
    server's metrics after it."""
    port = free_port()
    # `exec` so that stopping the shell stops the server; --port appended to the README's command.
    script = substituted(serve_block, {SERVE: f"exec {SERVE}"}).rstrip() + f" --port {port}\n"
    request = substituted(curl_block, {DEFAULT_ADDRESS: f"localhost:{port}"})
    with serving(["bash", "-ec", script], port, log_path, env=environment):
        answer = subprocess.run(["bash", "-ec", request], capture_output=True, text=True, env=environment,
                                timeout=300, check=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
            metrics = response.read().decode()
    return json.loads(answer.stdout), metrics


def drafts_verified(metrics: str) -> float:
    """vLLM's count of speculative drafts (a tree step is one) in a Prometheus text page."""
    counts = re.findall(r"^vllm:spec_decode_num_drafts_total(?:\{[^}]*\})? ([0-9.e+]+)$", metrics, flags=re.MULTILINE)
    return sum(float(count) for count in counts)


def run_program(llm_block: str, path: Path, environment: dict[str, str]) -> str:
    """Run the README's `LLM()` program from the repository root; its standard output."""
    path.write_text(llm_block)
    finished = subprocess.run([sys.executable, str(path)], cwd=ROOT, capture_output=True, text=True,
                              env=environment, timeout=900)
    assert finished.returncode == 0, f"the README's LLM() program failed:\n{finished.stderr[-3000:]}"
    return finished.stdout


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory, tiny_qwen2_dir) -> Path:
    """An EAGLE-3 head for the tiny Qwen2 target, in the reference layout the committed head has."""
    from tests.eagle.reference_checkpoint import build_reference_checkpoint

    return build_reference_checkpoint(tiny_qwen2_dir, tmp_path_factory.mktemp("readme") / "head", "eagle3",
                                      draft_vocab_size=48, aux_layer_ids=[1, 2, 5])


def vanilla_text(llm_pool, target: Path, prompt: str, max_tokens: int) -> str:
    from vllm import SamplingParams

    llm = llm_pool.get(target)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def tiny_replacements(target: Path, head: Path) -> dict[str, str]:
    """The real models' names and bfloat16 in the README, and what the tiny tests run instead."""
    return {TARGET_FETCH: str(target), TARGET_IN_PYTHON: repr(str(target)), HEAD: str(head), "bfloat16": "float32"}


@pytest.mark.engine
def test_the_quick_start_serves_what_vanilla_answers_with_tiny_models(tmp_path, llm_pool, tiny_qwen2_dir, tiny_head):
    blocks = quick_start_blocks()
    replacements = tiny_replacements(tiny_qwen2_dir, tiny_head)
    serve_block = substituted(blocks["serve"], {k: v for k, v in replacements.items() if k != TARGET_IN_PYTHON})
    request = completion_request(blocks["curl"])
    expected = vanilla_text(llm_pool, tiny_qwen2_dir, request["prompt"], request["max_tokens"])
    environment = reader_environment() | {"VLLM_CPU_KVCACHE_SPACE": "1"}  # the tiny model needs no more
    answer, metrics = serve_and_ask(serve_block, blocks["curl"], tmp_path / "serve.log", environment)
    assert expected.strip(), "vanilla produced no text to compare"
    assert answer["choices"][0]["text"] == expected
    assert drafts_verified(metrics) > 0, "the server answered without speculating"


@pytest.mark.engine
def test_the_quick_start_llm_program_prints_what_vanilla_answers_with_tiny_models(
    tmp_path, llm_pool, tiny_qwen2_dir, tiny_head
):
    blocks = quick_start_blocks()
    replacements = tiny_replacements(tiny_qwen2_dir, tiny_head)
    program = substituted(blocks["llm"], {k: v for k, v in replacements.items() if k != TARGET_FETCH})
    prompt = re.search(r'llm\.generate\(\["([^"]+)"\]', program).group(1)
    max_tokens = int(re.search(r"max_tokens=(\d+)", program).group(1))
    expected = vanilla_text(llm_pool, tiny_qwen2_dir, prompt, max_tokens)
    assert expected.strip(), "vanilla produced no text to compare"
    # The engine in the program's own process: 1-5 s to start where LLM()'s own processes take 25-40 s.
    environment = reader_environment() | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert expected in run_program(program, tmp_path / "quick_start.py", environment)


def program_output(stdout: str) -> str:
    """What the program printed, without vLLM's log lines."""
    return "\n".join(line for line in stdout.splitlines() if not re.match(r"\s*(\(\w+ pid=\d+\) )?(INFO|WARNING|DEBUG)", line))


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(1800)
def test_the_quick_start_runs_as_written(tmp_path):
    """The real models, the README's settings; on this 2-core machine beside other processes, which is the
    case `--kv-cache-memory-bytes` is there for."""
    blocks = quick_start_blocks()
    environment = reader_environment()
    answer, metrics = serve_and_ask(blocks["serve"], blocks["curl"], tmp_path / "serve.log", environment)
    assert drafts_verified(metrics) > 0, "the server answered without speculating"
    request = completion_request(blocks["curl"])
    assert answer["usage"]["completion_tokens"] == request["max_tokens"] and answer["choices"][0]["text"].strip()
    printed = program_output(run_program(blocks["llm"], tmp_path / "quick_start.py", environment))
    assert "def " in printed, f"the README's LLM() program printed no Python function:\n{printed[-2000:]}"
