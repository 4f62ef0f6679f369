"""Import layout: no cycles, no hidden imports, layers that point down.

These tests read the package's source with ``ast`` and import none of it (except the
last one), so a broken layout is reported as a list of offending imports, each with
its file and line, instead of as an ImportError somewhere else.

An import is *module level* when it runs while the module is imported: a top-level
statement, including one inside a top-level ``try``, ``if``, ``with`` or class body,
but not one inside a function (methods included) or an ``if TYPE_CHECKING:`` block.
"""

from __future__ import annotations

import ast
import functools
import itertools
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "jaxhistory"

# The package's modules by layer, lowest first. A module-level import may go to a
# module of the same layer or of a lower one, never to a higher one: leaf utilities
# know nothing of JAX reducers, the device-side reducers know nothing of the stored
# history, the history's data model knows nothing of files, sinks or processes, and
# only the package ``__init__`` sees everything. Code in a lower layer that needs a
# higher one takes it as an argument rather than importing it.
#
# Modules listed here that do not exist are skipped. A module that exists and is not
# listed is in EFFECTS when it lies inside one of EFFECTS_PACKAGES; any other
# unlisted module fails test_every_module_has_a_layer until it is added here.
LEAF, DEVICE, DATA, EFFECTS, TOP = range(5)
LAYER_NAMES = {
    LEAF: "leaf utilities",
    DEVICE: "device side",
    DATA: "pure data",
    EFFECTS: "effects",
    TOP: "package",
}
LAYERS = {
    # Leaf utilities: no package imports beyond this layer.
    "jaxhistory._version": LEAF,
    "jaxhistory._optional": LEAF,
    "jaxhistory._moved": LEAF,  # old spellings that warn for one release
    "jaxhistory._files": LEAF,  # atomic writes, appending logs
    "jaxhistory._names": LEAF,  # the one flatten, metric names
    "jaxhistory._dtypes": LEAF,  # dtype rules, int64 range, steps
    "jaxhistory._codec": LEAF,  # the record / JSONL line codec
    "jaxhistory._record": LEAF,  # Record and Batch, what sinks receive
    "jaxhistory._row": LEAF,  # Row: one update, parsed once
    "jaxhistory._compiled": LEAF,  # the compiled host-path helpers (or None)
    "jaxhistory._progress": LEAF,  # steps per second, time left, MFU
    "jaxhistory._run_stats": LEAF,  # run-level statistics of one metric
    "jaxhistory._env": LEAF,  # run ids, the environment, on/off variables
    "jaxhistory._tree": LEAF,
    "jaxhistory._hlo": LEAF,
    "jaxhistory._trace_state": LEAF,
    "jaxhistory.launch": LEAF,
    "jaxhistory._launch_worker": LEAF,
    # Device side: the reducers that run inside jit and shard_map.
    "jaxhistory._ops": DEVICE,
    "jaxhistory._reduce": DEVICE,
    "jaxhistory._collective": DEVICE,
    "jaxhistory.collective": DEVICE,  # the shard_map forms, one namespace
    "jaxhistory._stats": DEVICE,
    "jaxhistory._watch": DEVICE,
    "jaxhistory._quantiles": DEVICE,
    "jaxhistory._provenance": DEVICE,
    "jaxhistory.export._draw_worker": EFFECTS,
    "jaxhistory._buffer": DEVICE,
    "jaxhistory._memory": DEVICE,
    "jaxhistory.metrics": DEVICE,  # accumulators: per-device state, jit and shard_map
    # Pure data: the history's tables and their conversions, no files or threads.
    "jaxhistory._host_copies": DATA,  # device scalars to the host, stacked
    "jaxhistory._table": DATA,
    "jaxhistory._history_state": DATA,
    "jaxhistory._appending": DATA,  # the checks and bulk appends of a state
    "jaxhistory._combining": DATA,  # states made from whole states
    "jaxhistory._xarray": DATA,
    "jaxhistory._views": DATA,  # History.history, .data and .groups, read-only
    # Effects: files, threads, processes, sinks, the command line.
    "jaxhistory._writer": EFFECTS,  # the one background thread, any target
    "jaxhistory._fan_out": EFFECTS,  # rows -> the JSONL log, traces, sinks
    "jaxhistory._run_log": EFFECTS,  # History's log, sinks and update times
    "jaxhistory._run_setup": EFFECTS,  # resume, the sinks of this process
    "jaxhistory._side_values": EFFECTS,  # attached values, memory samples
    "jaxhistory._summary": EFFECTS,
    "jaxhistory.sentinels": EFFECTS,  # checks that act on recorded values
    "jaxhistory._distributed": EFFECTS,
    "jaxhistory._host_batches": EFFECTS,  # batches reduced through the store
    "jaxhistory._hang": EFFECTS,  # the hang report of a multi-process History
    "jaxhistory._stragglers": EFFECTS,  # per-process arrival lags over windows
    "jaxhistory._history": EFFECTS,
    "jaxhistory._recorder": EFFECTS,  # what History does with each update
    "jaxhistory._job": EFFECTS,  # what a History shares with the other processes
    "jaxhistory._results": EFFECTS,
    "jaxhistory._timing": EFFECTS,
    "jaxhistory.trace": EFFECTS,
    "jaxhistory._trace_file": EFFECTS,  # the open trace file, the writer's target
    "jaxhistory._trace_names": EFFECTS,  # trace folder and file names, ranks
    "jaxhistory._trace_read": EFFECTS,  # load_trace: whole or cut-off files
    "jaxhistory._trace_merge": EFFECTS,  # merge_traces: one clock, one file
    "jaxhistory.publish": EFFECTS,
    "jaxhistory.sinks": EFFECTS,
    "jaxhistory.sinks._csv": EFFECTS,  # CSV rows, widened by an atomic rewrite
    "jaxhistory.sinks._named": EFFECTS,  # sinks by name, JAXHISTORY_SINKS
    "jaxhistory.sinks._training_history": EFFECTS,  # the table sinks log at finalize
    "jaxhistory.export": EFFECTS,
    "jaxhistory.cli": EFFECTS,
    "jaxhistory.__main__": EFFECTS,
    # The package __init__ may import anything.
    "jaxhistory": TOP,
}
EFFECTS_PACKAGES = ("jaxhistory.export", "jaxhistory.sinks")

