"""The docs stand alone and their examples are true.

A fresh clone has nothing beside it, so no doc, docstring or test may cite a file outside
the repository (the design file, the seed documents, ``../shared``); the grpcurl examples of
docs/grpc.md chain (the namespace id RegisterNamespace returns is the one Lookup and Pin use,
and the Pin key is the chunk key of the Lookup's tokens), checked against a real daemon.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvserver.grpc_client import GrpcClient
from kvserver.hashing import BlockHasher
from kvserver.namespace import NamespaceSpec
from tests.support.daemon import start_daemon

ROOT = Path(__file__).resolve().parent.parent
#: citations of documents that are not in the repository
OUTSIDE = re.compile(r"\.\./shared|shared/(?:vectors|DESIGN)|DESIGN\.md|[Ss]eed 00\d")


def test_nothing_cites_a_document_outside_the_repository() -> None:
    files = subprocess.run(
        ["git", "ls-files", "*.md", "*.py", "*.sh", "*.yml", "*.toml", "deploy/*", ".ci/*"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert "docs/architecture.md" in files
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    hits = [
        f"{name}:{n}: {line.strip()}"
        for name in files
        if name != me and (ROOT / name).is_file()
        for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert hits == []


def grpcurl_bodies(method: str) -> list[dict[str, Any]]:
    """The JSON bodies (``-d '...'``) of docs/grpc.md's grpcurl calls of ``method``, read the
    way a shell reads its ``sh`` block."""
    text = (ROOT / "docs" / "grpc.md").read_text()
    block = text.split("## grpcurl", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    words = shlex.split(block, comments=True)
    starts = [i for i, w in enumerate(words) if w == "grpcurl"] + [len(words)]
    bodies = []
    for a, b in itertools.pairwise(starts):
        call = words[a:b]
        if call[-1].endswith(method) and "-d" in call:
            bodies.append(json.loads(call[call.index("-d") + 1]))
    return bodies


@pytest.mark.multiprocess
def test_the_grpcurl_examples_chain(tmp_path: Path) -> None:
    (register,) = grpcurl_bodies("/RegisterNamespace")
    (lookup,) = grpcurl_bodies("/Lookup")
    (pin,) = grpcurl_bodies("/Pin")
    spec = NamespaceSpec.from_dict(register["spec"])
    assert lookup["namespace_id"] == pin["namespace_id"] == spec.ns_id
    tokens = lookup["tokens"]["token_ids"]
    hasher = BlockHasher(spec.hash_algo, spec.block_size, spec.hash_seed)
    keys = hasher.chunk_keys(hasher.hash_blocks(tokens), spec.chunk_blocks)
    assert pin["keys"]["keys"] == [base64.b64encode(k).decode() for k in keys]
    assert f"namespace {spec.ns_id}  model {spec.model}" in (ROOT / "docs" / "grpc.md").read_text()
    d = start_daemon(tmp_path)
    try:
        with GrpcClient(d.grpc_address) as client:
            assert client.register_namespace(spec).namespace_id == spec.ns_id
    finally:
        assert d.terminate() == 0, d.log()
