"""A daemon setting's text as a typed value: sizes (``"8GiB"``), booleans, numbers, the
``[[tenants]]`` tables, and the settings a ``keys_dir`` fills in.

Used by ``kvserver.daemon.config`` (``DaemonConfig.from_mapping`` coerces every value of the
config file, the environment and the flags here before the dataclass checks them) and by the
benchmarks' size arguments (``parse_size``). Pure functions, no state; each raises
``InvalidArgument`` naming the setting and what it accepts. This module never imports
``kvserver.daemon.config`` (that one imports it).
"""

from __future__ import annotations

import dataclasses
import math
import re
import socket
from typing import Any

from kvserver.daemon.tenants import parse_tenants
from kvserver.errors import InvalidArgument
from kvserver.keyset import ensure_key_set

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_size(text: str | int) -> int:
    """``"256MiB"`` → 268435456. Accepts plain integers, SI (MB) and IEC (MiB) units."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise InvalidArgument(f"bad size {text!r}; examples: 256MiB, 8GiB, 1073741824")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise InvalidArgument(f"size must be positive: {text!r}")
    return value


#: what ``keys_dir`` fills in (and so excludes)
_KEYS_DIR_FIELDS = ("curve_secret_key_file", "curve_clients_dir", "tls_cert_file",
                    "tls_key_file", "auth_token_file", "auth_token", "no_auth")  # fmt: skip


def fill_from_keys_dir(kwargs: dict[str, Any], default_host: str) -> None:
    """Make the key set of ``kwargs["keys_dir"]`` and set the fields it fills in
    (``default_host``: the ``host`` setting's default, for the certificate's names)."""
    given = [name for name in _KEYS_DIR_FIELDS if kwargs.get(name)]
    if given:
        raise InvalidArgument(f"keys_dir excludes {', '.join(given)}")
    hosts = [socket.gethostname(), "localhost", "127.0.0.1", "::1"]
    host = str(kwargs.get("host", default_host))
    advertised = str(kwargs.get("advertise_addr") or "")
    hosts += [h for h in (host, advertised) if h and h not in ("0.0.0.0", "::")]
    keys = ensure_key_set(str(kwargs["keys_dir"]), hosts)
    kwargs.update((name, getattr(keys, name)) for name in _KEYS_DIR_FIELDS if hasattr(keys, name))


def coerce(name: str, f: dataclasses.Field[Any], value: Any) -> Any:
    """The typed value of setting ``name`` (field ``f``) from ``value`` as given (a string
    of the environment or a flag, or a TOML value); raises InvalidArgument naming it."""
    if name == "tenants":
        return parse_tenants(value)
    if name in (
        "dram",
        "page_size",
        "max_message_bytes",
        "ssd",
        "ssd_staging",
        "local_inflight_bytes",
        "peer_stream_window",
        "zmq_send_max_unsent",
    ):
        try:
            return parse_size(value)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{name}: {exc.message}") from None
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    if kind == "bool":
        return parse_bool(name, value)
    try:
        if isinstance(value, bool):  # TOML's true is not 1
            raise TypeError(value)
        if kind == "int":
            if isinstance(value, float):  # TOML's 9470.5 is not 9470
                raise TypeError(value)
            return int(value)
        if kind == "float":
            number = float(value)
            if not math.isfinite(number):
                raise ValueError(value)
            return number
    except (TypeError, ValueError):
        what = "a whole number" if kind == "int" else "a number"  # was "a number", got 1.5
        shown = str(value).lower() if isinstance(value, bool) else repr(value)  # TOML's spelling
        raise InvalidArgument(f"config {name} must be {what}, got {shown}") from None
    if not isinstance(value, str):  # a TOML list, table or number where text goes
        raise InvalidArgument(f"config {name} must be a string (quoted in TOML), got {value!r}")
    return value


_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}  # fmt: skip


def parse_bool(name: str, value: Any) -> bool:
    """``value`` as a boolean: a bool, or 1/0, true/false, yes/no, on/off (any case)."""
    if isinstance(value, bool):
        return value
    parsed = _BOOLS.get(str(value).strip().lower())
    if parsed is None:
        raise InvalidArgument(f"config {name} must be true or false (1/0, yes/no), got {value!r}")
    return parsed
