"""The ``tabby`` plugin's section of a conflist, as a declarative pydantic model.

``PluginConf`` is the shared top-level fields (``cni_config.common.CommonConf``) plus tabby's
own (``mtu``, ``veth_prefix``, ``container_settings``) and what it reads of ``ipam``
(``IpamRef``: the IPAM plugin's type and the datastore it records WorkloadEndpoints in). The
rest of ``ipam`` is the IPAM plugin's (``ipam/config.py`` for tabby-ipam). Field errors
become CNI code 2 or 7 through ``cni_config.common.parse``; DEL and GC read the same model with
``cni_config.teardown`` (an invalid field is dropped to its default and reported). What the
plugin reads of each model (fields, ``effective_mtu()``) is its plain base in
``cni_plugin.values``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from pydantic import AfterValidator

from cni_config.common import (
    CommonConf,
    DatastoreSettings,
    Flag,
    PluginType,
    Section,
    parse,
)
from cni_config.teardown import Teardown, parse_for_teardown
from cni_plugin.values import DEFAULT_MTU, ContainerSettingsValues, IpamRefValues, PluginValues
from dataplane.names import DEFAULT_VETH_PREFIX, veth_prefix_problem


def _veth_prefix(value: str) -> str:
    problem = veth_prefix_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _mtu(value: int) -> int:
    if value != 0 and not 68 <= value <= 65535:
        raise ValueError("expected 0 (auto) or an integer from 68 to 65535")
    return value


class ContainerSettings(Section, ContainerSettingsValues):
    allow_ip_forwarding: Flag = False


class IpamRef(DatastoreSettings, IpamRefValues):
    """What ``tabby`` itself reads of the ``ipam`` section: which plugin to delegate to, and
    the datastore it records the pod's WorkloadEndpoint in (the one tabby-ipam uses).

    The rest of the section belongs to the IPAM plugin (``ipam/config.py`` for tabby-ipam)."""

    type: PluginType


class PluginConf(CommonConf, PluginValues):
    """The ``tabby`` plugin's section."""

    mtu: Annotated[int, AfterValidator(_mtu)] = DEFAULT_MTU
    veth_prefix: Annotated[str, AfterValidator(_veth_prefix)] = DEFAULT_VETH_PREFIX
    container_settings: ContainerSettings = ContainerSettings()
    ipam: IpamRef


def parse_plugin(config: Mapping[str, object]) -> PluginConf:
    return parse(PluginConf, config)


def parse_plugin_for_teardown(config: Mapping[str, object]) -> Teardown[PluginConf]:
    """For DEL and GC: each invalid field at its default (``cni_config.teardown``)."""
    return parse_for_teardown(PluginConf, config)
