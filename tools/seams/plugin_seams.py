"""The seams the plugin's code has, derived from its source (``vllm_easyspec/**``) and resolved in a vLLM tree.

A seam is a vLLM name outside the public API that the plugin depends on, written ``module:qualname`` (a bare
module for a module). What makes one, each recorded with the plugin code that uses it (``by``):

- ``import``: every ``import vllm...`` / ``from vllm... import name``, at any depth (as written: the module the
  plugin imports from must keep the name);
- ``subclass``: every vLLM class a plugin class derives from (directly, or through a plugin mixin);
- ``override``: every method of such a class (or of its plugin mixins) whose name the vLLM class has, looked up
  through the vLLM class's bases (so ``CPUModelRunner._sample`` is the seam even where ``GPUModelRunner`` defines it);
- ``attribute``: every ``self.name`` / ``super().name`` such a class reads or writes that vLLM's class has and the
  plugin does not define, and every name on the hand-kept list (``attributes.toml``: fields of vLLM objects the
  plugin reaches through parameters: input batch, scheduler output, metadata, proposers, configs);
- ``mirror``: every name on the hand-kept list of vLLM code the plugin reimplements or relies on without calling it
  (``attributes.toml``, ``[mirrors]``: the sampler's order of operations, the worker's reading of grammar rows);
- ``replace``: every assignment or ``setattr`` on a vLLM module or class, and every vLLM name in a comment or
  docstring sentence that starts with "Replaces" (the marker the plugin writes at each patch; the names there are
  what is replaced and what it was);
- ``compat``: every vLLM name in ``integration/compat.py``'s ``RELEASES`` row of the tree's release.

Invariant: derivation reads code only; it never imports vLLM (the compat table is read from its source too).
"""

from __future__ import annotations

import ast
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tools.seams.vllm_source import Definition, VllmTree

DOTTED = re.compile(r"\bvllm(?:\.\w+)+")
MARKER = re.compile(r"\breplaces\b", re.IGNORECASE)
MARKER_REACH = 8  # a patch is marked when a "Replaces" comment ends at most this many lines above it


@dataclass
class Seam:
    """One vLLM name the plugin depends on: how (``uses``), and from where in the plugin (``by``)."""

    target: str
    uses: set[str] = field(default_factory=set)
    by: set[str] = field(default_factory=set)


@dataclass
class Derivation:
    """The seams of the plugin's code, and what is wrong with its markers (``problems``, one line each)."""

    seams: dict[str, Seam] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def add(self, target: str, use: str, by: str) -> Seam:
        seam = self.seams.setdefault(target, Seam(target))
        seam.uses.add(use)
        seam.by.add(by)
        return seam


