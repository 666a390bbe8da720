"""A vLLM source tree read without importing it: where a dotted name is defined, what a class has through its
vLLM bases, and the fingerprints the seam check compares.

Everything here is static (``ast``), so the tree may be another vLLM release than the installed one, e.g. a wheel
unpacked into a folder. Invariants: a lookup never imports vLLM; a fingerprint depends on the code only, not on
its formatting, comments or docstrings.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

PROPERTY_DECORATORS = {"property", "cached_property", "functools.cached_property"}
CALL_DECORATORS = {"staticmethod", "classmethod"}


@dataclass(frozen=True)
class ImportBinding:
    """A module-level ``import`` / ``from ... import`` binding: ``module`` and, for ``from``, the ``name``."""

    module: str
    name: str | None = None


@dataclass(frozen=True)
class Definition:
    """What a dotted name is in a vLLM tree. ``kind``: module, class, function, property, global, attribute
    (a class-level name or one a method assigns to ``self``) or external (bound to a non-vLLM object);
    ``where``: the module and qualified name that define it (a member found through a base class names the
    base)."""

    kind: str
    where: str
    node: ast.AST | None = None


def installed_root() -> Path:
    """The folder holding the installed ``vllm`` package, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no vLLM is installed in this environment")
    return Path(next(iter(spec.submodule_search_locations))).parent


