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


def test_benchmarks_do_not_import_the_tests() -> None:
    assert imports_of("benchmarks", {"tests"}) == []


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


def import_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (anywhere in it, type-only included)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / package.replace(".", "/")).glob("*.py")):
        module = f"{package}.{path.stem}"
        graph[module] = {
            m for _, m in imported_modules(path) if m.startswith(package + ".") and m != module
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle (as a path back to its start) found by depth-first search."""
    found: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(graph.get(module, ())):
            if dep == path[0]:
                found.append([*path, dep])
            elif dep not in path and dep > path[0]:  # each cycle once, from its least module
                visit(dep, [*path, dep])

    for module in sorted(graph):
        visit(module, [module])
    return found


def test_the_client_modules_import_each_other_without_cycles() -> None:
    """kvserver/client: pending, sync and transport (and the rest) form no import cycle."""
    graph = import_graph("kvserver.client")
    assert "kvserver.client.transport" in graph["kvserver.client.pending"]  # not vacuous
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


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
