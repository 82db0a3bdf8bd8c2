"""tabby-ipam's configuration, as declarative pydantic models.

::

    IpamConf             the ``ipam`` section: the datastore settings
                         (``cni_config.common.DatastoreSettings``) + pools, block sizes,
                         families, affinity rules, reserved addresses, GC grace
    IpamPluginConf       what tabby-ipam validates of its stdin: the top-level fields both
                         binaries read (cni_config.common.CommonConf) + ``ipam``

Field errors become CNI code 2 (field path and value) or 7 through
``cni_config.common.parse`` (DEL and GC: ``cni_config.teardown``, each invalid field dropped
to its default and reported); block-size limits and defaults come from the IPAM core, so the
rule is written once. What the plugin reads of each model is its plain base in
``ipam.values``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, Field, model_validator

from cni_config.common import (
    CommonConf,
    DatastoreSettings,
    Flag,
    PluginType,
    RuleBroken,
    parse,
)
from cni_config.teardown import Teardown, parse_for_teardown
from ipam.core.model import BLOCK_SIZE_LIMITS, DEFAULT_BLOCK_SIZE
from ipam.values import IpamPluginValues, IpamValues

DEFAULT_V4_POOLS = ("10.244.0.0/16",)
DEFAULT_V6_POOLS = ("fd00:10:244::/48",)

# -- field types ------------------------------------------------------------------------------


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


# -- models -------------------------------------------------------------------------------------


class IpamConf(DatastoreSettings, IpamValues):
    """tabby-ipam's ``ipam`` section (docs/configuration.md "tabby-ipam fields")."""

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
            raise RuleBroken(
                "nothing to assign: assign_ipv4 and assign_ipv6 are both false",
                "assign_ipv4",
                "assign_ipv6",
            )
        if self.assign_ipv4 and not self.ipv4_pools:
            raise RuleBroken(
                "assign_ipv4 is true but ipv4_pools is empty", "assign_ipv4", "ipv4_pools"
            )
        if self.assign_ipv6 and not self.ipv6_pools:
            raise RuleBroken(
                "assign_ipv6 is true but ipv6_pools is empty", "assign_ipv6", "ipv6_pools"
            )
        return self


class IpamPluginConf(CommonConf, IpamPluginValues):
    """What tabby-ipam reads of its stdin."""

    ipam: IpamConf = IpamConf()


def parse_plugin(config: Mapping[str, object]) -> IpamPluginConf:
    """tabby-ipam's configuration; a problem is one CniError (code 2 or 7)."""
    conf = parse(IpamPluginConf, config)
    return conf


def parse_plugin_for_teardown(config: Mapping[str, object]) -> Teardown[IpamPluginConf]:
    """For DEL and GC: each invalid field at its default (``cni_config.teardown``)."""
    return parse_for_teardown(IpamPluginConf, config)
