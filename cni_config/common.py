"""The network configuration both CNI plugins read, as declarative pydantic models.

One model per section, and every reader uses them: both binaries (``tabby``:
``cni_plugin.config``; ``tabby-ipam``: ``ipam.config``), tabbyctl's ``--conf``, tabby-node and
tabby-kube-controllers::

    CommonConf        the top-level fields both binaries read: identity (nodename,
                      nodename_file), logging (log_level, log_file_path), GC's
                      cni.dev/valid-attachments, runtimeConfig, args
    DatastoreSettings where the datastore is (file store dir, or etcd endpoints, prefix,
                      TLS) and the lock timeout: part of the ``ipam`` section, read by both
                      binaries; the daemons and tabbyctl resolve it from flags, environment
                      and a conflist (``cni_config.resolve``)

Strict types (no coercion: ``"5"`` is not an int, ``1`` is not a bool), field paths in errors
(``ipam.ipv4_pools[0]``), mapped to CNI codes at the edge by :func:`config_error`: a value that
cannot be honoured is code 2 naming the field and the value; a structural problem (a section
that is not an object, a required field missing) is code 7. Unknown fields are ignored. DEL
and GC read the same models through ``cni_config.teardown``, which drops a code-2 field to its
default instead (a rule over several fields says which it reads: :class:`RuleBroken`).

What the plugins read of a model (its fields, ``node_name()``, ``runtime_value()``, ...) is
its plain base in ``cni_config.values``, which every model here inherits. pydantic costs a
fresh process ~100 ms of CPU to import and to build these models, so only the code paths
that validate a configuration import this package (never VERSION, never the tabby-node
client, never a standalone call whose configuration was validated before:
``cni_config.known``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails

from cni_config.values import AttachmentValues, CommonValues, DatastoreValues
from cni_config.values import node_name_problem as node_name_problem  # (also read from here)
from cni_protocol.errors import CniError, Code
from cni_protocol.log import DEFAULT_LOG_FILE
from cni_protocol.redact import redact, shown_value

DEFAULT_NODENAME_FILE = "/var/lib/tabby/nodename"
DEFAULT_DATA_DIR = "/var/lib/tabby/ipam"
DEFAULT_ETCD_ENDPOINT = "http://127.0.0.1:2379"
DEFAULT_ETCD_PREFIX = "/tabby"
DEFAULT_LOCK_TIMEOUT = 30.0
LOG_LEVELS = ("debug", "info", "warning", "error")


M = TypeVar("M", bound=BaseModel)

# -- shared field types ----------------------------------------------------------------------


def _calico_bool(value: object) -> object:
    """Calico accepts the strings "true"/"false" for booleans; so do we (only those)."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def _absolute_path(value: str) -> str:
    if not value.startswith("/") or "\0" in value:
        raise ValueError("must be an absolute path")
    return value


def _lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


def _node_name(value: str) -> str:
    problem = node_name_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _plain_name(value: str) -> str:
    if not value or "/" in value or value in (".", "..") or "\0" in value:
        raise ValueError("must be a plain binary name (no '/'), found in CNI_PATH")
    return value


def _split_endpoints(value: object) -> object:
    """``etcd_endpoints``: a list, or one comma-separated string (docs/configuration.md
    "`tabby-ipam` fields")."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def _endpoint(value: str) -> str:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"not a URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected http://HOST:PORT or https://HOST:PORT")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError("an endpoint is scheme, host and port only")
    if port is None:
        raise ValueError("the port is required (etcd's client port, usually 2379)")
    return value.rstrip("/")


def _prefix(value: str) -> str:
    if not value.startswith("/") or value != value.strip() or "//" in value or "\0" in value:
        raise ValueError("expected an absolute key prefix such as /tabby")
    stripped = value.rstrip("/")
    if not stripped:
        raise ValueError("the prefix must not be '/' alone")
    return stripped


class RuleBroken(ValueError):
    """A rule over several fields of one section does not hold. ``fields`` are the fields it
    reads: a reader that tolerates invalid fields (``cni_config.teardown``) drops those to
    their defaults, which always keep the rule."""

    def __init__(self, message: str, *fields: str) -> None:
        super().__init__(message)
        self.fields = fields


class _Identifies:
    """Marks a field that identifies what a call acts on (``Annotated[..., IDENTIFIES]``):
    never dropped to its default by a tolerant reader (``cni_config.teardown``)."""

    def __repr__(self) -> str:
        return "IDENTIFIES"


IDENTIFIES = _Identifies()


def _nonempty(value: list[str]) -> list[str]:
    if not value:
        raise ValueError("at least one endpoint is required")
    return value


Flag = Annotated[bool, BeforeValidator(_calico_bool)]
AbsPath = Annotated[str, AfterValidator(_absolute_path)]
NodeName = Annotated[str, AfterValidator(_node_name)]
PluginType = Annotated[str, AfterValidator(_plain_name)]
Endpoints = Annotated[
    list[Annotated[str, AfterValidator(_endpoint)]],
    BeforeValidator(_split_endpoints),
    AfterValidator(_nonempty),
]
#: etcd_watch_endpoints: like Endpoints, but empty means "the etcd_endpoints"
WatchEndpoints = Annotated[
    list[Annotated[str, AfterValidator(_endpoint)]],
    BeforeValidator(_split_endpoints),
]
KeyPrefix = Annotated[str, AfterValidator(_prefix)]


class Section(BaseModel):
    """Base of every configuration section: strict, unknown fields ignored, immutable."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