class VllmTree:
    """The ``vllm`` package under ``root`` (site-packages, or a folder a wheel was unpacked into)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        if not (self.root / "vllm" / "__init__.py").is_file():
            raise FileNotFoundError(f"{self.root} holds no vllm package (no vllm/__init__.py)")
        self._parsed: dict[str, ast.Module | None] = {}
        self._bindings: dict[str, dict[str, ast.AST | ImportBinding]] = {}
        self._members: dict[str, dict[str, Definition]] = {}

    @functools.cached_property
    def version(self) -> str:
        """The release, from ``vllm/_version.py`` (``unknown`` when the tree has none)."""
        path = self.root / "vllm" / "_version.py"
        found = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]",
                          path.read_text() if path.is_file() else "")
        return found.group(1) if found else "unknown"

    def module_file(self, module: str) -> Path | None:
        """The file of a vLLM module (a package's ``__init__.py``), None when it has none (extensions too)."""
        if module != "vllm" and not module.startswith("vllm."):
            return None
        base = self.root.joinpath(*module.split("."))
        for path in (base / "__init__.py", base.with_suffix(".py")):
            if path.is_file():
                return path
        return None

    def is_module(self, module: str) -> bool:
        base = self.root.joinpath(*module.split("."))
        return self.module_file(module) is not None or any(base.parent.glob(base.name + ".*.so"))

    def parse(self, module: str) -> ast.Module | None:
        if module not in self._parsed:
            path = self.module_file(module)
            self._parsed[module] = None if path is None else ast.parse(path.read_text(), filename=str(path))
        return self._parsed[module]

    def bindings(self, module: str) -> dict[str, ast.AST | ImportBinding]:
        """The names a module binds at its top level when it runs: definitions, assignments and imports
        (``if TYPE_CHECKING:`` bodies excluded, ``from x import *`` followed)."""
        if module not in self._bindings:
            tree = self.parse(module)
            found: dict[str, ast.AST | ImportBinding] = {}
            if tree is not None:
                self._bind(module, tree.body, found, seen={module})
            self._bindings[module] = found
        return self._bindings[module]

    def _bind(self, module: str, body: list[ast.stmt], found: dict, seen: set[str]) -> None:
        """Add the names ``body`` binds at run time to ``found`` (``seen``: modules whose ``*`` is followed)."""
        for node in body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                found[node.name] = node
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            found[name.id] = node
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        found[alias.asname] = ImportBinding(alias.name)
                    else:
                        found[alias.name.split(".")[0]] = ImportBinding(alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                self._bind_from(module, node, found, seen)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    self._bind(module, node.body, found, seen)
                self._bind(module, node.orelse, found, seen)
            elif isinstance(node, ast.Try):
                for part in (node.body, *(handler.body for handler in node.handlers), node.orelse, node.finalbody):
                    self._bind(module, part, found, seen)
            elif isinstance(node, ast.With):
                self._bind(module, node.body, found, seen)

    def _bind_from(self, module: str, node: ast.ImportFrom, found: dict, seen: set[str]) -> None:
        source = self.absolute(module, node.module, node.level)
        for alias in node.names:
            if alias.name != "*":
                found[alias.asname or alias.name] = ImportBinding(source, alias.name)
            elif source not in seen and self.module_file(source) is not None:
                seen.add(source)
                inner: dict = {}
                self._bind(source, self.parse(source).body, inner, seen)
                found.update({name: value for name, value in inner.items() if not name.startswith("_")})

    def absolute(self, module: str, name: str | None, level: int) -> str:
        """The absolute module of ``from <level dots><name> import ...`` written in ``module``."""
        if not level:
            return name or ""
        path = self.module_file(module)
        package = module.split(".") if path is not None and path.name == "__init__.py" else module.split(".")[:-1]
        base = package[: len(package) - level + 1]
        return ".".join([*base, *([name] if name else [])])

    def resolve(self, dotted: str) -> tuple[str, str] | None:
        """``vllm.a.b.C.d`` as ``("vllm.a.b", "C.d")``: the longest prefix that is a module, and the rest."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            if self.is_module(".".join(parts[:cut])):
                return ".".join(parts[:cut]), ".".join(parts[cut:])
        return None

    def lookup(self, module: str, qualname: str, hops: int = 0) -> Definition | None:
        """What ``qualname`` is in ``module``, imports followed to the definition; None where it is not bound."""
        if hops > 12:
            return None
        if not qualname:
            return Definition("module", module) if self.is_module(module) else None
        head, _, rest = qualname.partition(".")
        binding = self.bindings(module).get(head)
        if binding is None:
            submodule = f"{module}.{head}"
            if self.is_module(submodule):
                return self.lookup(submodule, rest, hops + 1)
            return None if rest else self._lazy(module, head)
        if isinstance(binding, ImportBinding):
            if binding.module != "vllm" and not binding.module.startswith("vllm."):
                return Definition("external", f"{binding.module}:{binding.name or ''}")
            if binding.name is None:
                return self.lookup(binding.module, rest, hops + 1)
            return self.lookup(binding.module, ".".join(filter(None, [binding.name, rest])), hops + 1)
        where = f"{module}:{head}"
        if isinstance(binding, ast.ClassDef):
            return Definition("class", where, binding) if not rest else self.member(where, rest)
        if rest:
            return None
        if isinstance(binding, ast.FunctionDef | ast.AsyncFunctionDef):
            return Definition("function", where, binding)
        return Definition("global", where, binding)

    def _lazy(self, module: str, name: str) -> Definition | None:
        """A name a module's ``__getattr__`` makes on first use: one it names (``vllm.platforms.current_platform``,
        fingerprinted by that ``__getattr__``) or a key of a module-level dict (``vllm.envs``, by its value)."""
        hook = self.bindings(module).get("__getattr__")
        if not isinstance(hook, ast.FunctionDef):
            return None
        if any(isinstance(node, ast.Constant) and node.value == name for node in ast.walk(hook)):
            return Definition("global", f"{module}:{name}", hook)
        for statement in self.parse(module).body:
            value = getattr(statement, "value", None)
            if isinstance(statement, ast.Assign | ast.AnnAssign) and isinstance(value, ast.Dict):
                for key, item in zip(value.keys, value.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == name:
                        return Definition("global", f"{module}:{name}", item)
        return None

    def find(self, target: str) -> Definition | None:
        """A target written ``module:qualname`` (or a bare module)."""
        module, _, qualname = target.partition(":")
        return self.lookup(module, qualname)

    def bases(self, where: str) -> list[Definition]:
        """The vLLM classes a class names as its bases, in order (bases outside vLLM left out)."""
        found = self.find(where)
        if found is None or found.kind != "class":
            return []
        module = where.partition(":")[0]
        out = []
        for base in found.node.bases:
            expression = base.value if isinstance(base, ast.Subscript) else base
            try:
                dotted = ast.unparse(expression)
            except Exception:  # noqa: BLE001 - an expression ast cannot print: no base to follow
                continue
            definition = self.lookup(module, dotted) if re.fullmatch(r"[\w.]+", dotted) else None
            if definition is not None and definition.kind == "class":
                out.append(definition)
        return out

    def members(self, where: str) -> dict[str, Definition]:
        """Every member of a class, through its vLLM bases (depth first, left to right: the first definition of a
        name wins, as in a plain Python MRO)."""
        if where not in self._members:
            self._members[where] = {}  # a class among its own bases ends here
            found = self.find(where)
            if found is not None and found.kind == "class":
                out = dict(_own_members(found.where, found.node))
                for base in self.bases(found.where):
                    for name, definition in self.members(base.where).items():
                        out.setdefault(name, definition)
                self._members[where] = out
        return self._members[where]

    def member(self, where: str, name: str) -> Definition | None:
        """A member of a class (``Inner.name`` through a nested class), through its vLLM bases."""
        head, _, rest = name.partition(".")
        definition = self.members(where).get(head)
        if rest and definition is not None and definition.kind == "class":
            return self.member(definition.where, rest)
        return None if rest else definition


def _own_members(where: str, node: ast.ClassDef) -> dict[str, Definition]:
    """A class body's names: methods, properties, nested classes, class-level assignments, then what its
    methods assign to ``self``."""
    out: dict[str, Definition] = {}
    for statement in node.body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "property" if _decorators(statement) & PROPERTY_DECORATORS else "function"
            if statement.name not in out or kind == "property":  # a setter after its property stays the property
                out[statement.name] = Definition(kind, f"{where}.{statement.name}", statement)
        elif isinstance(statement, ast.ClassDef):
            out[statement.name] = Definition("class", f"{where}.{statement.name}", statement)
        elif isinstance(statement, ast.Assign | ast.AnnAssign):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out.setdefault(name.id, Definition("attribute", f"{where}.{name.id}", statement))
    for statement in ast.walk(node):
        targets = []
        if isinstance(statement, ast.Assign):
            targets = statement.targets
        elif isinstance(statement, ast.AnnAssign | ast.AugAssign):
            targets = [statement.target]
        for target in targets:
            for attribute in ast.walk(target):
                if (isinstance(attribute, ast.Attribute) and isinstance(attribute.value, ast.Name)
                        and attribute.value.id == "self"):
                    out.setdefault(attribute.attr, Definition("attribute", f"{where}.{attribute.attr}", None))
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        text = ast.unparse(target)
        names.add(text)
        if text.endswith((".setter", ".getter", ".deleter")):
            names.add("property")
    return names


def signature(definition: Definition) -> str:
    """How a definition is called or bound, as text a person can compare: a function's parameters (names,
    kinds, defaults; annotations left out) after the decorators that change how it is called, a class's bases,
    its annotated fields and its own ``__init__``'s parameters, else the kind alone."""
    node = definition.node
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        prefix = "".join(f"@{name} " for name in sorted(_decorators(node) & (PROPERTY_DECORATORS | CALL_DECORATORS)))
        return f"{prefix}({_parameters(node.args)})"
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(base) for base in node.bases)
        fields = [statement.target.id for statement in node.body
                  if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)]
        init = next((statement for statement in node.body if isinstance(statement, ast.FunctionDef)
                     and statement.name == "__init__"), None)
        text = f"class({bases})"
        if fields:
            text += f" fields({', '.join(fields)})"
        if init is not None:
            text += f" __init__({_parameters(init.args)})"
        return text
    return definition.kind


