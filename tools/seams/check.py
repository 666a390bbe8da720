"""The seam inventory and its check: the plugin's seams (:mod:`tools.seams.plugin_seams`) fingerprinted in the vLLM
they were written against (``inventory.json``), compared with any vLLM tree.

Invariants: the inventory holds exactly the seams derived from the plugin's code in its own vLLM release, so a check
of that release finds nothing unless the code gained or lost a seam (then the inventory is out of date). Against
another release, every difference is a finding: a name gone, a signature, a definition's place or a body changed,
a seam that release adds (a name of the plugin's own that vLLM now defines too); a finding listed in
``reviewed.toml`` with the same new fingerprint is reported as reviewed, with its reason, and does not fail.
"""

from __future__ import annotations

import ast
import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tools.seams.plugin_seams import Derivation, derive
from tools.seams.vllm_source import VllmTree, body_fingerprint, signature

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PACKAGE = ROOT / "vllm_easyspec"
COMPAT = PACKAGE / "integration" / "compat.py"
INVENTORY = HERE / "inventory.json"
ATTRIBUTES = HERE / "attributes.toml"
REVIEWED = HERE / "reviewed.toml"
INFORMATIONAL_KINDS = {"class", "module", "attribute"}  # a body change of these is informational (see Finding)
REGENERATE = "python -m tools.seams inventory"


def listed_attributes(path: Path = ATTRIBUTES) -> dict[str, dict[str, list[str]]]:
    """The hand-kept names by use (``attribute``, ``mirror``), then by owner (``attributes.toml``)."""
    tables = tomllib.loads(path.read_text())
    return {"attribute": tables.get("attributes", {}), "mirror": tables.get("mirrors", {})}


def compat_releases(path: Path = COMPAT) -> dict[str, list[str]]:
    """The vLLM names (``module:name`` strings) of each row of ``compat.RELEASES``, read from its source (none
    for a package without one)."""
    if not path.is_file():
        return {}
    for node in ast.parse(path.read_text()).body:
        names = [getattr(target, "id", None) for target in getattr(node, "targets", [])]
        if "RELEASES" in names:
            return {release(key.value): [item.value for item in ast.walk(value) if isinstance(item, ast.Constant)
                                and isinstance(item.value, str) and item.value.startswith("vllm.") and ":" in item.value]
                    for key, value in zip(node.value.keys, node.value.values, strict=True)}
        if "SUPPORTED_VLLM_VERSION" in names:  # the one-release gate before RELEASES
            return {node.value.value: []}
    return {}


def derive_in(tree: VllmTree, package: Path = PACKAGE) -> Derivation:
    """The plugin's seams resolved in ``tree``, with the compat table's names for the tree's release."""
    return derive(package, tree, listed_attributes(), compat_releases(package / "integration" / "compat.py").get(
        release(tree.version), []))


def fingerprint(tree: VllmTree, target: str) -> dict[str, str] | None:
    """What the check compares of one seam in ``tree`` (None where the tree lacks it)."""
    definition = tree.find(target)
    if definition is None:
        return None
    return {"kind": definition.kind, "where": definition.where, "signature": signature(definition),
            "body": body_fingerprint(definition)}


def build_inventory(tree: VllmTree, package: Path = PACKAGE) -> dict:
    """The inventory of the plugin's seams in ``tree`` (compat seams left out: each release's row is checked in
    its own tree). Refuses while the code has marker problems or a seam the tree lacks."""
    derivation = derive_in(tree, package)
    missing = [target for target in derivation.seams if tree.find(target) is None]
    if derivation.problems or missing:
        raise ValueError("cannot write the inventory:\n  " + "\n  ".join(
            [*derivation.problems, *(f"vLLM {tree.version} has no {target}" for target in missing)]))
    seams = {target: {"uses": sorted(seam.uses - {"compat"}), **fingerprint(tree, target)}
             for target, seam in sorted(derivation.seams.items()) if seam.uses - {"compat"}}
    return {"vllm": tree.version, "seams": seams}


