"""``python -m tools.seams``: the seam inventory's commands (tools/seams/README.md).

  check [PATH] [--diff]     check the installed vLLM, or the vLLM tree at PATH, against the inventory
  check --wheel VERSION     the same for vLLM's GPU wheel VERSION, fetched once into the cache
  inventory                 rewrite inventory.json from the code and the installed vLLM
  fetch VERSION             fetch and unpack vLLM's GPU wheel VERSION; print its tree's path

Exit status of check: 0 when nothing is left to act on, 1 otherwise.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

from tools.seams.check import (
    INVENTORY,
    PACKAGE,
    REGENERATE,
    REVIEWED,
    Finding,
    build_inventory,
    compare,
    compat_releases,
    derive_in,
    release,
    review_key,
)
from tools.seams.vllm_source import VllmTree, installed_root, source_text
from tools.seams.wheel import unpacked_wheel

SECTIONS = {  # change -> (title, what to do)
    "unsupported": ("UNSUPPORTED RELEASE", "add a row to compat.RELEASES once every finding below is handled"),
    "missing": ("MISSING", "the plugin uses a name this vLLM does not have: use where it went (through "
                "compat.RELEASES if the releases differ)"),
    "kind": ("KIND CHANGED", "a function became a property, a class a function, ...: adapt the plugin"),
    "signature": ("SIGNATURE CHANGED", "parameters (names, kinds, defaults), a class's bases, fields or __init__ "
                  "changed: adapt every call, override and wrapper"),
    "moved": ("MOVED", "defined in another class or module now (an override may now shadow a new vLLM one)"),
    "body": ("BODY CHANGED", "code the plugin overrides, wraps, replaces or calls changed: read it (--diff), adapt the "
             "plugin or review it in tools/seams/reviewed.toml"),
    "new": ("NEW SEAMS", "the code (or this vLLM) has a seam the inventory lacks: a name of the plugin's own that "
            f"vLLM now defines too, or a seam added on purpose ({REGENERATE})"),
    "gone": ("GONE", f"the inventory has a seam the code no longer has ({REGENERATE})"),
    "uses": ("USED OTHERWISE", f"a seam the code uses in another way than the inventory says ({REGENERATE})"),
}


def tree_at(path: str | None) -> VllmTree:
    """The tree at ``path`` (a folder holding ``vllm/``, or the ``vllm`` package folder), else the installed one."""
    root = installed_root() if path is None else Path(path).expanduser()
    if root.name == "vllm" and (root / "__init__.py").is_file():
        root = root.parent
    return VllmTree(root)


def print_report(findings: list[Finding], tree: VllmTree, inventory: dict, diff_from: VllmTree | None) -> int:
    """The findings a person acts on, by kind, then the reviewed and informational ones; returns the exit status."""
    print(f"vLLM {tree.version} at {tree.root}\nagainst the seam inventory (vLLM {inventory['vllm']}, "
          f"{len(inventory['seams'])} seams)")
    for change, (title, advice) in SECTIONS.items():
        group = [finding for finding in findings if finding.change == change and finding.acts]
        if group:
            print(f"\n{title} ({len(group)}): {advice}")
            for finding in group:
                _print_finding(finding, tree, diff_from)
    reviewed = [finding for finding in findings if finding.reason is not None]
    if reviewed:
        print(f"\nREVIEWED ({len(reviewed)}): read and adapted or harmless (tools/seams/reviewed.toml)")
        for finding in reviewed:
            print(f"  {finding.target}  [{finding.change}]\n      {finding.reason}")
    informational = [finding.target for finding in findings if finding.change == "value-body"]
    if informational:
        print(f"\nclasses, modules and attribute defaults that changed ({len(informational)}; informational: what the plugin "
              "uses of them is checked above):\n  " + "\n  ".join(informational))
    acting = [finding for finding in findings if finding.acts]
    counts = ", ".join(f"{change} {sum(f.change == change for f in acting)}" for change in SECTIONS
                       if any(f.change == change for f in acting))
    same = release(tree.version) == release(inventory["vllm"])
    if acting and same and all(finding.change in ("new", "gone", "uses") for finding in acting):
        print(f"\nthe inventory is out of date for its own vLLM release: {REGENERATE}")
    print(f"\nresult: {len(acting)} to act on{f' ({counts})' if counts else ''}; {len(reviewed)} reviewed; "
          f"{len(informational)} informational")
    return 1 if acting else 0


def _print_finding(finding: Finding, tree: VllmTree, diff_from: VllmTree | None) -> None:
    """One finding: what changed, who uses it, the review line, and with ``diff_from`` the definition's diff."""
    print(f"  {finding.target}  [{', '.join(finding.uses)}]")
    if finding.change == "signature" and finding.was.startswith("class(") and finding.now.startswith("class("):
        print(f"      {_class_change(finding.was, finding.now)}")
    elif finding.was or finding.now:
        print(f"      was: {finding.was or '-'}\n      now: {finding.now or '-'}")
    if finding.by:
        shown = finding.by[:4] + ([f"... {len(finding.by) - 4} more"] if len(finding.by) > 4 else [])
        print(f"      used by: {', '.join(shown)}")
    if finding.change not in ("new", "gone", "uses", "unsupported"):
        print(f'      to review it: target = "{finding.target}", change = "{finding.change}", '
              f'now = "{review_key(finding)}"')
    if diff_from is not None and finding.change in ("body", "signature", "moved") and not finding.was.startswith(
            "class("):  # a class's diff is its whole body: the line above says what changed
        before, after = diff_from.find(finding.target), tree.find(finding.target)
        lines = difflib.unified_diff(
            source_text(diff_from, before).splitlines(keepends=True) if before else [],
            source_text(tree, after).splitlines(keepends=True) if after else [],
            f"vllm {diff_from.version}", f"vllm {tree.version}", n=2)
        print("".join("      " + line for line in lines).rstrip())


