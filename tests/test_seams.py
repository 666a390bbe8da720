"""The seam inventory (tools/seams, issue 69): the installed vLLM still has every vLLM name the plugin relies on
beyond the public API, unchanged (signatures, the bodies it overrides, wraps, replaces, calls or mirrors), and the
inventory lists exactly the seams of the plugin's code. Engine-free: sources are read, vLLM is not imported.

When a seam is added or dropped on purpose: ``python -m tools.seams inventory``, and commit tools/seams/inventory.json.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tools.seams.check import INVENTORY, build_inventory, compare, derive_in, review_key
from tools.seams.plugin_seams import derive
from tools.seams.vllm_source import VllmTree, installed_root


def test_the_installed_vllm_has_every_seam_of_the_inventory_and_the_inventory_every_seam_of_the_code():
    tree = VllmTree(installed_root())
    derivation = derive_in(tree)
    assert not derivation.problems, "mark each patch of vLLM with a \"Replaces vllm.x.y\" comment:\n" + "\n".join(
        derivation.problems)
    findings = [finding for finding in compare(json.loads(INVENTORY.read_text()), tree, derivation) if finding.acts]
    assert not findings, (
        f"{len(findings)} seam finding(s) against the installed vLLM {tree.version}; `python -m tools.seams check` "
        "says what each is and what to do (a seam added or dropped on purpose: `python -m tools.seams inventory`):\n"
        + "\n".join(f"  {finding.change}: {finding.target} [{', '.join(finding.uses)}] {finding.was or '-'} -> "
                    f"{finding.now or '-'} (used by {', '.join(finding.by[:3]) or '-'})" for finding in findings))


# ------------------------------------------------------------------------------ the checks see what they look for
VLLM_BEFORE = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '9.0.0'\n",
    "vllm/runner.py": '''
        from vllm.util import helper

        class Base:
            def step(self, x):
                return x

        class Runner(Base):
            def __init__(self, config):
                self.batch = config.batch

            def sample(self, logits, metadata):
                """Docstrings do not count."""
                return helper(logits)
        ''',
    "vllm/util.py": '''
        def helper(logits):
            return logits
        ''',
}
PLUGIN = {
    "__init__.py": "",
    "runner.py": '''
        import vllm.runner as runner_module
        from vllm.runner import Runner


        class Mixin:
            def sample(self, logits, metadata):
                return super().sample(logits, metadata) + len(self.batch)

            def own_helper(self):
                return None


        class PluginRunner(Mixin, Runner):
            pass


        def install():
            # Replaces vllm.runner.Runner (the module global) with the plugin's subclass.
            runner_module.Runner = PluginRunner
            runner_module.helper = len
        ''',
}


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def _checked(tmp_path: Path, vllm_after: dict[str, str], reviewed: str = ""):
    before = VllmTree(_write(tmp_path / "before", VLLM_BEFORE))
    after = VllmTree(_write(tmp_path / "after", {**VLLM_BEFORE, **vllm_after}))
    package = _write(tmp_path / "plugin" / "fake_plugin", PLUGIN)
    derivation = derive(package, before, {"attribute": {}, "mirror": {}}, [])
    seams = {target: {"uses": sorted(seam.uses), **fingerprint} for target, seam in derivation.seams.items()
             if (fingerprint := _fingerprint(before, target)) is not None}
    (tmp_path / "reviewed.toml").write_text(reviewed)
    return derivation, compare({"vllm": before.version, "seams": seams}, after,
                               derive(package, after, {"attribute": {}, "mirror": {}}, []), tmp_path / "reviewed.toml",
                               supported={"9.0.0"})


def _fingerprint(tree: VllmTree, target: str):
    from tools.seams.check import fingerprint

    return fingerprint(tree, target)


def test_the_derivation_finds_imports_subclasses_overrides_attributes_and_patches(tmp_path):
    derivation, findings = _checked(tmp_path, {})
    uses = {target: sorted(seam.uses) for target, seam in derivation.seams.items()}
    assert uses["vllm.runner:Runner"] == ["import", "replace", "subclass"]
    assert uses["vllm.runner:Runner.sample"] == ["override"]  # through the plugin's mixin
    assert uses["vllm.runner:Runner.batch"] == ["attribute"]  # assigned to self in vLLM's __init__, read by the mixin
    assert uses["vllm.runner:helper"] == ["replace"]  # a module global bound by an import, as written
    assert "vllm.runner:Runner.own_helper" not in uses  # the plugin's own name: no seam
    assert not derivation.problems  # both patches sit under the "Replaces" comment
    assert not [finding for finding in findings if finding.acts]  # the same tree: nothing to act on


def test_a_formatting_change_is_no_finding_and_a_body_signature_or_name_change_is(tmp_path):
    reformatted = {"vllm/runner.py": VLLM_BEFORE["vllm/runner.py"].replace("return helper(logits)",
                                                                           "return helper(\n            logits)")}
    _, findings = _checked(tmp_path, reformatted)
    assert not [finding for finding in findings if finding.acts]
    changed = {"vllm/runner.py": VLLM_BEFORE["vllm/runner.py"].replace("return helper(logits)", "return logits")
               .replace("def sample(self, logits, metadata)", "def sample(self, logits, metadata, extra=None)")}
    changed["vllm/util.py"] = "def helper2(logits):\n    return logits\n"
    _, findings = _checked(tmp_path, changed)
    found = {(finding.target, finding.change): finding for finding in findings if finding.acts}
    assert ("vllm.runner:Runner.sample", "body") in found
    assert found[("vllm.runner:Runner.sample", "signature")].now == "(self, logits, metadata, extra=None)"
    assert ("vllm.runner:helper", "missing") in found  # vllm.util renamed it: vllm.runner's import fails


def test_a_name_the_plugin_adds_that_vllm_now_defines_is_a_new_seam_and_a_review_covers_one_new_value(tmp_path):
    collision = {"vllm/runner.py": VLLM_BEFORE["vllm/runner.py"] + "\n            def own_helper(self):\n"
                 "                return 1\n"}  # a method of vLLM's Runner now
    _, findings = _checked(tmp_path, collision)
    assert ("vllm.runner:Runner.own_helper", "new") in {(finding.target, finding.change) for finding in findings}
    changed = {"vllm/runner.py": VLLM_BEFORE["vllm/runner.py"].replace("return helper(logits)", "return logits")}
    _, findings = _checked(tmp_path, changed)
    (body,) = [finding for finding in findings if finding.change == "body"]
    review = f'[[change]]\ntarget = "{body.target}"\nchange = "body"\nnow = "{review_key(body)}"\nreason = "read"\n'
    _, findings = _checked(tmp_path, changed, review)
    assert not [finding for finding in findings if finding.acts]
    assert [finding.reason for finding in findings if finding.reason] == ["read (reviewed for vLLM 9.0.0)"]


def test_an_unmarked_patch_of_vllm_is_a_problem(tmp_path):
    plugin = dict(PLUGIN, **{"runner.py": PLUGIN["runner.py"].replace(
        "            # Replaces vllm.runner.Runner (the module global) with the plugin's subclass.\n", "")})
    tree = VllmTree(_write(tmp_path / "vllm", VLLM_BEFORE))
    derivation = derive(_write(tmp_path / "p" / "fake_plugin", plugin), tree, {"attribute": {}, "mirror": {}}, [])
    assert any("replaces vllm.runner.Runner without a \"Replaces" in problem for problem in derivation.problems)


def test_the_inventory_cannot_be_written_while_the_code_has_a_seam_vllm_lacks(tmp_path, monkeypatch):
    from tools.seams import check

    tree = VllmTree(_write(tmp_path / "vllm", VLLM_BEFORE))
    package = _write(tmp_path / "p" / "fake_plugin", {**PLUGIN, "extra.py": "from vllm.util import missing\n"})
    monkeypatch.setattr(check, "listed_attributes", lambda: {"attribute": {}, "mirror": {}})
    with pytest.raises(ValueError, match="vLLM 9.0.0 has no vllm.util:missing"):
        build_inventory(tree, package)
