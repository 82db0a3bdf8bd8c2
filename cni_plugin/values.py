"""What the ``tabby`` plugin reads of its section, without pydantic (``cni_config.values``):
the model, ``cni_plugin.config.PluginConf``, inherits it; a configuration validated by an
earlier call is rebuilt as these values (``cni_config.known``)."""

from __future__ import annotations

from cni_config.values import CommonValues, DatastoreValues, Values

DEFAULT_MTU = 1500
DEFAULT_MTU_FILE = "/var/lib/tabby/mtu"


class ContainerSettingsValues(Values):
    allow_ip_forwarding: bool


class IpamRefValues(DatastoreValues):
    """What ``tabby`` itself reads of the ``ipam`` section: which plugin to delegate to, and
    the datastore it records the pod's WorkloadEndpoint in (the one tabby-ipam uses)."""

    type: str


class PluginValues(CommonValues):
    """The ``tabby`` plugin's section."""

    NESTED = {"ipam": IpamRefValues, "container_settings": ContainerSettingsValues}

    mtu: int
    veth_prefix: str
    container_settings: ContainerSettingsValues
    ipam: IpamRefValues

    @property
    def ipam_type(self) -> str:
        return self.ipam.type

    @property
    def allow_ip_forwarding(self) -> bool:
        return self.container_settings.allow_ip_forwarding

    def effective_mtu(self, mtu_file: str = DEFAULT_MTU_FILE) -> int:
        """``mtu``, or for 0 the MTU tabby-node wrote for this node (else 1500)."""
        if self.mtu:
            return self.mtu
        try:
            with open(mtu_file, encoding="utf-8") as f:
                value = int(f.read().strip())
        except (OSError, ValueError):
            return DEFAULT_MTU
        return value if 68 <= value <= 65535 else DEFAULT_MTU
