"""``vllm-easyspec train-eagle``: runs the trainer with the ``[train]`` extra installed, and without its
modules prints one line saying how to install it."""

from __future__ import annotations

import json
import sys

import pytest

from tests.eagle.eagle_helpers import train_args
from vllm_easyspec import cli


def _forget_trainer(monkeypatch) -> None:
    """Make the next ``import vllm_easyspec_train.trainer`` run it and the checkpoint module again."""
    import vllm_easyspec_train

    for name in ("trainer", "checkpoint"):
        monkeypatch.delitem(sys.modules, f"vllm_easyspec_train.{name}", raising=False)
        monkeypatch.delattr(vllm_easyspec_train, name, raising=False)


@pytest.mark.parametrize("missing", ["tqdm", "safetensors"])
def test_train_eagle_without_the_extra_says_how_to_install_it(monkeypatch, capsys, missing):
    _forget_trainer(monkeypatch)
    monkeypatch.setitem(sys.modules, missing, None)  # import of it raises ModuleNotFoundError
    for sub in [k for k in sys.modules if k.startswith(missing + ".")]:
        monkeypatch.setitem(sys.modules, sub, None)
    assert cli.main(["train-eagle", "--target", "t", "--out", "o"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install "vllm-easyspec[train]"' in err[0] and missing in err[0]


def test_an_unrelated_import_error_in_the_trainer_is_not_reported_as_a_missing_extra(monkeypatch):
    _forget_trainer(monkeypatch)
    monkeypatch.setitem(sys.modules, "torch.nn.functional", None)
    with pytest.raises(ModuleNotFoundError, match="torch.nn.functional"):
        cli.build_parser()


def test_train_eagle_runs_the_trainer(tmp_path, tiny_llama_dir, tiny_text_dir, capsys):
    argv = train_args(tiny_llama_dir, tmp_path / "h", tmp_path / "w", tiny_text_dir)._argv
    assert cli.main(["train-eagle", *argv]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["out"] == str(tmp_path / "h") and (tmp_path / "h" / "model.safetensors").exists()
    assert json.loads((tmp_path / "h" / "eagle_manifest.json").read_text())["training"]["steps"] == 6
