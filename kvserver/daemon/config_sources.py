"""Where a daemon setting's value comes from: the TOML config file, the ``KVSERVER_*``
environment, and the names each may use.

Used by ``kvserver.daemon.config`` (``DaemonConfig.load`` / ``from_mapping``: defaults < config
file < environment < flags, this module reading the first two and checking their names) and by
``kvserver start`` (:func:`unknown_env`, its warnings). Pure functions and constants, no state;
the setting names are passed in (``DaemonConfig.settings()``): this module never imports
``kvserver.daemon.config`` (that one imports it). Each error is ``InvalidArgument`` naming the
file or the key and, for a near miss, the setting meant.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Collection, Mapping
from typing import Any

from kvserver.errors import InvalidArgument
from kvserver.files import TooLarge, read_limited

#: the largest config file read (a real one is a few KiB; ``--config /dev/zero`` read for ever).
MAX_CONFIG_BYTES = 1 << 20

#: KVSERVER_* variables that are not daemon settings: read by the CLI, the scheduler, the
#: tests, the benchmarks or deploy/run-local.sh (which passes its environment on to the daemon
#: it starts).
ENV_ELSEWHERE = frozenset(
    f"KVSERVER_{name}"
    for name in (
        "SERVER", "REQUIRE_VLLM", "VLLM_ENGINE_PYTHON", "LOCAL_DIR", "CMD",
        "GRPC", "ZMQ", "PUB", "METRICS", "ENGINE_AUTH_TOKEN", "ENGINE_AUTH_TOKEN_FILE",
        "TAIL_PROBE", "TAIL_PROBE_DEBUG", "TEST_PAUSE_AT",
    )
)  # fmt: skip


def read_config_file(path: str, booleans: Collection[str] = ()) -> dict[str, Any]:
    """The settings of the TOML file at ``path``, as written (not yet coerced). Raises
    InvalidArgument naming the file: unreadable, over :data:`MAX_CONFIG_BYTES`, not UTF-8,
    not TOML (a Python or shell boolean, ``True``, ``yes``, is said to be TOML's ``true``).
    The settings ``booleans`` must be TOML booleans: ``"true"``, ``1`` or ``"yes"`` is refused
    naming the setting (the file is TOML, typed; the environment's text takes 1/0, yes/no,
    on/off, config_parse.parse_bool)."""
    try:
        text = read_limited(path, MAX_CONFIG_BYTES).decode()
        values = tomllib.loads(text)
    except TooLarge:
        raise InvalidArgument(
            f"cannot read config file {path}: larger than {MAX_CONFIG_BYTES} "
            "bytes (a config file is a few KiB of TOML)"
        ) from None
    except OSError as exc:  # the reason alone (was "[Errno 2] No such file ...: 'PATH'" too)
        raise InvalidArgument(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"cannot read config file {path}: {exc}{_hint(text, exc)}") from None
    except UnicodeDecodeError as exc:
        raise InvalidArgument(
            f"cannot read config file {path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    for name in booleans:
        if name in values and not isinstance(values[name], bool):
            raise InvalidArgument(
                f"config {name} must be true or false, unquoted (a TOML boolean), got "
                f"{values[name]!r} in {path}"
            )
    return values


def _hint(text: str, exc: tomllib.TOMLDecodeError) -> str:
    """What TOML wants where ``exc`` found an invalid value that is another language's
    boolean (``True``, ``FALSE``, ``yes``, ``off``), else ""."""
    at = re.fullmatch(r"Invalid value \(at line (\d+), column (\d+)\)", str(exc))
    lines = text.splitlines()
    if at is None or int(at[1]) > len(lines):
        return ""
    word = re.match(r"[A-Za-z]+", lines[int(at[1]) - 1][int(at[2]) - 1 :])
    if word is None or word[0].lower() not in ("true", "false", "yes", "no", "on", "off"):
        return ""
    meant = "true" if word[0].lower() in ("true", "yes", "on") else "false"
    return f": TOML's booleans are true and false, unquoted: {meant}, not {word[0]}"


def env_settings(env: Mapping[str, str], settings: Collection[str]) -> dict[str, str]:
    """The ``KVSERVER_<SETTING>`` variables of ``env`` that name one of ``settings``, by
    setting name (their text, not yet coerced)."""
    values = {}
    for name in settings:
        raw = env.get(f"KVSERVER_{name.upper()}")
        if raw is not None:
            values[name] = raw
    return values


def check_keys(values: Mapping[str, Any], settings: Collection[str]) -> None:
    """Raise InvalidArgument naming every key of ``values`` that is none of ``settings`` (the
    closest setting when there is one)."""
    unknown = set(values) - set(settings)
    if unknown:
        hints = []
        for key in sorted(unknown):
            close = difflib.get_close_matches(key, settings, n=1, cutoff=0.75)
            hints.append(f"{key} (did you mean {close[0]}?)" if close else key)
        raise InvalidArgument(
            f"unknown config keys: {', '.join(hints)}; the keys are the long flag names "
            "with '_' for '-' (kvserver start --help)"
        )


def unknown_env(env: Mapping[str, str], settings: Collection[str]) -> list[str]:
    """A warning for each ``KVSERVER_*`` variable in ``env`` that names none of ``settings``
    (a typo would otherwise be ignored silently) nor is read elsewhere
    (:data:`ENV_ELSEWHERE`), with the closest setting when there is one."""
    names = [s.upper() for s in settings]
    out = []
    for name in sorted(env):
        setting = name.removeprefix("KVSERVER_")
        if setting != name and setting not in names and name not in ENV_ELSEWHERE:
            close = difflib.get_close_matches(setting, names, n=1, cutoff=0.75)
            hint = f" (did you mean KVSERVER_{close[0]}?)" if close else ""
            out.append(f"ignoring unknown environment variable {name}{hint}")
    return out
