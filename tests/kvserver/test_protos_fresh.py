"""kvserver/_proto is exactly what scripts/gen_protos.py makes from protos/ (run it after editing
a .proto), and the generated package imports as ``kvserver._proto.kvserver.v1``."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "kvserver" / "_proto"


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def generated_with(root: Path) -> str:
    text = (root / "kvserver" / "v1" / "kvserver_pb2_grpc.py").read_text()
    match = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", text)
    assert match, "no GRPC_GENERATED_VERSION in the generated code"
    return match.group(1)


def descriptor_blob(root: Path) -> bytes:
    text = (root / "kvserver" / "v1" / "kvserver_pb2.py").read_text()
    match = re.search(r"AddSerializedFile\((b'.*?')\)\n", text, re.S)
    assert match, "no serialized descriptor in the generated code"
    blob = ast.literal_eval(match.group(1))
    assert isinstance(blob, bytes)
    return blob


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    """Byte for byte with the grpcio-tools version that generated the committed code; with
    another version, the serialized descriptors (the contract itself) must still agree."""
    pytest.importorskip("grpc_tools")
    gen = load_generator()
    out = tmp_path / "_proto"
    gen.generate(out)
    fresh, committed = tree(out), tree(COMMITTED)
    hint = "run: python scripts/gen_protos.py"
    assert sorted(fresh) == sorted(committed), hint
    assert descriptor_blob(out) == descriptor_blob(COMMITTED), f"protos/ changed; {hint}"
    if generated_with(out) != generated_with(COMMITTED):
        pytest.skip(
            f"byte comparison needs grpcio-tools {generated_with(COMMITTED)} "
            f"(installed: {generated_with(out)}); the descriptors agree"
        )
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated files {stale}; {hint}"


def test_generation_is_deterministic(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    gen = load_generator()
    gen.generate(tmp_path / "a")
    gen.generate(tmp_path / "b")
    assert tree(tmp_path / "a") == tree(tmp_path / "b")


def test_generated_package_imports_relatively() -> None:
    from kvserver._proto.kvserver.v1 import kvserver_pb2, kvserver_pb2_grpc

    assert kvserver_pb2.DESCRIPTOR.package == "kvserver.v1"
    assert "KVServer" in kvserver_pb2.DESCRIPTOR.services_by_name
    assert hasattr(kvserver_pb2_grpc, "KVServerStub")
    text = (COMMITTED / "kvserver" / "v1" / "kvserver_pb2_grpc.py").read_text()
    assert "from . import kvserver_pb2" in text