@dataclass
class PluginFile:
    """One module of the plugin: its tree, and the local names its imports bind (at any depth)."""

    path: Path
    relative: str
    tree: ast.Module
    vllm_names: dict[str, tuple[str, str | None]]  # local name -> (vLLM module, imported name or None)
    plugin_names: dict[str, tuple[str, str | None]]  # the same for vllm_easyspec imports
    module: str

    @classmethod
    def read(cls, path: Path, root: Path) -> PluginFile:
        """Parse ``path`` (a module under ``root``) and map the local names its imports bind."""
        relative = path.relative_to(root).as_posix()
        module = relative.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        tree = ast.parse(path.read_text(), filename=str(path))
        vllm_names: dict[str, tuple[str, str | None]] = {}
        plugin_names: dict[str, tuple[str, str | None]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    names = vllm_names if _is_vllm(alias.name) else plugin_names
                    local = alias.asname or alias.name.split(".")[0]
                    names[local] = (alias.name if alias.asname else alias.name.split(".")[0], None)
            elif isinstance(node, ast.ImportFrom) and node.module:
                source = _absolute(module, path, node.module, node.level)
                names = vllm_names if _is_vllm(source) else plugin_names
                for alias in node.names:
                    names[alias.asname or alias.name] = (source, alias.name)
        return cls(path, relative, tree, vllm_names, plugin_names, module)

    def vllm_target(self, expression: ast.expr, tree: VllmTree) -> tuple[str, Definition | None] | None:
        """The vLLM name a ``Name`` / dotted ``Attribute`` expression stands for, and its definition (None when the
        tree lacks it), or None when it is not a vLLM name."""
        try:
            dotted = ast.unparse(expression)
        except Exception:  # noqa: BLE001 - not printable: not a name
            return None
        if not re.fullmatch(r"[\w.]+", dotted):
            return None
        head, _, rest = dotted.partition(".")
        if head not in self.vllm_names:
            return None
        module, name = self.vllm_names[head]
        if name is None and module == head:  # `import vllm`, then vllm.a.b.C: the longest module prefix
            module, qualname = tree.resolve(dotted) or (module, rest)
        else:
            qualname = ".".join(filter(None, [name, rest]))
        definition = tree.lookup(module, qualname)
        return canonical(module, qualname, definition), definition


def canonical(module: str, qualname: str, definition: Definition | None) -> str:
    """A definition's own location (``module:qualname``, a bare module for a module), else the name as written."""
    if definition is None or definition.kind == "external":
        return f"{module}:{qualname}" if qualname else module
    return definition.where


def _is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def _absolute(module: str, path: Path, name: str, level: int) -> str:
    if not level:
        return name
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    return ".".join([*package[: len(package) - level + 1], name])


def plugin_files(package: Path) -> list[PluginFile]:
    """Every module of the runtime package, parsed."""
    return [PluginFile.read(path, package.parent) for path in sorted(package.rglob("*.py"))]


def derive(package: Path, tree: VllmTree, listed: dict[str, dict[str, list[str]]], compat_names: list[str]) -> Derivation:
    """Every seam of the plugin at ``package`` (module docstring), resolved in ``tree``; ``listed``: the hand-kept
    names by use (``attribute``, ``mirror``) and owner; ``compat_names``: the vLLM names of ``compat.RELEASES``'
    row for the tree's release."""
    derivation = Derivation()
    files = plugin_files(package)
    for plugin_file in files:
        _imports(plugin_file, tree, derivation)
        _patches(plugin_file, tree, derivation)
        _marker_names(plugin_file, tree, derivation)
    _classes(files, tree, derivation)
    for use, owners in listed.items():
        for owner, names in owners.items():
            derivation.add(owner, use, "tools/seams/attributes.toml")
            for name in names:
                derivation.add(f"{owner}.{name}" if ":" in owner else f"{owner}:{name}", use,
                               "tools/seams/attributes.toml")
    for name in compat_names:
        derivation.add(name, "compat", "vllm_easyspec/integration/compat.py:RELEASES")
    return derivation


def _imports(plugin_file: PluginFile, tree: VllmTree, derivation: Derivation) -> None:
    """Every vLLM import of one file, at any depth: a module, or ``module:name`` as written."""
    for node in ast.walk(plugin_file.tree):
        by = f"{plugin_file.relative}:{node.lineno}" if hasattr(node, "lineno") else plugin_file.relative
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_vllm(alias.name):
                    derivation.add(alias.name, "import", by)
        elif isinstance(node, ast.ImportFrom) and node.module and _is_vllm(node.module) and not node.level:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                target = submodule if tree.is_module(submodule) and not tree.bindings(node.module).get(alias.name) \
                    else f"{node.module}:{alias.name}"
                derivation.add(target, "import", by)


def _patches(plugin_file: PluginFile, tree: VllmTree, derivation: Derivation) -> None:
    """Assignments and ``setattr`` calls on vLLM modules and classes: each a ``replace`` seam, which must be marked
    (a "Replaces" comment just above it, or a "Replaces" sentence of the file that names it)."""
    marked_lines, marked_names = _markers(plugin_file)
    constants = _string_constants(plugin_file.tree)
    for node in ast.walk(plugin_file.tree):
        found = _patched(node, constants)
        if found is None:
            continue
        owner_expression, attribute = found
        resolved = plugin_file.vllm_target(owner_expression, tree)
        if resolved is None:
            continue
        owner, definition = resolved
        by = f"{plugin_file.relative}:{node.lineno}"
        if attribute is None:
            if not any(node.lineno - MARKER_REACH <= line <= node.lineno for line in marked_lines):
                derivation.problems.append(f"{by}: setattr on {owner} with a name computed at run time and no "
                                           "\"Replaces\" comment above it naming what it replaces")
            continue
        separator = ":" if definition is not None and definition.kind == "module" else "."
        target = f"{owner}{separator}{attribute}"
        if tree.find(target) is None:  # a name of the plugin's own on a vLLM object (a release that adds it
            derivation.add(owner, "adds", by)  # makes this a replace seam the inventory lacks)
            continue
        derivation.add(target, "replace", by)  # as written: a module global bound by an import is the seam
        dotted = target.replace(":", ".")
        near = any(node.lineno - MARKER_REACH <= line <= node.lineno for line in marked_lines)
        if not near and dotted not in marked_names:
            derivation.problems.append(f"{by}: replaces {dotted} without a \"Replaces {dotted}\" comment above it")


def _patched(node: ast.AST, constants: dict[str, str]) -> tuple[ast.expr, str | None] | None:
    """``(owner, attribute)`` of ``owner.attribute = ...`` or ``setattr(owner, name, ...)`` (attribute None when
    the name is computed at run time), else None."""
    if isinstance(node, ast.Assign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute):
                return target.value, target.attr
        return None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
            and len(node.args) == 3:
        name = node.args[1]
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            return node.args[0], name.value
        if isinstance(name, ast.Name):
            return node.args[0], constants.get(name.id)
        return node.args[0], None
    return None


def _string_constants(module: ast.Module) -> dict[str, str]:
    return {target.id: node.value.value for node in module.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for target in node.targets if isinstance(target, ast.Name)}


def _markers(plugin_file: PluginFile) -> tuple[list[int], set[str]]:
    """The last line of every comment block with "Replaces", and every dotted vLLM name that a "Replaces"
    sentence (of a comment block or a docstring) names."""
    lines: list[int] = []
    names: set[str] = set()
    for last_line, text in _comment_blocks(plugin_file.path):
        if MARKER.search(text):
            lines.append(last_line)
            names.update(_marked_names(text))
    for text in _docstrings(plugin_file.tree):
        names.update(_marked_names(text))
    return lines, names


def _marked_names(text: str) -> set[str]:
    """The dotted vLLM names of each sentence of ``text`` that starts at "Replaces" (up to a period that ends a
    sentence, not one inside a dotted name)."""
    names = set()
    for match in MARKER.finditer(text):
        sentence = re.split(r"\.(?:\s|$)", text[match.start():], maxsplit=1)[0]
        names.update(name.rstrip(".") for name in DOTTED.findall(sentence))
    return names


def _comment_blocks(path: Path) -> Iterator[tuple[int, str]]:
    """``(last line, text)`` of each run of comments on consecutive lines."""
    block: list[str] = []
    last = -10
    with open(path, encoding="utf-8") as source:
        for token in tokenize.generate_tokens(source.readline):
            if token.type != tokenize.COMMENT:
                continue
            line = token.start[0]
            if line != last + 1 and block:
                yield last, " ".join(block)
                block = []
            block.append(token.string.lstrip("#").strip())
            last = line
    if block:
        yield last, " ".join(block)


def _docstrings(module: ast.Module) -> Iterator[str]:
    for node in ast.walk(module):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=True)
            if text:
                yield " ".join(text.split())