OPTIONAL_IMPORT_CHECK = (
    "import jaxhistory, sys; print(sorted(m for m in sys.modules if m.split('.')[0] "
    "in ('xarray','matplotlib','plotext','netCDF4','wandb','tensorboardX','flax',"
    "'optax')))"
)


@dataclass(frozen=True)
class Import:
    """One package module brought in by one import statement."""

    importer: str
    target: str
    file: str  # relative to the repository root
    line: int
    statement: str
    in_function: bool

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where}: {self.statement}"


# C extensions of the package (built from jaxhistory/<name>.c): they import
# no package module, so an import of one is at the bottom of every layer
COMPILED_MODULES = {"jaxhistory._speedups"}


def test_the_compiled_modules_are_the_c_sources_of_the_package():
    sources = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / PACKAGE).rglob("*.c")
    }
    assert sources == COMPILED_MODULES


def find_modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def is_type_checking(node: ast.AST) -> bool:
    """Whether ``node`` is the test of an ``if TYPE_CHECKING:`` block."""
    return (isinstance(node, ast.Name) and node.id == "TYPE_CHECKING") or (
        isinstance(node, ast.Attribute) and node.attr == "TYPE_CHECKING"
    )


def import_statements(
    node: ast.AST, in_function: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement in ``node`` that can run, with whether it runs in a
    function; the bodies of ``if TYPE_CHECKING:`` blocks never run."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, in_function
        return
    if isinstance(node, ast.If) and is_type_checking(node.test):
        children = node.orelse
    else:
        children = list(ast.iter_child_nodes(node))
        in_function = in_function or isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        )
    for child in children:
        yield from import_statements(child, in_function)


def existing_prefix(name: str, modules: Mapping[str, Path]) -> str:
    """The longest dotted prefix of ``name`` that is a module of the package."""
    parts = name.split(".")
    while len(parts) > 1 and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts)


def from_base(
    node: ast.ImportFrom, importer: str, modules: Mapping[str, Path]
) -> str | None:
    """The absolute module a ``from ... import`` reads from (None for a relative
    import that climbs out of the package)."""
    if node.level == 0:
        return node.module
    parts = importer.split(".")
    if modules[importer].name != "__init__.py":
        parts.pop()  # a plain module's "." is its package
    parts = parts[: len(parts) - (node.level - 1)]
    if not parts:
        return None
    return ".".join([*parts, node.module] if node.module else parts)


