"""The docs stand alone and their examples are true.

Every flag the operator's documents give a ``kvserver`` subcommand exists, every
``KVSERVER_*`` variable they name is one a process reads, and the defaults ``kvserver start``
states are its config's.

A fresh clone has nothing beside it, so no doc, docstring or test may cite a file outside
the repository (the design file, the seed documents, ``../shared``); the grpcurl examples of
docs/grpc.md chain (the namespace id RegisterNamespace returns is the one Lookup and Pin use,
and the Pin key is the chunk key of the Lookup's tokens), checked against a real daemon.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import io
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


#: the operator's documents: README.md and docs/ (the benchmark log quotes past command lines)
OPERATOR_DOCS = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md"),
]
#: ``kvserver SUBCOMMAND ...`` as the documents write it, up to the end of its code span or line
DOC_COMMAND = re.compile(
    r"kvserver (start|status|lookup|hash|keys|scheduler|worker|bench)\b([^`\n|]*)"
)


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every ``kvserver`` subcommand's real parser, the entry-point ones added by their own
    ``add`` functions (so that a checkout without installed entry points checks them too)."""
    from benchmarks.bench_daemon import add_bench
    from kvserver.cli import build_parser
    from scheduler.cli import add_scheduler
    from worker.cli import add_worker

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = dict(sub.choices)
    for add in (add_scheduler, add_worker, add_bench):
        scratch = argparse.ArgumentParser().add_subparsers()
        add(scratch)
        parsers.update(scratch.choices)
    return parsers


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """``parser``'s options and those of its own subcommands (``kvserver keys tls --host``)."""
    out: set[str] = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                out |= option_strings(child)
    return out


def test_every_flag_the_documents_give_a_kvserver_command_exists() -> None:
    """Each ``--flag`` written after ``kvserver SUBCOMMAND`` in README.md and docs/ (code
    blocks with their ``\\`` continuations, inline spans and tables) is one that subcommand's
    parser takes: a renamed or removed flag fails here, not in an operator's terminal."""
    options = {name: option_strings(p) for name, p in subcommand_parsers().items()}
    seen = 0
    wrong = []
    for doc in OPERATOR_DOCS:
        text = doc.read_text().replace("\\\n", " ")
        for m in DOC_COMMAND.finditer(text):
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", m.group(2)):
                seen += 1
                if flag not in options[m.group(1)]:
                    line = text[: m.start()].count("\n") + 1
                    wrong.append(f"{doc.relative_to(ROOT)}:{line}: kvserver {m.group(1)} {flag}")
    assert seen > 50  # the pattern still finds the documents' commands
    assert wrong == []


def shell_blocks(text: str) -> list[str]:
    """The bodies of ``text``'s fenced code blocks that a shell would run (``bash``, ``sh``,
    ``shell``, ``console`` or no language), ``\\`` continuations joined."""
    bodies: list[str] = []
    lang: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        fence = line.strip()
        if not fence.startswith("```"):
            if lang is not None:
                lines.append(line)
        elif lang is None:
            lang, lines = fence[3:].strip(), []
        else:
            if lang in ("bash", "sh", "shell", "console", ""):
                bodies.append("\n".join(lines).replace("\\\n", " "))
            lang = None
    return bodies


#: what ends a command on a shell line
SHELL_OPERATORS = {"&", "&&", "|", "||", ";"}


def test_every_kvserver_command_of_the_documents_code_blocks_parses() -> None:
    """Each whole ``kvserver SUBCOMMAND ...`` line of README.md's and docs/' shell blocks is
    accepted by that subcommand's real parser: required flags present, values of the right
    type and choice, positionals where they go (the flag check above sees only flag names).
    ``$(seq ...)`` stands for token ids; synopses with ``...`` or ``[`` are not commands."""
    parsers = subcommand_parsers()
    parsed, wrong = 0, []
    for doc in OPERATOR_DOCS:
        for body in shell_blocks(doc.read_text()):
            for line in body.splitlines():
                error = command_error(parsers, line)
                if error is not None:
                    parsed += 1
                    if error:
                        wrong.append(f"{doc.relative_to(ROOT)}: {error}")
    assert wrong == []
    assert parsed > 15  # the blocks are still found


def command_error(parsers: dict[str, argparse.ArgumentParser], line: str) -> str | None:
    """None when ``line`` holds no whole ``kvserver SUBCOMMAND ...`` command (none, a comment,
    a synopsis with ``...`` or ``[``); else "" when that subcommand's real parser accepts it,
    or the command and the parser's error. ``$(seq ...)`` stands for token ids; the command
    ends at a shell operator, a redirection or a ``#`` comment."""
    command = re.compile(rf"(?:^|[\s;&|(])kvserver ({'|'.join(parsers)})\b(.*)")
    m = command.search(line.split(" #", 1)[0])
    if m is None or line.lstrip().startswith("#"):
        return None
    rest = re.sub(r"\$\(seq [^)]*\)", "0 1 2", m.group(2))
    if "..." in rest or "[" in rest:
        return None
    words = list(itertools.takewhile(lambda w: w not in SHELL_OPERATORS and
                                     not w.startswith((">", "2>")),
                                     shlex.split(rest)))  # fmt: skip
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            parsers[m.group(1)].parse_args(words)
    except SystemExit:
        return f"kvserver {m.group(1)} {rest}: {said.getvalue().strip().splitlines()[-1]}"
    return ""


