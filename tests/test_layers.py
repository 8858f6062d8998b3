"""The dependency direction holds: the library imports nothing above it.

``kvserver/`` (daemon, client, wire formats) never imports the packages built on it
(``scheduler``, ``worker``, ``kvserver_vllm``, ``benchmarks``), nor torch, nor the tests; the
benchmarks never import the tests. The subcommands of the packages above the library reach
``kvserver`` through the ``kvserver.commands`` entry points (kvserver/cli.py).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import kvserver.cli
from tests.support.entry_points import declared_commands

ROOT = Path(__file__).resolve().parent.parent
ABOVE_THE_LIBRARY = {
    "scheduler", "worker", "kvserver_vllm", "step_protocol", "benchmarks", "tests", "torch",
}  # fmt: skip


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in ``path``: import statements, wherever they are, and
    ``importlib.import_module("name")`` / ``__import__("name")`` with a literal name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if name in ("import_module", "__import__") and isinstance(first, ast.Constant):
                yield node.lineno, str(first.value)


def imports_of(package: str, forbidden: set[str]) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in imported_modules(path):
            if module.split(".")[0] in forbidden:
                found.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    return found


def test_the_library_imports_nothing_above_it() -> None:
    assert imports_of("kvserver", ABOVE_THE_LIBRARY) == []


def test_the_step_protocol_is_shared_and_depends_on_neither_end() -> None:
    """scheduler/ and worker/ meet only in step_protocol/, which imports neither of them."""
    assert imports_of("step_protocol", ABOVE_THE_LIBRARY - {"step_protocol"}) == []
    assert imports_of("scheduler", {"worker", "kvserver_vllm", "torch"}) == []
    assert imports_of("worker", {"scheduler", "kvserver_vllm"}) == []


def test_only_the_command_imports_the_daemon() -> None:
    """Inside ``kvserver/`` the daemon is the top: ``cluster/``, ``client/``, ``ssd/``,
    ``policies/`` and the top-level modules are what it is built on and never import
    ``kvserver.daemon`` (``cluster/`` once imported the daemon's event log and peer
    directory); only the command, ``kvserver/cli.py``, does."""
    found: dict[str, list[int]] = {}
    for path in sorted((ROOT / "kvserver").rglob("*.py")):
        if "daemon" in path.relative_to(ROOT / "kvserver").parts:
            continue
        for line, module in imported_modules(path):
            if module == "kvserver.daemon" or module.startswith("kvserver.daemon."):
                found.setdefault(str(path.relative_to(ROOT)), []).append(line)
    assert list(found) == ["kvserver/cli.py"], found


def test_benchmarks_do_not_import_the_tests() -> None:
    assert imports_of("benchmarks", {"tests"}) == []


def test_the_engines_value_types_load_without_the_engine() -> None:
    """The gRPC client (the engine's ``CutKeys``) and ScoreHosts' RPC run no engine: importing
    them, and so ``kvserver/engine/__init__.py``, loads neither the engine nor its policies;
    ``from kvserver.engine import StorageEngine`` still gives the engine (kvserver/engine/)."""
    code = (
        "import sys, kvserver.grpc_client, kvserver.cluster.rpc\n"
        "print(sorted(m for m in sys.modules if m in ('kvserver.engine.core',"
        " 'kvserver.policies')))\n"
        "from kvserver.engine import IndexKey, StorageEngine\n"
        "import kvserver.engine.core as core\n"
        "print(StorageEngine is core.StorageEngine, IndexKey is core.IndexKey)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "True True"]


def test_the_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The scan is not vacuous: each form of import is reported."""
    path = tmp_path / "m.py"
    path.write_text(
        "import torch\nfrom scheduler.cli import x\ndef f():\n    import worker.cli\n"
        "import importlib\nimportlib.import_module('kvserver_vllm.connector')\n"
    )
    modules = sorted(module for _, module in imported_modules(path))
    expected = ["importlib", "kvserver_vllm.connector", "scheduler.cli", "torch", "worker.cli"]
    assert modules == expected


PROJECT_PACKAGES = ("kvserver", "scheduler", "worker", "step_protocol", "kvserver_vllm")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(packages: tuple[str, ...] = PROJECT_PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in it, type-only included), over every
    hand-written module of ``packages`` (generated ``_proto`` code left out). ``from a.b import
    c`` counts as importing ``a.b.c`` when that is a module, else ``a.b``."""
    paths = [
        path
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
        if "_proto" not in path.parts
    ]
    modules = {module_name(path) for path in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        module = module_name(path)
        deps: set[str] = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in modules:
                        deps.add(f"{node.module}.{alias.name}")
                    elif node.module in modules:
                        deps.add(node.module)
        graph[module] = deps - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each import cycle (strongly connected component of more than one
    module), sorted; Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, deps = work[-1]
            dep = next(deps, None)
            if dep is not None:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(sorted(graph.get(dep, ())))))
                elif dep in on_stack:
                    low[node] = min(low[node], index[dep])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_the_project_modules_import_each_other_without_cycles() -> None:
    """No import cycle between the modules of kvserver, scheduler, worker, step_protocol and
    kvserver_vllm (the client's pending/sync/transport, the daemon's tiers, the ssd scan/store,
    scheduler metrics/process and worker transfer/transfer_cuda once formed some)."""
    graph = import_graph()
    assert "kvserver.client.transport" in graph["kvserver.client.pending"]  # not vacuous
    assert "worker.transfer" in graph["worker.transfer_cuda"]
    assert cycles(graph) == []


def test_the_cycle_check_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert cycles(graph) == [["a", "b", "c"], ["d", "e"]]


@pytest.mark.parametrize("name", sorted(declared_commands()))
def test_each_declared_command_registers_its_subcommand(name: str) -> None:
    """pyproject's entry point ``name`` loads to a function that adds ``kvserver name``."""
    value = declared_commands()[name]
    add = EntryPoint(name, value, kvserver.cli.COMMANDS_GROUP).load()
    parser = __import__("argparse").ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add(sub)
    assert list(sub.choices) == [name]
    assert name in kvserver.cli.PROVIDED_ELSEWHERE


@pytest.mark.parametrize("name", sorted(kvserver.cli.PROVIDED_ELSEWHERE))
def test_kvserver_finds_the_subcommands_of_the_packages_above(name: str) -> None:
    """With the entry points installed, ``kvserver NAME --help`` is the real subcommand."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", name, "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"usage: kvserver {name} [-h]" in proc.stdout
    assert "not installed" not in proc.stdout


@pytest.mark.parametrize("name", sorted(kvserver.cli.PROVIDED_ELSEWHERE))
def test_a_subcommand_not_installed_says_how_to_get_it(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the entry points (a tree on PYTHONPATH only, an old install) ``kvserver NAME``
    with any arguments exits 2 saying how to install it or run it from the source tree, and
    the command it suggests works."""
    monkeypatch.setattr(kvserver.cli, "entry_points", lambda group: [])
    assert kvserver.cli.main([name, "--some-flag", "1"]) == 2
    message = capsys.readouterr().err
    package, module, _, extra = kvserver.cli.PROVIDED_ELSEWHERE[name]
    assert f"comes from the '{package}' package" in message
    assert f"pip install -e '.{extra}'" in message
    assert f"'python3 -m {module} ARGS...'" in message
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert f"usage: kvserver {name} [-h]" in proc.stdout