def _marker_names(plugin_file: PluginFile, tree: VllmTree, derivation: Derivation) -> None:
    """Every dotted vLLM name a "Replaces" sentence names is a ``replace`` seam; one the tree lacks is a problem
    (the comment would describe a vLLM that is not there)."""
    _, names = _markers(plugin_file)
    for dotted in sorted(names):
        resolved = tree.resolve(dotted)
        if resolved is None or tree.lookup(*resolved) is None:
            derivation.problems.append(f"{plugin_file.relative}: a \"Replaces\" comment names {dotted}, which vLLM "
                                       f"{tree.version} does not define")
            continue
        module, qualname = resolved
        derivation.add(f"{module}:{qualname}" if qualname else module, "replace", plugin_file.relative)


ClassKey = tuple[str, str]  # (plugin module, class name)


def _classes(files: list[PluginFile], tree: VllmTree, derivation: Derivation) -> None:
    """``subclass``, ``override`` and ``attribute`` seams of every plugin class with a vLLM base (module
    docstring), and the names the plugin adds to each such vLLM class."""
    index: dict[ClassKey, tuple[PluginFile, ast.ClassDef]] = {}
    for plugin_file in files:
        for node in ast.walk(plugin_file.tree):
            if isinstance(node, ast.ClassDef):
                index[(plugin_file.module, node.name)] = (plugin_file, node)
    for plugin_file, node in index.values():
        lineage = _lineage(plugin_file, node, index)
        bases = [target for base_file, base in lineage for expression in base.bases
                 if (target := _vllm_class(base_file, expression, tree)) is not None]
        for base in dict.fromkeys(bases):
            _subclass(f"{plugin_file.relative}:{node.name}", base, lineage, tree, derivation)


