"""Every numeric daemon setting refuses a bad value with a message naming that setting.

Table-driven over DaemonConfig's numeric fields (a new one fails here until it has a row): the
value goes in as an operator gives it (a flag's or variable's text, ``DaemonConfig.load``), and
the InvalidArgument names the setting and no other setting of the table. Before:
``cluster_ttl_s = -3`` was refused as "cluster batch_linger_s must be in [0, ttl_s)" (a field the
operator cannot set), ``cluster_timeout_s = 0`` as "cluster ttl_s and timeout_s", three SSD and
three peer settings shared one message, ``ssd`` (capacity) was not named, and NaN or infinity
passed for most float settings (``not x > 0`` is False for NaN).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvserver.daemon.config import DaemonConfig
from kvserver.errors import InvalidArgument

#: setting -> bad values (text, as a flag or KVSERVER_* variable gives it)
BAD: dict[str, tuple[str, ...]] = {
    "grpc_port": ("-5", "70000"),
    "zmq_port": ("-1", "65536"),
    "pub_port": ("-2",),
    "metrics_port": ("-2",),
    "peer_stream_port": ("-2",),
    "dram": ("-1", "0"),
    "page_size": ("0",),
    "store_threshold": ("-1",),
    "max_tracker_size": ("0",),
    "default_lease_s": ("-1", "0", "nan", "inf"),
    "max_lease_s": ("-1", "0", "nan", "inf", "86401"),
    "event_capacity": ("0",),
    "max_message_bytes": ("0",),
    "local_inflight_bytes": ("0",),
    "local_max_connections": ("0",),
    "pub_hwm": ("0",),
    "pub_max_subscribers": ("0",),
    "pub_max_subscribers_per_address": ("0",),
    "max_event_watchers": ("0",),
    "grpc_max_connections_per_address": ("0",),
    "zmq_send_timeout_s": ("-1", "301", "nan"),
    "zmq_send_max_unsent": ("-1",),
    "reap_interval_s": ("0", "nan", "inf"),
    "ssd": ("1",),
    "ssd_admission": ("0",),
    "ssd_io_threads": ("0",),
    "ssd_staging": ("0",),
    "ssd_retry_s": ("0", "nan"),
    "ssd_promotions": ("0",),
    "ssd_drain_timeout_s": ("0", "-1", "nan"),
    "cluster_ttl_s": ("-3", "0", "nan", "inf"),
    "cluster_timeout_s": ("0", "-1", "nan"),
    "cluster_resync_spread_s": ("-2", "nan", "inf"),
    "peer_timeout_s": ("0", "inf"),
    "peer_suspect_s": ("-1", "nan"),
    "peer_connections": ("0",),
    "peer_stream_window": ("1", "2GiB"),
}

#: what a setting needs besides itself to be checked at all
CONTEXT = {"ssd": {"ssd_dir": "/nonexistent/kv"}, "cluster": {"cluster": "redis://127.0.0.1:1/0"}}


def numeric_settings() -> set[str]:
    return {f.name for f in dataclasses.fields(DaemonConfig) if f.type in ("int", "float")}


def test_the_table_has_a_row_for_every_numeric_setting() -> None:
    assert set(BAD) == numeric_settings()


@pytest.mark.parametrize(
    ("setting", "bad"), [(name, value) for name, values in BAD.items() for value in values]
)
def test_a_bad_value_is_refused_naming_its_setting_and_no_other(setting: str, bad: str) -> None:
    given = {**CONTEXT.get(setting.split("_")[0], {}), setting: bad}
    with pytest.raises(InvalidArgument) as refused:
        DaemonConfig.load(env={}, overrides=given)
    message = str(refused.value)
    named = {name for name in BAD if re.search(rf"(?<![\w-]){name}(?![\w-])", message)}
    assert named == {setting}, message


@pytest.mark.parametrize(
    "content, match",
    [
        (b"\x8b\x00\xff binary", "not UTF-8 text"),  # was a UnicodeDecodeError traceback
        (b"dram = \n", "Invalid value"),
        (b"no_such_setting = 1\n", "no_such_setting"),
    ],
)
def test_a_config_file_that_is_not_toml_text_is_a_clear_error(
    tmp_path: Path, content: bytes, match: str
) -> None:
    path = tmp_path / "kvserver.toml"
    path.write_bytes(content)
    with pytest.raises(InvalidArgument, match=match):
        DaemonConfig.load(config_file=str(path), env={})


def boolean_settings() -> set[str]:
    return {f.name for f in dataclasses.fields(DaemonConfig) if f.type == "bool"}


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("tune_malloc = True", "cannot read config file {}: Invalid value (at line 1, column 15)"
         ": TOML's booleans are true and false, unquoted: true, not True"),
        ("no_auth = off", "cannot read config file {}: Invalid value (at line 1, column 11): "
         "TOML's booleans are true and false, unquoted: false, not off"),
        ('tune_malloc = "False"', "config tune_malloc must be true or false, unquoted (a TOML "
         "boolean), got 'False' in {}"),
        ('no_auth = "yes"', "config no_auth must be true or false, unquoted (a TOML boolean), "
         "got 'yes' in {}"),
        ("insecure_remote = 1", "config insecure_remote must be true or false, unquoted (a TOML "
         "boolean), got 1 in {}"),
    ],
    ids=["True", "off", "quoted-False", "quoted-yes", "1"],
)  # fmt: skip
def test_a_config_file_boolean_is_toml_true_or_false(tmp_path: Path, line: str, said: str) -> None:
    """The --config file is TOML (kvserver start --help, docs/architecture.md): ``True`` was
    "Invalid value (at line 1, column 15)" with no word of what TOML wants, and a string or a
    number where a boolean goes ("False", "yes", 1) was taken as KVSERVER_* text is (1/0,
    true/false, yes/no, on/off), so ``tune_malloc = "False"`` turned the tuning off while
    ``tune_malloc = False`` was refused. The environment keeps its spellings (test_malloc)."""
    assert {"tune_malloc", "no_auth", "insecure_remote"} == boolean_settings()
    config = tmp_path / "kvserver.toml"
    config.write_text(line + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "start", "--config", str(config),
         "--shm-dir", str(tmp_path / "shm"), "--dram", "0"],  # a file taken: the --dram error
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"kvserver start: error: {said.format(config)}"]
    assert not (tmp_path / "shm").exists()  # nothing was made
