"""Configurations already validated: a standalone call skips pydantic for a configuration
an earlier call (or tabby-node, serving one) has validated.

Validating with the models costs a fresh process ~100 ms of CPU, nearly all of it importing
pydantic and building the models, and a standalone ADD pays it twice (``tabby`` and the
``tabby-ipam`` it execs), every pod, while tabby-node restarts or is absent. A configuration
changes when an operator pushes a conflist, not per pod. So the output of a successful
strict validation (the model's ``model_dump()``) is kept in a file named by a hash of

* which values it is (``cni_plugin.values.PluginValues``, ``ipam.values.IpamPluginValues``),
* the code that validated it (:func:`fingerprint`: the version, and the size, time and inode
  of the files the rules are written in, and of the executable when frozen),
* the configuration, without the keys that change per call and are never validated
  (``prevResult``, ``runtimeConfig``, ``args``: :data:`PER_CALL`),

and a later call with the same hash rebuilds the values from it (``cni_config.values``)
without importing pydantic; the per-call keys come from the call itself. Only a valid
configuration is ever written, so an invalid value always meets the models and is refused
(ADD, CHECK, STATUS) or dropped (DEL, GC) exactly as without this file; a valid one rebuilds
the values the models made of it. A configuration with GC's attachment lists (validated,
per call) is always validated. The directory is ``$TABBY_CONFIG_CACHE`` (``off``: never
used), else :data:`DEFAULT_DIR` (tmpfs: empty after a reboot), mode 0700; any problem with
it (absent, unreadable, a damaged entry) means the models validate, never a failed call.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from cni_config.teardown import Teardown
from cni_config.values import Values, rebuild

V = TypeVar("V", bound=Values)

if TYPE_CHECKING:
    from hashlib import sha256 as _sha256

    from bundle.types import JSON
else:
    try:  # CPython's own SHA-256: hashlib would load OpenSSL first (3-12 ms, measured)
        _sha256 = importlib.import_module("_sha256").sha256
    except ImportError:  # pragma: no cover - another interpreter
        from hashlib import sha256 as _sha256

CACHE_ENV = "TABBY_CONFIG_CACHE"
DEFAULT_DIR = "/run/tabby/config-cache"
#: Keys of the configuration a call fills for itself and no model validates (free-form, or
#: ignored): not in the hash; the rebuilt values take them from the call (key -> field).
PER_CALL = {"prevResult": None, "runtimeConfig": "runtime_config", "args": "args"}
#: Keys that send a configuration to the models every time: GC's lists are validated.
UNCACHED = ("cni.dev/valid-attachments", "cni.dev/attachments")
#: The files the validation rules are written in (a change to one is another fingerprint).
RULE_MODULES = (
    "cni_config/common",
    "cni_config/values",
    "cni_config/known",
    "cni_plugin/config",
    "cni_plugin/values",
    "ipam/config",
    "ipam/values",
    "ipam/core/model",
    "dataplane/names",
    "resources/names",
    "cni_protocol/log",
)
#: More entries than any node has networks: past this the directory is emptied first.
MAX_ENTRIES = 256

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_fingerprint: list[str] = []
_written: set[str] = set()


def directory() -> str | None:
    where = os.environ.get(CACHE_ENV) or DEFAULT_DIR
    return None if where == "off" else where


def fingerprint() -> str:
    """The identity of the code that validates: the version and the files of the rules."""
    if not _fingerprint:
        from bundle import __version__

        parts = [__version__]
        files = [os.path.join(_ROOT, m) for m in RULE_MODULES]
        candidates = [f + ext for f in files for ext in (".py", ".pyc")]
        if getattr(sys, "frozen", False):
            # the bundle itself, however it was exec'd (tabby-node and the plugins are links
            # to one executable: they share their entries)
            candidates.append(os.path.realpath(sys.executable))
        for path in candidates:
            try:
                st = os.stat(path)
            except OSError:
                continue
            parts.append(f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}")
        _fingerprint.append(str(_sha256("\n".join(parts).encode()).hexdigest()))
    return _fingerprint[0]


def key(values: type[Values], config: JSON) -> str | None:
    """The hash naming ``config``'s entry for ``values``; None: never kept."""
    if any(k in config for k in UNCACHED):
        return None
    stable = {k: v for k, v in config.items() if k not in PER_CALL}
    try:
        text = json.dumps(stable, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return None
    h = _sha256()
    for part in (fingerprint(), values.__module__, values.__qualname__, text):
        h.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return str(h.hexdigest())


def lookup(values: type[V], config: JSON) -> V | None:
    """The values of ``config`` as an earlier strict validation made them, or None."""
    where = directory()
    name = key(values, config) if where else None
    if where is None or name is None:
        return None
    try:
        with open(os.path.join(where, name), encoding="utf-8") as f:
            entry = json.load(f)
        data = entry["data"]
        if entry["values"] != values.__qualname__ or not isinstance(data, dict):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for k, field in PER_CALL.items():
        if field is not None:  # by alias, else by name, as the models read them
            data[field] = config[k] if k in config else config.get(field)
    return rebuild(values, data)


def strict(values: type[V], config: JSON, validate: Callable[[JSON], V]) -> V:
    """``config``'s values for ADD, CHECK and STATUS: as kept, else ``validate(config)`` (the
    models: raises the CniError of the first problem), kept when it succeeds. Where pydantic
    is loaded already (tabby-node) the models validate: microseconds, no file read."""
    if "pydantic" not in sys.modules:
        hit = lookup(values, config)
        if hit is not None:
            return hit
    conf = validate(config)
    _keep(values, config, conf)
    return conf


def tolerant(
    values: type[V],
    config: JSON,
    validate: Callable[[JSON], Teardown[V]],
) -> Teardown[V]:
    """``config``'s reading for DEL and GC (``cni_config.teardown``): a kept configuration
    was valid, so nothing is dropped from it; else ``validate(config)``, kept when it
    dropped nothing."""
    if "pydantic" not in sys.modules:
        hit = lookup(values, config)
        if hit is not None:
            return Teardown(hit)
    read = validate(config)
    if not read.dropped:
        _keep(values, config, read.conf)
    return read


def _keep(values: type[Values], config: JSON, conf: object) -> None:
    dump = getattr(conf, "model_dump", None)
    if callable(dump):
        remember(values, config, dump())


def remember(values: type[Values], config: JSON, data: JSON) -> None:
    """Keep ``data``, a strict validation's ``model_dump()`` of ``config``, for later calls.
    Best effort: a directory that cannot be written is no error."""
    where = directory()
    name = key(values, config) if where else None
    if where is None or name is None:
        return
    path = os.path.join(where, name)
    if path in _written:
        return
    _written.add(path)
    kept = {k: v for k, v in data.items() if k not in PER_CALL.values()}
    try:
        text = json.dumps({"values": values.__qualname__, "data": kept})
    except (TypeError, ValueError):
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        if os.path.exists(path):
            return
        os.makedirs(where, mode=0o700, exist_ok=True)
        with os.scandir(where) as entries:
            old = [e.path for e in entries]
        if len(old) >= MAX_ENTRIES:
            for p in old:
                with contextlib.suppress(OSError):
                    os.unlink(p)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