def _lineage(plugin_file: PluginFile, node: ast.ClassDef, index: dict) -> list[tuple[PluginFile, ast.ClassDef]]:
    """The class and its plugin ancestors, nearest first."""
    out = [(plugin_file, node)]
    for expression in node.bases:
        if not isinstance(expression, ast.Name):
            continue
        key = (plugin_file.module, expression.id)
        if key not in index and expression.id in plugin_file.plugin_names:
            module, name = plugin_file.plugin_names[expression.id]
            key = (module, name or "")
        if key in index and index[key][1] is not node:
            out.extend(pair for pair in _lineage(*index[key], index) if pair not in out)
    return out


def _vllm_class(plugin_file: PluginFile, expression: ast.expr, tree: VllmTree) -> str | None:
    resolved = plugin_file.vllm_target(expression, tree)
    if resolved is None or resolved[1] is None or resolved[1].kind != "class":
        return None
    return resolved[0]


def _subclass(by: str, base: str, lineage: list[tuple[PluginFile, ast.ClassDef]], tree: VllmTree,
              derivation: Derivation) -> None:
    """A plugin class (``lineage``: it and its plugin ancestors) over the vLLM class ``base``: the names both
    define are overrides, the names it reaches on ``self`` that only vLLM's class defines are attributes. Its own
    names are not seams; a vLLM release that adds one turns it into a seam the inventory lacks."""
    members = tree.members(base)
    derivation.add(base, "subclass", by)
    defined: dict[str, str] = {}  # names the plugin's classes define in their bodies -> where
    referenced: dict[str, str] = {}  # names they reach on self / super() -> where
    for plugin_file, node in lineage:
        for statement in node.body:
            for name in _defined_names(statement):
                defined.setdefault(name, f"{plugin_file.relative}:{node.name}.{name}")
        for inner in ast.walk(node):
            name = _instance_attribute(inner)
            if name is not None:
                referenced.setdefault(name, f"{plugin_file.relative}:{node.name}")
    for name, where in defined.items():
        if name in members:
            derivation.add(f"{base}.{name}", "override", where)
    for name, where in referenced.items():
        if name in members and name not in defined:
            derivation.add(f"{base}.{name}", "attribute", where)


def _defined_names(statement: ast.stmt) -> list[str]:
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [statement.name]
    if isinstance(statement, ast.Assign | ast.AnnAssign):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        return [target.id for target in targets if isinstance(target, ast.Name)]
    return []


def _instance_attribute(node: ast.AST) -> str | None:
    """``name`` of ``self.name`` or ``super().name``."""
    if not isinstance(node, ast.Attribute):
        return None
    value = node.value
    if isinstance(value, ast.Name) and value.id == "self":
        return node.attr
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
        return node.attr
    return None