def _class_change(was: str, now: str) -> str:
    """What changed between two class signatures (``class(bases) fields(...) __init__(...)``), part by part."""
    def parts(text: str) -> dict[str, list[str]]:
        found = re.findall(r"(class|fields|__init__)\((.*?)\)(?= fields\(| __init__\(|$)", text)
        return {name: [item.strip() for item in items.split(",") if item.strip()] for name, items in found}

    before, after = parts(was), parts(now)
    out = []
    for name in ("class", "fields", "__init__"):
        old, new = before.get(name, []), after.get(name, [])
        added, removed = [item for item in new if item not in old], [item for item in old if item not in new]
        label = {"class": "bases", "fields": "fields", "__init__": "__init__ parameters"}[name]
        if added or removed:
            out.append(f"{label}: " + " ".join([*(f"+{item}" for item in added), *(f"-{item}" for item in removed)]))
        elif old != new:
            out.append(f"{label}: reordered")
    return "; ".join(out) or f"was: {was}; now: {now}"


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tools.seams", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="check a vLLM tree against the inventory")
    check.add_argument("path", nargs="?", help="a folder holding vllm/ (default: the installed vLLM)")
    check.add_argument("--wheel", metavar="VERSION", help="vLLM's GPU wheel VERSION, fetched once into the cache")
    check.add_argument("--diff", action="store_true", help="print each changed definition's diff against the "
                       "inventory's release (--reference, or the installed vLLM when it is that release)")
    check.add_argument("--reference", metavar="PATH", help="the inventory's vLLM tree, for --diff")
    check.add_argument("--package", metavar="DIR", default=str(PACKAGE),
                       help="the plugin's package to derive from (default: this checkout's vllm_easyspec/)")
    check.add_argument("--inventory", metavar="FILE", default=str(INVENTORY), help="(default: %(default)s)")
    check.add_argument("--reviewed", metavar="FILE", default=str(REVIEWED), help="(default: %(default)s)")
    inventory = commands.add_parser("inventory", help=f"rewrite {INVENTORY.name} from the code and the installed vLLM")
    inventory.add_argument("--package", metavar="DIR", default=str(PACKAGE),
                           help="the plugin's package to derive from (default: this checkout's vllm_easyspec/)")
    inventory.add_argument("--inventory", metavar="FILE", default=str(INVENTORY), help="(default: %(default)s)")
    fetch = commands.add_parser("fetch", help="fetch and unpack vLLM's GPU wheel; print its tree's path")
    fetch.add_argument("version")
    arguments = parser.parse_args(argv)
    if arguments.command == "fetch":
        print(unpacked_wheel(arguments.version))
        return 0
    if arguments.command == "inventory":
        inventory = build_inventory(tree_at(None), Path(arguments.package))
        lines = [f" {json.dumps(target)}: {json.dumps(entry, sort_keys=True)}" for target, entry in
                 sorted(inventory["seams"].items())]
        path = Path(arguments.inventory)
        path.write_text(f'{{"vllm": {json.dumps(inventory["vllm"])}, "seams": {{\n' + ",\n".join(lines) + "\n}}\n")
        print(f"wrote {path} ({len(inventory['seams'])} seams, vLLM {inventory['vllm']})")
        return 0
    tree = VllmTree(unpacked_wheel(arguments.wheel)) if arguments.wheel else tree_at(arguments.path)
    inventory = json.loads(Path(arguments.inventory).read_text())
    derivation = derive_in(tree, Path(arguments.package))
    for problem in derivation.problems:
        print(f"marker: {problem}", file=sys.stderr)
    diff_from = None
    if arguments.diff:
        diff_from = tree_at(arguments.reference)
        if release(diff_from.version) != release(inventory["vllm"]):
            raise SystemExit(f"--diff needs vLLM {inventory['vllm']}'s tree (--reference PATH); "
                             f"{diff_from.root} is {diff_from.version}")
    supported = set(compat_releases(Path(arguments.package) / "integration" / "compat.py"))
    findings = compare(inventory, tree, derivation, Path(arguments.reviewed), supported)
    status = print_report(findings, tree, inventory, diff_from)
    return 1 if derivation.problems else status


if __name__ == "__main__":
    sys.exit(main())