def imported_modules(
    node: ast.Import | ast.ImportFrom, importer: str, modules: Mapping[str, Path]
) -> list[str]:
    """The package modules whose code an import statement runs (or needs already
    run): what it names, then the parent packages of those, except the package
    itself and the packages that contain the importer."""
    if isinstance(node, ast.Import):
        named = [alias.name for alias in node.names]
    else:
        base = from_base(node, importer, modules)
        named = [] if base is None else [f"{base}.{a.name}" for a in node.names]
        named = [name if name in modules else base for name in named]
    targets = []
    for name in named:
        if name.split(".")[0] != PACKAGE or name in COMPILED_MODULES:
            continue
        target = existing_prefix(name, modules)
        parts = target.split(".")
        parents = [".".join(parts[:n]) for n in range(2, len(parts))]
        for module in [target, *parents]:
            inside = importer == module or importer.startswith(module + ".")
            if module == target or not inside:
                targets.append(module)
    return list(dict.fromkeys(targets))


def module_imports(
    importer: str, tree: ast.Module, modules: Mapping[str, Path]
) -> list[Import]:
    """Every import of a package module by ``importer``, one per target."""
    file = str(modules[importer].relative_to(ROOT))
    found = []
    for node, in_function in import_statements(tree):
        statement = ast.unparse(node)
        for target in imported_modules(node, importer, modules):
            found.append(
                Import(importer, target, file, node.lineno, statement, in_function)
            )
    return found


@functools.cache
def package_modules() -> dict[str, Path]:
    return find_modules(ROOT / PACKAGE)


@functools.cache
def package_imports() -> tuple[Import, ...]:
    modules = package_modules()
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found.extend(module_imports(name, tree, modules))
    return tuple(found)


def module_level_imports() -> list[Import]:
    """Imports that run when their module is imported (self-imports left out)."""
    return [
        imp
        for imp in package_imports()
        if not imp.in_function and imp.importer != imp.target
    ]


def import_graph(imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    return graph


def strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its components of more than one module."""
    return [c for c in strongly_connected(graph) if len(c) > 1]


def cycle_path(component: list[str], graph: Mapping[str, set[str]]) -> list[str]:
    """One cycle through the component's first module, as a list of modules that
    starts and ends with it (a breadth-first search inside the component)."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if succ not in came_from:
                    came_from[succ] = node
                    nxt.append(succ)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def layer_of(module: str) -> int | None:
    if module in LAYERS:
        return LAYERS[module]
    if any(module.startswith(package + ".") for package in EFFECTS_PACKAGES):
        return EFFECTS
    return None


def describe(node: ast.stmt) -> str:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return f"def {node.name}"
    if isinstance(node, ast.ClassDef):
        return f"class {node.name}"
    return ast.unparse(node).splitlines()[0][:70]


def is_all_assignment(node: ast.stmt) -> bool:
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign | ast.AugAssign):
        targets = [node.target]
    else:
        return False
    return all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


def test_cycle_finder_reports_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycle_path(["a", "b", "c"], graph) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    imports = module_level_imports()
    graph = import_graph(imports)
    reports = []
    for component in cycles(graph):
        path = cycle_path(component, graph)
        lines = [f"cycle among {', '.join(component)}:", "  " + " -> ".join(path)]
        for importer, target in itertools.pairwise(path):
            imp = next(
                i for i in imports if i.importer == importer and i.target == target
            )
            lines.append(f"    {imp}")
        reports.append("\n".join(lines))
    assert not reports, "module-level import cycles:\n" + "\n".join(reports)


def test_no_in_function_import_of_the_package():
    in_function = [imp for imp in package_imports() if imp.in_function]
    in_function.sort(key=lambda imp: (imp.file, imp.line))
    offenders = list(dict.fromkeys(str(imp) for imp in in_function))
    assert not offenders, (
        "package modules imported inside functions (import them at module level, "
        "or move the code so that no cycle needs hiding):\n  " + "\n  ".join(offenders)
    )


def test_every_module_has_a_layer():
    unlisted = [name for name in package_modules() if layer_of(name) is None]
    assert not unlisted, (
        "modules with no layer: add them to LAYERS in tests/test_layout.py: "
        + ", ".join(unlisted)
    )


def test_imports_point_down_the_layers():
    offenders = []
    for imp in module_level_imports():
        low, high = layer_of(imp.importer), layer_of(imp.target)
        if low is None or high is None or high <= low:
            continue  # unlisted modules fail test_every_module_has_a_layer
        offenders.append(
            f"{imp.where}: {imp.importer} ({LAYER_NAMES[low]}, {low}) imports "
            f"{imp.target} ({LAYER_NAMES[high]}, {high}): {imp.statement}"
        )
    assert not offenders, "imports that go up a layer:\n  " + "\n  ".join(offenders)


