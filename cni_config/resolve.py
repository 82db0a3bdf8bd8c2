"""The datastore settings of the daemons and tabbyctl, from flags > environment > conflist.

tabby-node, tabbyctl and tabby-kube-controllers find the datastore with
:func:`resolve_datastore` (README "Datastore settings"): a flag wins over the environment,
which wins over a conflist's ``ipam`` section, which wins over the defaults. A CNI call never
does this: it uses the datastore its own conflist names (:func:`datastore_of`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from cni_config.common import DatastoreSettings, config_error, parse
from cni_protocol.errors import CniError, Code

#: setting -> (tabbyctl / tabby-node flag, environment variable). The conflist field is the
#: setting's own name (README "Datastore settings").
SOURCES: dict[str, tuple[str, str]] = {
    "datastore_type": ("--datastore-type", "TABBY_DATASTORE_TYPE"),
    "etcd_endpoints": ("--etcd-endpoints", "TABBY_ETCD_ENDPOINTS"),
    "etcd_prefix": ("--etcd-prefix", "TABBY_ETCD_PREFIX"),
    "etcd_ca_cert_file": ("--etcd-ca-cert-file", "TABBY_ETCD_CA_CERT_FILE"),
    "etcd_cert_file": ("--etcd-cert-file", "TABBY_ETCD_CERT_FILE"),
    "etcd_key_file": ("--etcd-key-file", "TABBY_ETCD_KEY_FILE"),
    "data_dir": ("--data-dir", "TABBY_DATA_DIR"),
}


def resolve_datastore(
    section: Mapping[str, Any] | None,
    flags: Mapping[str, str | None] | None = None,
    env: Mapping[str, str] | None = None,
) -> DatastoreSettings:
    """The datastore settings of tabbyctl and tabby-node: a flag wins over the environment,
    which wins over the conflist's ``ipam`` section (``section``), which wins over defaults.

    ``flags`` is keyed by setting name (None = not given). A bad value is a CniError naming
    where it came from (``--etcd-prefix``, ``TABBY_ETCD_PREFIX`` or ``ipam.etcd_prefix``).
    The CNI binaries never call this: a CNI call uses the datastore its own conflist names.
    """
    merged: dict[str, Any] = {
        k: v for k, v in (section or {}).items() if k in DatastoreSettings.model_fields
    }
    origin = {k: f"ipam.{k}" for k in merged}
    for name, (flag, var) in SOURCES.items():
        value = (flags or {}).get(name)
        if value is not None:
            merged[name], origin[name] = value, flag
        elif env is not None and env.get(var):
            merged[name], origin[name] = env[var], var
    try:
        return DatastoreSettings.model_validate(merged)
    except ValidationError as e:
        field = str(e.errors(include_url=False)[0]["loc"][0]) if e.errors() else ""
        err = config_error(e)
        where = origin.get(field)
        if where:
            err = CniError(err.code, err.msg.replace(repr(field), repr(where), 1), err.details)
        raise err from None


def datastore_of(config: Mapping[str, Any]) -> DatastoreSettings:
    """The datastore a CNI configuration names (its ``ipam`` section), validated."""
    section = config.get("ipam")
    if section is not None and not isinstance(section, Mapping):
        raise CniError(Code.INVALID_CONFIG, "ipam must be an object", repr(section)[:200])
    return parse(DatastoreSettings, section or {}, prefix="ipam.")


def tabby_ipam_section(path: str | None) -> dict[str, Any] | None:
    """The ``ipam`` section of the tabby plugin in conflist ``path`` (``--conf`` of the
    daemons); None without a path. A file without a tabby plugin is a CniError (code 7)."""
    if path is None:
        return None
    import json

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise CniError(Code.INVALID_CONFIG, f"cannot read --conf {path}", str(e)) from None
    plugins = doc.get("plugins") if isinstance(doc, dict) else None
    for p in plugins if isinstance(plugins, list) else [doc]:
        if isinstance(p, dict) and p.get("type") == "tabby":
            section = p.get("ipam")
            return section if isinstance(section, dict) else {}
    raise CniError(Code.INVALID_CONFIG, f"--conf {path} has no plugin of type tabby")