# -- sections ---------------------------------------------------------------------------------


class Attachment(Section, AttachmentValues):
    """One entry of GC's ``cni.dev/valid-attachments``."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, populate_by_name=True)

    container_id: str = Field(alias="containerID", min_length=1)
    ifname: str = Field(min_length=1)


class DatastoreSettings(Section, DatastoreValues):
    """Where tabby keeps its state (docs/cluster.md "Datastore settings")."""

    datastore_type: Literal["file", "etcdv3", "kubernetes"] = "file"
    data_dir: AbsPath = DEFAULT_DATA_DIR
    etcd_endpoints: Endpoints = [DEFAULT_ETCD_ENDPOINT]
    etcd_prefix: KeyPrefix = DEFAULT_ETCD_PREFIX
    etcd_ca_cert_file: AbsPath | None = None
    etcd_cert_file: AbsPath | None = None
    etcd_key_file: AbsPath | None = None
    etcd_watch_transport: Literal["grpc", "gateway"] = "grpc"
    etcd_watch_endpoints: WatchEndpoints = []
    kubeconfig: AbsPath | None = None
    lock_timeout_seconds: float = Field(default=DEFAULT_LOCK_TIMEOUT, gt=0, le=3600)

    @model_validator(mode="after")
    def _cert_and_key(self) -> DatastoreSettings:
        if (self.etcd_cert_file is None) != (self.etcd_key_file is None):
            raise RuleBroken(
                "etcd_cert_file and etcd_key_file go together (client TLS)",
                "etcd_cert_file",
                "etcd_key_file",
            )
        if self.etcd_watch_endpoints and self.etcd_watch_transport != "grpc":
            raise RuleBroken(
                "etcd_watch_endpoints are gRPC endpoints (e.g. etcd grpc-proxy): they need "
                "etcd_watch_transport grpc",
                "etcd_watch_endpoints",
                "etcd_watch_transport",
            )
        return self


class CommonConf(Section, CommonValues):
    """Top-level fields both binaries read."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, populate_by_name=True)

    nodename: NodeName | None = None
    nodename_file: AbsPath = DEFAULT_NODENAME_FILE
    log_level: Annotated[Literal["debug", "info", "warning", "error"], BeforeValidator(_lower)] = (
        "info"
    )
    log_file_path: AbsPath = DEFAULT_LOG_FILE
    # GC's list of what is still in use: the call's own input, never dropped (a list GC
    # cannot read cannot say what is stale).
    valid_attachments: Annotated[list[Attachment] | None, IDENTIFIES] = Field(
        default=None, alias="cni.dev/valid-attachments"
    )
    attachments: Annotated[list[Attachment] | None, IDENTIFIES] = Field(
        default=None, alias="cni.dev/attachments"
    )
    # Reserved keys the runtime owns (cni_protocol/CONFORMANCE.md GEN-10, CFG-3, CFG-5):
    # free-form, never a reason to fail a call; the conventions tabby consumes are validated
    # where they are read.
    runtime_config: object = Field(default=None, alias="runtimeConfig")
    capabilities: object = None
    args: object = None


# -- parsing at the edge ------------------------------------------------------------------------


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith(("function-", "function_")) or part in (
            "json-or-python[json=...]",
            "list[str]",
        ):
            continue  # pydantic's names for validators and union members, not fields
        else:
            out += f".{part}" if out else part
    return out


_STRUCTURAL = frozenset({"missing", "model_type", "model_attributes_type", "dict_type"})
#: Fields whose bad value makes the configuration structurally invalid (CFG-4: a plugin
#: type with path characters is code 7, not 2).
_STRUCTURAL_FIELDS = frozenset({"ipam.type"})


def config_error(exc: ValidationError, prefix: str = "") -> CniError:
    """The CNI error for the first problem pydantic found (field path and value named)."""
    return problem_error(exc.errors(include_url=False)[0], prefix)


def problem_message(error: ErrorDetails) -> str:
    """What is wrong, in words (one of pydantic's errors)."""
    return str(error["msg"]).removeprefix("Value error, ")


def problem_error(error: ErrorDetails, prefix: str = "") -> CniError:
    """The CNI error for one of pydantic's errors: code 7 for a structural problem, else 2."""
    path = prefix + _path(error["loc"])
    msg = redact(problem_message(error))
    if path in _STRUCTURAL_FIELDS:
        return CniError(Code.INVALID_CONFIG, f"invalid {path}", f"{path}: {msg}")
    if error["type"] in _STRUCTURAL:
        what = "is required" if error["type"] == "missing" else "must be an object"
        return CniError(Code.INVALID_CONFIG, f"{path} {what}", msg)
    value = error.get("input")
    if error["type"] == "value_error" and isinstance(value, dict):
        # A rule over several fields of one section (a model validator): name the section.
        where = path or "the network configuration"
        return CniError(Code.UNSUPPORTED_FIELD, f"unsupported configuration in {where}: {msg}", msg)
    shown = shown_value(path, value)
    return CniError(Code.UNSUPPORTED_FIELD, f"unsupported value for field {path!r}: {shown}", msg)


def parse(model: type[M], config: Mapping[str, object], *, prefix: str = "") -> M:
    """Validate ``config`` with ``model``; any problem becomes one CniError (code 2 or 7)."""
    try:
        return model.model_validate(config)
    except ValidationError as e:
        raise config_error(e, prefix) from None
