"""What tabby-ipam reads of its configuration, without pydantic (``cni_config.values``): the
models in ``ipam.config`` inherit these; a configuration validated by an earlier call is
rebuilt as these values (``cni_config.known``)."""

from __future__ import annotations

import ipaddress

from cni_config.values import CommonValues, DatastoreValues


class IpamValues(DatastoreValues):
    """tabby-ipam's ``ipam`` section (docs/configuration.md "tabby-ipam fields")."""

    type: str
    assign_ipv4: bool
    assign_ipv6: bool
    ipv4_pools: list[str]
    ipv6_pools: list[str]
    block_size_ipv4: int
    block_size_ipv6: int
    strict_affinity: bool
    max_blocks_per_host: int
    reserved: list[str]
    gc_grace_seconds: float

    @property
    def reserved_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return [ipaddress.ip_network(r.strip(), strict=False) for r in self.reserved]


class IpamPluginValues(CommonValues):
    """What tabby-ipam reads of its stdin."""

    NESTED = {"ipam": IpamValues}

    ipam: IpamValues
