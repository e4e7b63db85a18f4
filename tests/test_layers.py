"""The packages' layers hold: every module imports its own layer or a layer below it, the import
graph between packages has no cycle, no private name crosses a package, and a function-level
import of the project's own modules is one this file lists with its reason.

The layers, bottom up (a layer may import those listed for it in :data:`ALLOWED`)::

    shared       kato (the package), kato.errors, kato.env, kato.shared.*: data every layer uses
    kernels      operator specs and templates
    db           SQL: models, queries, the ledger, import and export
    tuner        backends, the search, the worker
    kato_client  the REST client (the kernels' specs for its offline defaults)
    service      the FastAPI app, settings, the CLI
    kato_torch   PyTorch's custom ops over tuned kernels
    front        kato.tune, kato.remote, kato.kernel_tuner: ``kato.tune_kernel`` and ``kato.lookup``

The modules are read with :mod:`ast`, not imported, so an import under ``if TYPE_CHECKING:``
or inside a function counts like any other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("db", "kato", "kato_client", "kato_torch", "kernels", "service", "tuner")
#: Folders installed under ``kato.`` (setup.py's package_dir): ``db/x.py`` is ``kato.db.x``.
NAMESPACED = ("db", "kernels", "service", "tuner")

#: Module-name prefixes of each layer (the longest prefix that matches a module wins).
LAYERS = {
    "shared": ("kato", "kato.errors", "kato.env", "kato.shared"),
    "kernels": ("kato.kernels",),
    "db": ("kato.db",),
    "tuner": ("kato.tuner",),
    "kato_client": ("kato_client",),
    "service": ("kato.service",),
    "kato_torch": ("kato_torch",),
    "front": ("kato.tune", "kato.remote", "kato.kernel_tuner"),
}
#: The layers each layer may import, besides its own.
ALLOWED = {
    "shared": set(),
    "kernels": {"shared"},
    "db": {"shared", "kernels"},
    "tuner": {"shared", "kernels", "db"},
    "kato_client": {"shared", "kernels"},
    "service": {"shared", "kernels", "db", "tuner", "kato_client"},
    "kato_torch": {"shared", "kernels", "tuner", "kato_client"},
    "front": {"shared", "kernels", "db", "tuner", "kato_client", "service"},
}
#: Modules that import the project's own modules inside a function, and why. Every other
#: import of a project module is at module level.
FUNCTION_LEVEL = {
    "kato.service.cli.*": "a command loads its stack when it runs: `kato --help` imports none of "
    "kernels, db, SQLAlchemy, FastAPI, Optuna or the tuner",
    "kato.service.workers": "the tuner is imported when a worker is built, not when the module is: "
    "`measuring` (kato.tune_kernel, the CLI's options) stays cheap",
    "kato.tuner.backends.isolated": "the parent imports neither PyCUDA (an optional extra) nor an "
    "operator until a task names one; the measuring child imports what its task needs",
    "kato.tuner.backends.replay": "checking a recording loads the importer's rules (the pydantic "
    "file models) and the registry for that check only",
    "kato.tuner.framework": "PyTorch (an optional extra, through kato.tuner.torch_ops) is imported "
    "where the framework's own op is timed",
    "kato.kernels.cross_entropy.model": "at module level kato.kernels.parallel would join "
    "cross_entropy's version hash (kato.kernels.spec._kernel_helpers): the input fill is no kernel",
    "kato_client.client": "the kernels' specs (numpy) load only for an offline default",
    "kato_client.policy": "the kernels' specs (numpy) load only to check a config locally",
    "kato_torch.user": "the CUDA driver (libcuda through kato_torch._driver) is opened where "
    "constants are uploaded, not when a user op is defined",
    "kato.tune": "the tuning stack (db, tuner, service) loads with the first local tune or "
    "lookup, the service's client with the first remote one",
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module imported (``from a import b``: ``a.b`` where that is a module)
    names: tuple[str, ...]  # the names taken from ``target`` (empty for ``import x``)
    line: int
    in_function: bool
    type_checking: bool  # under ``if TYPE_CHECKING:``: never run


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return f"kato.{name}" if parts[0] in NAMESPACED else name


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for f in FOLDERS for p in sorted((REPO / f).rglob("*.py"))}


SOURCES = _sources()


def _ours(name: str) -> bool:
    return name.split(".")[0] in FOLDERS


def _imports(module: str, path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def walk(node: ast.AST, in_function: bool, typing: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            hint = typing or (
                isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            )
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if _ours(alias.name):
                        yield Import(module, alias.name, (), child.lineno, in_function, typing)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolved against the importing package
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                if not _ours(base):
                    continue
                for alias in child.names:  # ``from pkg import module`` imports that module
                    sub = f"{base}.{alias.name}"
                    target, names = (sub, ()) if sub in SOURCES else (base, (alias.name,))
                    yield Import(module, target, names, child.lineno, in_function, typing)
            yield from walk(child, inside, hint)

    yield from walk(tree, False, False)


IMPORTS = [i for m, p in SOURCES.items() for i in _imports(m, p)]


def layer_of(module: str) -> str:
    best = max(
        ((prefix, layer) for layer, ps in LAYERS.items() for prefix in ps
         if module == prefix or module.startswith(prefix + ".")),
        key=lambda pl: len(pl[0]),
    )  # fmt: skip
    return best[1]


def _package(module: str) -> str:
    """The package a module belongs to, for private names: its layer."""
    return layer_of(module)


def test_no_module_imports_the_old_top_level_names() -> None:
    """``db``, ``kernels``, ``service`` and ``tuner`` are ``kato.db``, ...: an import of an old
    name fails where Kato is installed, and in a checkout (pytest's pythonpath holds the root)
    it loads a second copy of the module."""
    paths = [*SOURCES.values(), *sorted((REPO / "tests").rglob("*.py"))]
    paths += sorted((REPO / "benchmarks").rglob("*.py"))
    old = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            old += [f"{where} {name}" for name in names if name.split(".")[0] in NAMESPACED]
    assert old == [], "\n".join(old)


def test_every_module_belongs_to_a_layer() -> None:
    assert {layer_of(m) for m in SOURCES} == set(LAYERS)


def test_layers_import_downward_only() -> None:
    upward = sorted(
        f"{i.module}:{i.line} imports {i.target} ({layer_of(i.module)} -> {layer_of(i.target)})"
        for i in IMPORTS
        if layer_of(i.target) != layer_of(i.module)
        and layer_of(i.target) not in ALLOWED[layer_of(i.module)]
    )
    assert upward == [], "\n".join(upward)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the nodes along it (first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def package_graph() -> dict[str, set[str]]:
    """Layer -> the other layers it imports (at any level)."""
    graph: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    for i in IMPORTS:
        if layer_of(i.target) != layer_of(i.module):
            graph[layer_of(i.module)].add(layer_of(i.target))
    return graph


def test_the_package_graph_has_no_cycle() -> None:
    assert _cycle(package_graph()) is None


def test_the_module_graph_has_no_cycle_at_import_time() -> None:
    """Module-level imports only: a function-level one runs after every module is loaded."""
    graph: dict[str, set[str]] = {}
    for i in IMPORTS:
        if not (i.in_function or i.type_checking) and i.target != i.module:
            graph.setdefault(i.module, set()).add(_loaded(i.target))
    assert _cycle(graph) is None


def _loaded(target: str) -> str:
    """The module an import loads: ``a.b`` where that is one of ours, else its package."""
    while target not in SOURCES and "." in target:
        target = target.rpartition(".")[0]
    return target


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_crosses_a_package() -> None:
    crossing = []
    for i in IMPORTS:
        if _package(i.target) == _package(i.module):
            continue
        private = [n for n in i.names if _private(n)]
        private += [p for p in i.target.split(".") if _private(p)]
        if private:
            crossing.append(f"{i.module}:{i.line} takes {private} from {i.target}")
    for module, path in SOURCES.items():  # ``alias._name`` on a module of another package
        tree = ast.parse(path.read_text(), str(path))
        aliases = _module_aliases(module, tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _private(node.attr)
                and _package(aliases[node.value.id]) != _package(module)
            ):
                crossing.append(f"{module}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert crossing == [], "\n".join(crossing)


def _module_aliases(module: str, tree: ast.AST) -> dict[str, str]:
    """Local names bound to one of the project's modules (``import a.b as c``, ``from a
    import b`` where ``a.b`` is a module)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    local = alias.asname or alias.name.split(".")[0]
                    out[local] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and _ours(node.module):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in SOURCES:
                    out[alias.asname or alias.name] = sub
    return out


def _matches(module: str, pattern: str) -> bool:
    return module == pattern or (pattern.endswith(".*") and module.startswith(pattern[:-1]))


def _listed(module: str) -> str | None:
    return next((why for p, why in FUNCTION_LEVEL.items() if _matches(module, p)), None)


def test_function_level_imports_are_the_listed_ones() -> None:
    unlisted = sorted(
        f"{i.module}:{i.line} imports {i.target}"
        for i in IMPORTS
        if i.in_function and _listed(i.module) is None
    )
    assert unlisted == [], "import at module level, or list the module with its reason"
    lazy = {i.module for i in IMPORTS if i.in_function}
    stale = [p for p in FUNCTION_LEVEL if not any(_matches(m, p) for m in lazy)]
    assert stale == [], "no function-level import left there: drop it from FUNCTION_LEVEL"
