"""tabby-ipam's configuration and the datastore settings, as declarative pydantic models.

::

    DatastoreSettings    where the datastore is: file store dir, or etcd endpoints, prefix,
                         TLS; the lock timeout. Read from a conflist's ``ipam`` section by
                         the binaries, and from flags > env > ``--conf`` > defaults by
                         tabbyctl and tabby-node (:func:`resolve_datastore`).
    IpamConf             the ``ipam`` section: DatastoreSettings + pools, block sizes,
                         families, affinity rules, reserved addresses, GC grace
    IpamPluginConf       what tabby-ipam validates of its stdin: the top-level fields both
                         binaries read (cni_plugin.config.CommonConf) + ``ipam``

Field errors become CNI code 2 (field path and value) or 7 through
``cni_plugin.config.parse``; block-size limits and defaults come from the IPAM core, so the
rule is written once.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, model_validator

from cni_plugin.cni.errors import CniError, Code
from cni_plugin.config import (
    AbsPath,
    CommonConf,
    Flag,
    PluginType,
    Section,
    config_error,
    parse,
)
from ipam.core.model import BLOCK_SIZE_LIMITS, DEFAULT_BLOCK_SIZE

DEFAULT_DATA_DIR = "/var/lib/tabby/ipam"
DEFAULT_ETCD_ENDPOINT = "http://127.0.0.1:2379"
DEFAULT_ETCD_PREFIX = "/tabby"
DEFAULT_V4_POOLS = ("10.244.0.0/16",)
DEFAULT_V6_POOLS = ("fd00:10:244::/48",)
DEFAULT_LOCK_TIMEOUT = 30.0

# -- field types ------------------------------------------------------------------------------


def _split_endpoints(value: object) -> object:
    """``etcd_endpoints`` is a list, or one comma-separated string (PRODUCT.md)."""
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


def _nonempty(value: list[str]) -> list[str]:
    if not value:
        raise ValueError("at least one endpoint is required")
    return value


def _pool_list(family: int) -> AfterValidator:
    def check(value: list[str]) -> list[str]:
        out = []
        for text in value:
            try:
                net = ipaddress.ip_network(text.strip(), strict=True)
            except ValueError:
                raise ValueError(f"{text!r} is not a CIDR (host bits must be zero)") from None
            if net.version != family:
                raise ValueError(f"{text!r} is not an IPv{family} CIDR")
            out.append(str(net))
        return out

    return AfterValidator(check)


def _reserved(value: list[str]) -> list[str]:
    for text in value:
        try:
            ipaddress.ip_network(text.strip(), strict=False)
        except ValueError:
            raise ValueError(f"{text!r} is not an IP address or CIDR") from None
    return value


def _block_size(family: int) -> Any:
    lo, hi = BLOCK_SIZE_LIMITS[family]
    return Field(default=DEFAULT_BLOCK_SIZE[family], ge=lo, le=hi)


Endpoints = Annotated[
    list[Annotated[str, AfterValidator(_endpoint)]],
    BeforeValidator(_split_endpoints),
    AfterValidator(_nonempty),
]
KeyPrefix = Annotated[str, AfterValidator(_prefix)]

# -- models -------------------------------------------------------------------------------------


class DatastoreSettings(Section):
    """Where tabby keeps its state (PRODUCT.md "Datastore settings")."""

    datastore_type: Literal["file", "etcdv3"] = "file"
    data_dir: AbsPath = DEFAULT_DATA_DIR
    etcd_endpoints: Endpoints = [DEFAULT_ETCD_ENDPOINT]
    etcd_prefix: KeyPrefix = DEFAULT_ETCD_PREFIX
    etcd_ca_cert_file: AbsPath | None = None
    etcd_cert_file: AbsPath | None = None
    etcd_key_file: AbsPath | None = None
    lock_timeout_seconds: float = Field(default=DEFAULT_LOCK_TIMEOUT, gt=0, le=3600)

    @model_validator(mode="after")
    def _cert_and_key(self) -> DatastoreSettings:
        if (self.etcd_cert_file is None) != (self.etcd_key_file is None):
            raise ValueError("etcd_cert_file and etcd_key_file go together (client TLS)")
        return self

    def describe(self) -> str:
        """One line for operators: where the store is."""
        if self.datastore_type == "file":
            return f"file store {self.data_dir}"
        return f"etcd {','.join(self.etcd_endpoints)} prefix {self.etcd_prefix}"


class IpamConf(DatastoreSettings):
    """tabby-ipam's ``ipam`` section (README "tabby-ipam fields")."""

    type: PluginType = "tabby-ipam"
    assign_ipv4: Flag = True
    assign_ipv6: Flag = False
    ipv4_pools: Annotated[list[str], _pool_list(4)] = list(DEFAULT_V4_POOLS)
    ipv6_pools: Annotated[list[str], _pool_list(6)] = list(DEFAULT_V6_POOLS)
    block_size_ipv4: int = _block_size(4)
    block_size_ipv6: int = _block_size(6)
    strict_affinity: Flag = False
    max_blocks_per_host: int = Field(default=0, ge=0, le=1 << 30)
    reserved: Annotated[list[str], AfterValidator(_reserved)] = []
    gc_grace_seconds: float = Field(default=0.0, ge=0, le=10 * 365 * 86400)

    @model_validator(mode="after")
    def _families(self) -> IpamConf:
        if not (self.assign_ipv4 or self.assign_ipv6):
            raise ValueError("nothing to assign: assign_ipv4 and assign_ipv6 are both false")
        if self.assign_ipv4 and not self.ipv4_pools:
            raise ValueError("assign_ipv4 is true but ipv4_pools is empty")
        if self.assign_ipv6 and not self.ipv6_pools:
            raise ValueError("assign_ipv6 is true but ipv6_pools is empty")
        return self

    @property
    def reserved_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return [ipaddress.ip_network(r.strip(), strict=False) for r in self.reserved]


class IpamPluginConf(CommonConf):
    """What tabby-ipam reads of its stdin."""

    ipam: IpamConf = IpamConf()


def parse_plugin(config: Mapping[str, Any]) -> IpamPluginConf:
    """tabby-ipam's configuration; a problem is one CniError (code 2 or 7)."""
    conf = parse(IpamPluginConf, config)
    return conf


# -- datastore settings from flags, environment and a conflist ---------------------------------

#: setting -> (tabbyctl / tabby-node flag, environment variable). The conflist field is the
#: setting's own name (PRODUCT.md "Datastore settings").
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
