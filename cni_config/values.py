"""The validated configuration as the code reads it, without pydantic.

A configuration section is declared once, as a pydantic model (``cni_config.common``,
``cni_plugin.config``, ``ipam.config``), and validated by it. What the plugins *read* of it,
the fields and the methods over them (``node_name()``, ``runtime_value()``, ...), is a plain
class here, which the model inherits:

    CommonValues      <- CommonConf         DatastoreValues <- DatastoreSettings
    AttachmentValues  <- Attachment

so the plugins take either: the model a validation made, or, for a configuration already
validated by an earlier call (``cni_config.known``), the same values rebuilt from that
validation's output (:func:`rebuild`) without importing pydantic (~100 ms per process).

The models declare and validate the fields (types, defaults, rules); the annotations here
say what a reader gets, and a test checks that they name exactly the models' fields and that
values rebuilt from a validation equal the model it made. Rule IDs (CAP-3, ...) are defined
in cni_protocol/CONFORMANCE.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, TypeVar

from cni_protocol.errors import CniError, Code
from resources.names import dns1123_subdomain

V = TypeVar("V", bound="Values")


def node_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a node name, or None: a node is a Kubernetes Node, named by a
    DNS-1123 subdomain (the one rule, ``resources.names``), which also makes it a safe
    datastore key (no ``/`` or ``:``)."""
    return dns1123_subdomain(name)


class Values:
    """Base of the plain side of every section. ``NESTED``: the fields holding a section of
    their own (field name -> its values class), for :func:`rebuild`."""

    NESTED: ClassVar[Mapping[str, type[Values]]] = {}


def rebuild(cls: type[V], data: Mapping[str, object]) -> V:
    """An instance of the values class ``cls`` holding ``data``: a validated model's
    ``model_dump()`` (field names, nested sections as mappings), trusted as it is."""
    obj = object.__new__(cls)
    for name, value in data.items():
        sub = cls.NESTED.get(name)
        if sub is not None and isinstance(value, Mapping):
            value = rebuild(sub, value)
        object.__setattr__(obj, name, value)
    return obj


class AttachmentValues(Values):
    """One entry of GC's ``cni.dev/valid-attachments``."""

    container_id: str
    ifname: str


class DatastoreValues(Values):
    """Where tabby keeps its state (docs/cluster.md "Datastore settings")."""

    datastore_type: str
    data_dir: str
    etcd_endpoints: list[str]
    etcd_prefix: str
    etcd_ca_cert_file: str | None
    etcd_cert_file: str | None
    etcd_key_file: str | None
    etcd_watch_transport: str
    etcd_watch_endpoints: list[str]
    kubeconfig: str | None
    lock_timeout_seconds: float

    def location_fields(self) -> tuple[str, ...]:
        """The fields that say which store this is: its type and, for that type, where it is
        and how it is reached (the etcd TLS files say which server to trust). A value derived
        from them is unknown when one of them is invalid (``cni_config.teardown``)."""
        if self.datastore_type == "file":
            return ("datastore_type", "data_dir")
        if self.datastore_type == "kubernetes":
            return ("datastore_type", "kubeconfig")
        return (
            "datastore_type",
            "etcd_endpoints",
            "etcd_prefix",
            "etcd_ca_cert_file",
            "etcd_cert_file",
            "etcd_key_file",
        )

    def describe(self) -> str:
        """One line for operators: where the store is."""
        if self.datastore_type == "file":
            return f"file store {self.data_dir}"
        if self.datastore_type == "kubernetes":
            return f"Kubernetes API ({self.kubeconfig or 'KUBECONFIG or the service account'})"
        return f"etcd {','.join(self.etcd_endpoints)} prefix {self.etcd_prefix}"


class CommonValues(Values):
    """Top-level fields both binaries read."""

    nodename: str | None
    nodename_file: str
    log_level: str
    log_file_path: str
    valid_attachments: Sequence[AttachmentValues] | None
    attachments: Sequence[AttachmentValues] | None
    runtime_config: object
    capabilities: object
    args: object

    def node_name(self) -> str:
        """``nodename`` > contents of ``nodename_file`` > hostname (docs/configuration.md
        "`tabby` fields").

        A file that holds something that is not a node name is an error (code 2 naming the
        file): silently using it would put the pod's block on a node that does not exist."""
        if self.nodename is not None:
            return self.nodename
        try:
            with open(self.nodename_file, encoding="utf-8") as f:
                text = f.read().strip()
        except (OSError, UnicodeDecodeError):
            text = ""
        if text:
            problem = node_name_problem(text)
            if problem:
                raise CniError(
                    Code.UNSUPPORTED_FIELD,
                    f"unsupported value in nodename_file {self.nodename_file!r}: {text[:100]!r}",
                    problem,
                )
            return text
        # As the kubelet does: a Node is named by the lower-cased hostname.
        import socket  # here: ~5 ms a call that names its node does not pay

        return socket.gethostname().lower()

    def node_name_given(self) -> bool:
        """Whether :meth:`node_name` comes from the configuration or the node-name file
        (not the hostname fallback): a DEL can trust it names the node that ran the ADD."""
        if self.nodename is not None:
            return True
        try:
            with open(self.nodename_file, encoding="utf-8") as f:
                return bool(f.read().strip())
        except (OSError, UnicodeDecodeError):
            return False

    def node_name_fields(self) -> tuple[str, ...]:
        """The fields :meth:`node_name` derives the name from (``cni_config.teardown``)."""
        return ("nodename",) if self.nodename is not None else ("nodename", "nodename_file")

    def valid_attachment_set(self) -> set[tuple[str, str]] | None:
        """GC's valid (containerID, ifname) set, or None when the key is absent.

        Absent means "no information": delete nothing. Only an explicit empty list means
        everything of this network is stale. ``valid-attachments`` first, the 1.1.0 tag's
        ``attachments`` as the fallback (libcni sends both)."""
        for given in (self.valid_attachments, self.attachments):
            if given is not None:
                return {(a.container_id, a.ifname) for a in given}
        return None

    def runtime_value(self, capability: str) -> object:
        """A capability's value from runtimeConfig, only if declared (CAP-3, ADD-10).

        Keys are matched case-insensitively (containerd capitalises Go-style). Runtimes at
        1.0+ strip ``capabilities`` before calling; then whatever runtimeConfig holds was
        declared."""
        rc = self.runtime_config
        if not isinstance(rc, dict) or not rc:
            return None
        want = capability.lower()
        caps = self.capabilities
        if isinstance(caps, dict) and not any(
            isinstance(k, str) and k.lower() == want and v for k, v in caps.items()
        ):
            return None
        for k, v in rc.items():
            if k.lower() == want:
                return v
        return None

    def args_ips(self) -> list[object] | None:
        """``args.cni.ips`` (the convention for specific IPs), or None."""
        cni = self.args.get("cni") if isinstance(self.args, dict) else None
        ips = cni.get("ips") if isinstance(cni, dict) else None
        if not ips:
            return None
        if not isinstance(ips, list):
            raise CniError(Code.INVALID_CONFIG, "args.cni.ips must be a list", repr(ips)[:200])
        return ips