def test_sinks_init_only_reexports():
    path = ROOT / PACKAGE / "sinks" / "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    offenders = []
    for position, node in enumerate(tree.body):
        docstring = (
            position == 0
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        )
        allowed = isinstance(node, ast.Import | ast.ImportFrom)
        if not (docstring or allowed or is_all_assignment(node)):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            offenders.append(f"{where}: {describe(node)}")
    assert not offenders, (
        "jaxhistory/sinks/__init__.py may hold only a docstring, imports and "
        "__all__; move these into a submodule:\n  " + "\n  ".join(offenders)
    )


def test_import_pulls_in_no_optional_package():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", OPTIONAL_IMPORT_CHECK],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", (
        f"import jaxhistory imports optional packages: {out.stdout.strip()}"
    )


def _sources() -> Iterator[tuple[str, Path, ast.Module]]:
    for name, path in find_modules(ROOT / PACKAGE).items():
        yield name, path, ast.parse(path.read_text(), filename=str(path))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_crosses_a_module():
    """What another module needs has a public spelling in its own module (a
    private module may be imported; a private name from it may not), and no
    module reads another module's private attribute (``_mod._name``)."""
    offenders = []
    for name, path, tree in _sources():
        where = path.relative_to(ROOT)
        modules = set()  # names bound to package modules in this file
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                PACKAGE
            ):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    if target in find_modules(ROOT / PACKAGE):
                        modules.add(alias.asname or alias.name)
                    elif _private(alias.name):
                        offenders.append(f"{where}:{node.lineno}: {alias.name}")
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and _private(node.attr)
            ):
                offenders.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr}")
        del name
    assert not offenders, "private names used across modules:\n" + "\n".join(offenders)


# The only modules that start threads: the writer (and its per-sink fan-out,
# which keeps one slow sink from holding the others back), the memory sampler,
# the hang watch (apart from the writer: it must speak when the log is stuck),
# the host reduction of a multi-process History's batches (it waits for the
# other processes) and the launcher's output readers.
THREAD_MODULES = {
    "jaxhistory._writer",
    "jaxhistory.sinks._feed",
    "jaxhistory._memory",
    "jaxhistory._host_batches",
    "jaxhistory._hang",
    "jaxhistory.launch",
}


def test_threads_start_only_in_the_thread_modules():
    offenders = []
    for name, path, tree in _sources():
        if name in THREAD_MODULES:
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("Thread", "Timer", "ThreadPoolExecutor")
            ) or (
                isinstance(node, ast.Name)
                and node.id in ("Thread", "Timer", "ThreadPoolExecutor")
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, (
        "threads started outside "
        + ", ".join(sorted(THREAD_MODULES))
        + ":\n"
        + "\n".join(offenders)
    )


# Lines a class may take, docstrings included. History, HistoryState and the
# trace handler had grown to 663, 710 and 444 lines; each part now lives in a
# class or module named for what it holds (the anchors' largest: CLU 258 lines,
# optax 189, equinox 277).
MAX_CLASS_LINES = 450


def test_no_class_is_longer_than_450_lines():
    sizes = {}
    for name, path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                sizes[f"{path.relative_to(ROOT)}: {node.name}"] = (
                    node.end_lineno - start + 1
                )
        del name
    assert sizes["jaxhistory/_history.py: History"] > 100  # (found at all)
    long = {k: n for k, n in sizes.items() if n > MAX_CLASS_LINES}
    assert not long, f"classes over {MAX_CLASS_LINES} lines: {long}"


def _documented_layers() -> dict[str, set[str]]:
    """Layer name -> the modules the architecture page's layer table lists."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in LAYER_NAMES.values():
            out[cells[0]] = {m.strip().strip("`") for m in cells[1].split(",")}
    return out


def test_the_documented_layer_table_matches_the_layout():
    """The architecture page's table of layers lists every module in the layer
    this test puts it in (a module inside ``export``/``sinks`` as the package)."""
    expected: dict[str, set[str]] = {}
    for name in find_modules(ROOT / PACKAGE):
        if name in (PACKAGE, f"{PACKAGE}.__main__"):
            continue
        layer = LAYERS.get(name)
        shown = name.removeprefix(f"{PACKAGE}.")
        for pkg in EFFECTS_PACKAGES:
            if name == pkg or name.startswith(pkg + "."):
                shown = pkg.removeprefix(f"{PACKAGE}.") + "/"
                layer = EFFECTS if layer is None or shown != name else layer
        if shown.endswith("/"):
            layer = EFFECTS
        expected.setdefault(LAYER_NAMES[layer], set()).add(shown)
    assert _documented_layers() == expected
