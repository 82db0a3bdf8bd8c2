"""The datastore settings of the daemons and tabbyctl, from flags > environment > conflist.

tabby-node, tabbyctl and tabby-kube-controllers find the datastore with
:func:`resolve_datastore` (docs/cluster.md "Datastore settings"): a flag wins over the environment,
which wins over a conflist's ``ipam`` section, which wins over the defaults. A CNI call never
does this: it uses the datastore its own conflist names (:func:`datastore_of`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, ValidationError

from cni_config.common import DatastoreSettings, config_error, parse
from cni_protocol.errors import CniError, Code

if TYPE_CHECKING:
    from bundle.types import JSON

M = TypeVar("M", bound=BaseModel)

#: setting -> (tabbyctl / tabby-node flag, environment variable). The conflist field is the
#: setting's own name (docs/cluster.md "Datastore settings").
SOURCES: dict[str, tuple[str, str]] = {
    "datastore_type": ("--datastore-type", "TABBY_DATASTORE_TYPE"),
    "etcd_endpoints": ("--etcd-endpoints", "TABBY_ETCD_ENDPOINTS"),
    "etcd_prefix": ("--etcd-prefix", "TABBY_ETCD_PREFIX"),
    "etcd_ca_cert_file": ("--etcd-ca-cert-file", "TABBY_ETCD_CA_CERT_FILE"),
    "etcd_cert_file": ("--etcd-cert-file", "TABBY_ETCD_CERT_FILE"),
    "etcd_key_file": ("--etcd-key-file", "TABBY_ETCD_KEY_FILE"),
    "etcd_watch_transport": ("--etcd-watch-transport", "TABBY_ETCD_WATCH_TRANSPORT"),
    "etcd_watch_endpoints": ("--etcd-watch-endpoints", "TABBY_ETCD_WATCH_ENDPOINTS"),
    "data_dir": ("--data-dir", "TABBY_DATA_DIR"),
    "kubeconfig": ("--kubeconfig", "KUBECONFIG"),
}


def resolve_datastore(
    section: JSON | None,
    flags: Mapping[str, str | None] | None = None,
    env: Mapping[str, str] | None = None,
) -> DatastoreSettings:
    """The datastore settings of tabbyctl and tabby-node: a flag wins over the environment,
    which wins over the conflist's ``ipam`` section (``section``), which wins over defaults.

    ``flags`` is keyed by setting name (None = not given). A bad value is a CniError naming
    where it came from (``--etcd-prefix``, ``TABBY_ETCD_PREFIX`` or ``ipam.etcd_prefix``).
    The CNI binaries never call this: a CNI call uses the datastore its own conflist names.
    """
    merged: dict[str, object] = {
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
        raise _named(e, origin) from None


def datastore_of(config: JSON) -> DatastoreSettings:
    """The datastore a CNI configuration names (its ``ipam`` section), validated."""
    section = config.get("ipam")
    if section is not None and not isinstance(section, Mapping):
        raise CniError(Code.INVALID_CONFIG, "ipam must be an object", repr(section)[:200])
    return parse(DatastoreSettings, section or {}, prefix="ipam.")


def tabby_ipam_section(path: str | None) -> JSON | None:
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


# -- a daemon's command line -------------------------------------------------------------------


def add_datastore_flags(parser: argparse.ArgumentParser) -> None:
    """The datastore flags of the table above, as a group of a daemon's parser."""
    group = parser.add_argument_group("datastore (flag > environment > --conf > default)")
    for name, (flag, var) in SOURCES.items():
        group.add_argument(flag, dest=f"ds_{name}", default=None, help=f"[env {var}]")


def daemon_options(
    model: type[M],
    ns: argparse.Namespace,
    env: Mapping[str, str],
    env_names: Mapping[str, str],
    numbers: Mapping[str, Callable[[str], object]] = {},
    empty_is_unset: tuple[str, ...] = (),
) -> M:
    """A daemon's options model from its flags (``ns``, one per field, None when not given),
    else the environment variable ``env_names`` names, else the model's default. A bad value
    is a CniError naming where it came from (``--node-ttl`` or ``TABBY_NODE_TTL``)."""
    given: dict[str, object] = {}
    origin: dict[str, str] = {}
    for name in model.model_fields:
        value = getattr(ns, name, None)
        where = "--" + name.replace("_", "-")
        var = env_names.get(name)
        if value is None and var and env.get(var):
            value, where = env[var], var
        if value is None:
            continue
        if name in numbers and isinstance(value, str):
            try:
                value = numbers[name](value)
            except ValueError:
                pass  # the model names it
        if name in empty_is_unset and value == "":
            value = None
        given[name], origin[name] = value, where
    try:
        return model.model_validate(given)
    except ValidationError as e:
        raise _named(e, origin) from None


def daemon_datastore(
    ns: argparse.Namespace, env: Mapping[str, str], conf: str | None
) -> DatastoreSettings:
    """The datastore of a daemon: its datastore flags > environment > ``--conf`` > defaults."""
    flags = {name: getattr(ns, f"ds_{name}", None) for name in SOURCES}
    return resolve_datastore(tabby_ipam_section(conf), flags, env)


def _named(e: ValidationError, origin: Mapping[str, str]) -> CniError:
    """The error of the first problem, naming where the setting came from (a flag, a
    variable or a conflist field); a rule over several settings (no one field: its location
    is the whole model) names the settings as given."""
    err = config_error(e)
    errors = e.errors(include_url=False)
    loc = errors[0]["loc"] if errors else ()
    if not loc:
        given = ", ".join(sorted(set(origin.values()))) or "the defaults"
        return CniError(err.code, f"invalid settings: {err.details}", f"given: {given}")
    field = str(loc[0])
    where = origin.get(field, field)
    # the path in the message starts with the field ("'etcd_endpoints[0]'")
    return CniError(err.code, err.msg.replace(f"'{field}", f"'{where}", 1), err.details)
