"""Config helpers both binaries share: typed field access with spec error codes, node name.

Unknown fields are ignored (GEN-11); a known field whose value cannot be honoured fails
with code 2 naming field and value; a structurally invalid config fails with code 7.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

from .errors import CniError, Code

DEFAULT_NODENAME_FILE = "/var/lib/tabby/nodename"


def unsupported(field: str, value: object, why: str) -> CniError:
    return CniError(
        Code.UNSUPPORTED_FIELD, f"unsupported value for field {field!r}: {value!r}", why
    )


def get_bool(conf: Mapping[str, Any], field: str, default: bool, *, prefix: str = "") -> bool:
    """A boolean; Calico's strings "true"/"false" are accepted too."""
    value = conf.get(field, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise unsupported(prefix + field, value, "expected true or false")


def get_int(
    conf: Mapping[str, Any], field: str, default: int, *, lo: int, hi: int, prefix: str = ""
) -> int:
    value = conf.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise unsupported(prefix + field, value, f"expected an integer from {lo} to {hi}")
    return value


def get_str(conf: Mapping[str, Any], field: str, default: str, *, prefix: str = "") -> str:
    value = conf.get(field, default)
    if not isinstance(value, str):
        raise unsupported(prefix + field, value, "expected a string")
    return value


def get_str_list(
    conf: Mapping[str, Any], field: str, *, prefix: str = "", comma_string: bool = False
) -> list[str]:
    value = conf.get(field)
    if value is None:
        return []
    if comma_string and isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise unsupported(prefix + field, value, "expected a list of strings")
    return list(value)


def get_section(conf: Mapping[str, Any], field: str) -> dict[str, Any]:
    value = conf.get(field)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CniError(Code.INVALID_CONFIG, f"{field} must be an object", f"{field}: {value!r}")
    return value


def node_name(conf: Mapping[str, Any]) -> str:
    """``nodename`` > contents of ``nodename_file`` > hostname (PRODUCT.md)."""
    name = conf.get("nodename")
    if isinstance(name, str) and name.strip():
        return name.strip()
    path = get_str(conf, "nodename_file", DEFAULT_NODENAME_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
        if text:
            return text
    except OSError:
        pass
    return socket.gethostname()


def runtime_value(conf: Mapping[str, Any], capability: str) -> Any:
    """A capability's value from runtimeConfig, only if declared (CAP-3, ADD-10).

    Keys are matched case-insensitively (containerd capitalises Go-style). Runtimes at 1.0+
    strip ``capabilities`` before calling; then whatever runtimeConfig holds was declared.
    """
    rc = conf.get("runtimeConfig")
    if not isinstance(rc, dict):
        return None
    caps = conf.get("capabilities")
    if isinstance(caps, dict) and not any(
        k.lower() == capability.lower() and v for k, v in caps.items()
    ):
        return None
    for k, v in rc.items():
        if k.lower() == capability.lower():
            return v
    return None


def valid_attachments(config: dict[str, Any]) -> set[tuple[str, str]] | None:
    """GC-2/GC-4: the valid (containerID, ifname) set, or None when the key is absent.

    Absent means "no information": delete nothing. Only an explicit empty list means
    everything of this network is stale. ``valid-attachments`` first, the 1.1.0 tag's
    ``attachments`` as the fallback (libcni sends both).
    """
    for key in ("cni.dev/valid-attachments", "cni.dev/attachments"):
        if key in config:
            raw = config[key]
            if raw is None:
                raw = []
            if not isinstance(raw, list):
                raise CniError(Code.INVALID_CONFIG, f"{key} must be a list", repr(raw)[:200])
            out = set()
            for a in raw:
                if not isinstance(a, dict):
                    raise CniError(
                        Code.INVALID_CONFIG, f"{key} entries must be objects", repr(a)[:200]
                    )
                out.add((str(a.get("containerID", "")), str(a.get("ifname", ""))))
            return out
    return None