def test_every_example_of_a_subcommands_help_parses() -> None:
    """The ``examples:`` of ``kvserver SUBCOMMAND --help`` (and of its own subcommands:
    ``kvserver keys``) are accepted by the real parsers: an example is the first command a
    new user copies."""

    def examples(parser: argparse.ArgumentParser) -> list[str]:
        out = (parser.epilog or "").split("examples:\n", 1)[1:]
        lines = out[0].split("\n\n", 1)[0].splitlines() if out else []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    lines += examples(child)
        return lines

    parsers = subcommand_parsers()
    found = [line for p in parsers.values() for line in examples(p)]
    errors = [command_error(parsers, line) for line in found]
    assert None not in errors, found  # each example is a whole kvserver command
    assert [e for e in errors if e] == []
    assert len(found) >= 10  # start, hash, lookup, keys at least


def test_every_argument_of_every_subcommand_says_what_it_is_in_help() -> None:
    """``kvserver SUBCOMMAND --help`` explains each option and positional (was: 13 bare,
    e.g. ``kvserver keys token DIRECTORY``, ``kvserver worker --rank``)."""

    def bare(name: str, parser: argparse.ArgumentParser) -> list[str]:
        out = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child, sub in action.choices.items():
                    out += bare(f"{name} {child}", sub)
            elif not action.help and action.dest != "help":
                out.append(f"kvserver {name} {'/'.join(action.option_strings) or action.dest}")
        return out

    assert [b for name, p in subcommand_parsers().items() for b in bare(name, p)] == []


def test_every_kvserver_variable_the_documents_name_is_read() -> None:
    """Each ``KVSERVER_*`` environment variable of README.md and docs/ is a daemon setting or
    one that ``kvserver start`` knows another process reads (so it does not warn about it)."""
    from kvserver.daemon.config import DaemonConfig
    from kvserver.daemon.config_sources import unknown_env

    named = {
        var
        for doc in OPERATOR_DOCS
        for var in re.findall(r"\bKVSERVER_[A-Z0-9_]*[A-Z0-9]", doc.read_text())
    }
    assert {"KVSERVER_METRICS_PORT", "KVSERVER_AUTH_TOKEN_FILE"} <= named
    assert unknown_env(dict.fromkeys(named, ""), DaemonConfig.settings()) == []


def test_the_defaults_start_help_states_are_the_configs() -> None:
    """``kvserver start --help``'s "(default X)" for a number, a size or a word is
    DaemonConfig's default; the README's "Two commands" defaults too."""
    from kvserver.daemon.config import DaemonConfig
    from kvserver.daemon.config_parse import parse_size
    from kvserver.policies import policy_names

    policies = set(policy_names())
    defaults = {f.name: f.default for f in dataclasses.fields(DaemonConfig)}
    checked = 0
    for action in subcommand_parsers()["start"]._actions:
        m = re.search(r"\(default:? ([\w./]+)[;,)]", action.help or "")
        if m is None or action.dest not in defaults:
            continue
        stated, default = m.group(1), defaults[action.dest]
        if isinstance(default, bool):
            assert stated == ("on" if default else "off"), action.dest
        elif isinstance(default, int | float) and re.fullmatch(r"[\d.]+[KMGT]iB", stated):
            assert parse_size(stated) == default, action.dest
        elif isinstance(default, int | float) and re.fullmatch(r"[\d.]+", stated):
            assert float(stated) == default, action.dest
        elif isinstance(default, str) and (re.search(r"[/.]", stated) or stated in policies):
            assert stated == default, action.dest
        else:
            continue
        checked += 1
    assert checked > 15
    config = DaemonConfig()
    intro = (ROOT / "README.md").read_text().split("## Two commands", 1)[1].split("```", 1)[0]
    assert (
        f"gRPC :{config.grpc_port}, ZMQ data :{config.zmq_port}, "
        f"KV events :{config.pub_port}," in " ".join(intro.split())
    )
    assert f"{config.dram >> 20} MiB of DRAM, the `{config.policy}` eviction policy" in (
        " ".join(intro.split())
    )


def test_the_plug_in_options_table_lists_every_key_the_connector_takes() -> None:
    """docs/vllm.md's ``kv_connector_extra_config`` table names exactly the keys the plug-in
    accepts (was: ``host_kernels`` missing)."""
    from kvserver_vllm.config import _KEYS

    text = (ROOT / "docs" / "vllm.md").read_text()
    table = text.split("### `kv_connector_extra_config`", 1)[1].split("\n\n", 2)[1]
    documented = set(re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE))
    assert documented == set(_KEYS)


def test_every_kv_transfer_config_of_the_documents_is_one_the_plug_in_takes() -> None:
    """The ``--kv-transfer-config '{...}'`` of each ``vllm serve`` in README.md and docs/ (the
    line an inference engineer copies first) is JSON naming the connector where vLLM finds
    it, a role vLLM knows, and only keys the plug-in accepts (a renamed key fails here, not
    at a vLLM start-up)."""
    from kvserver_vllm.config import _KEYS

    configs = []
    for doc in OPERATOR_DOCS:
        for body in shell_blocks(doc.read_text()):
            for quoted in re.findall(r"--kv-transfer-config\s+('[^']*')", body):
                configs.append((doc.name, json.loads(shlex.split(quoted)[0])))
    assert len(configs) >= 2  # docs/vllm.md's two commands at least
    for name, config in configs:
        assert config["kv_connector"] == "KVServerConnector", name
        assert config["kv_connector_module_path"] == "kvserver_vllm.connector", name
        assert config["kv_role"] in ("kv_both", "kv_producer", "kv_consumer"), name
        assert set(config.get("kv_connector_extra_config", {})) <= _KEYS, name