@dataclass
class Finding:
    """One difference between the inventory and a vLLM tree. ``change``: missing, kind, moved, signature, body,
    new (a seam the inventory lacks), gone (an inventory seam the code no longer has), uses (a seam used
    otherwise), unsupported (a release ``compat.RELEASES`` lacks), value-body (a class, module or attribute default changed: informational, as what the plugin uses of a class is a seam of its own)."""

    target: str
    change: str
    was: str = ""
    now: str = ""
    uses: list[str] = field(default_factory=list)
    by: list[str] = field(default_factory=list)
    reason: str | None = None  # set when reviewed.toml covers it

    @property
    def acts(self) -> bool:
        """Whether a person must act on it: not informational, not reviewed."""
        return self.change != "value-body" and self.reason is None


def compare(inventory: dict, tree: VllmTree, derivation: Derivation, reviewed: Path = REVIEWED,
            supported: set[str] | None = None) -> list[Finding]:
    """Every finding of ``tree`` against ``inventory`` (module docstring), reviewed ones marked; ``supported``:
    the releases the version gate accepts (default: ``compat.RELEASES``')."""
    findings: list[Finding] = []
    seams = inventory["seams"]
    for target, entry in seams.items():
        seam = derivation.seams.get(target)
        by = sorted(seam.by) if seam is not None else []
        now = fingerprint(tree, target)
        if now is None:
            findings.append(Finding(target, "missing", entry["where"], "", entry["uses"], by))
            continue
        changes = ("kind", "where", "signature", "body")
        if now["where"] != target and now["where"] in seams:  # a re-export: its definition is compared as a seam
            changes = ("kind", "where")
        for change in changes:
            if now[change] != entry[change]:
                name = {"where": "moved", "body": "value-body" if now["kind"] in INFORMATIONAL_KINDS else "body"}.get(change,
                                                                                                           change)
                findings.append(Finding(target, name, entry[change], now[change], entry["uses"], by))
        if seam is None:
            findings.append(Finding(target, "gone", ",".join(entry["uses"]), "", entry["uses"], []))
    for target, seam in derivation.seams.items():
        uses = sorted(seam.uses - {"compat"})
        now = fingerprint(tree, target)
        if seam.uses == {"compat"} and now is None:
            findings.append(Finding(target, "missing", "", "", ["compat"], sorted(seam.by)))
        elif uses and target not in seams:
            findings.append(Finding(target, "new", "", ",".join(uses) if now is None else now["where"], uses,
                                    sorted(seam.by)))
        elif uses and target in seams and uses != seams[target]["uses"]:
            findings.append(Finding(target, "uses", ",".join(seams[target]["uses"]), ",".join(uses), uses,
                                    sorted(seam.by)))
    if release(tree.version) not in (compat_releases() if supported is None else supported):
        findings.append(Finding("vllm_easyspec.integration.compat:RELEASES", "unsupported", "", tree.version))
    return _reviewed(findings, tree.version, reviewed)


def release(version: str) -> str:
    """A version without its local tag (``0.32.0+cpu`` -> ``0.32.0``)."""
    return version.split("+")[0]


def review_key(finding: Finding) -> str:
    """What ``reviewed.toml``'s ``now`` holds for a finding: its new value, or a hash of a long one (a class's
    signature); a review covers that value only, so a later change is a finding again."""
    if len(finding.now) <= 64:
        return finding.now
    return hashlib.sha256(finding.now.encode()).hexdigest()[:16]


def _reviewed(findings: list[Finding], version: str, path: Path = REVIEWED) -> list[Finding]:
    reviews = tomllib.loads(path.read_text()).get("change", []) if path.is_file() else []
    for finding in findings:
        for review in reviews:
            if (review["target"], review["change"], review.get("now", "")) == (finding.target, finding.change,
                                                                               review_key(finding)):
                finding.reason = f"{review['reason']} (reviewed for vLLM {review.get('vllm', version)})"
    return findings