def _parameters(arguments: ast.arguments) -> str:
    stripped = copy.deepcopy(arguments)
    for argument in (*stripped.posonlyargs, *stripped.args, *stripped.kwonlyargs, stripped.vararg, stripped.kwarg):
        if argument is not None:
            argument.annotation = None
    return ast.unparse(stripped)


def body_fingerprint(definition: Definition) -> str:
    """A hash of the definition's code as ``ast.dump`` prints it, docstrings left out ("" for a module or an
    attribute a method assigns). Decorators count: they change what the body does."""
    node = definition.node
    if node is None or definition.kind == "module":
        return ""
    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        value = node.value
        text = "" if value is None else ast.dump(value)
    else:
        text = ast.dump(_without_docstrings(node))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _without_docstrings(node: ast.AST) -> ast.AST:
    node = copy.deepcopy(node)
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if (isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            inner.body = body[1:] or [ast.Pass()]
    return node


def source_text(tree: VllmTree, definition: Definition) -> str:
    """The definition's source lines in its tree (for diffs), or "" when it has no node."""
    node = definition.node
    if node is None or definition.kind == "module":
        return ""
    path = tree.module_file(definition.where.partition(":")[0])
    if path is None:
        return ""
    lines = path.read_text().splitlines(keepends=True)
    start = min([node.lineno, *(decorator.lineno for decorator in getattr(node, "decorator_list", []))])
    return "".join(lines[start - 1 : node.end_lineno])
