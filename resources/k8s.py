"""Kubernetes kinds: ``networking.k8s.io/v1`` NetworkPolicy, ``v1`` Namespace and Pod.

NetworkPolicy follows the API server: its defaulting (``policyTypes``: ``[Ingress]`` plus
``Egress`` when egress rules exist; a port's protocol ``TCP``) and its validation (label
selectors and their operators, peers, ipBlock ``except`` strictly inside ``cidr``, ports and
``endPort``, label and name syntax). Defaults are applied when a model is built, so a stored
document keeps only what was applied and every reader sees the defaulted resource.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator

from bundle.types import IPNetwork
from resources import names
from resources.meta import FieldError, Labels, Resource, StrictModel

Protocol = Literal["TCP", "UDP", "SCTP"]
PolicyType = Literal["Ingress", "Egress"]


def _port_number(value: int, *path: str) -> None:
    if not 1 <= value <= 65535:
        raise FieldError("must be between 1 and 65535, inclusive", *path, value=value)


def _int_or_string(value: object) -> object:
    """Kubernetes' IntOrString: a JSON number or a string, never a bool."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise FieldError("must be an integer or a string", value=value)
    return value


IntOrString = Annotated[int | str, BeforeValidator(_int_or_string)]


# -- label selectors -------------------------------------------------------------------------


class LabelSelectorRequirement(StrictModel):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] | None = None

    @model_validator(mode="after")
    def _rules(self) -> LabelSelectorRequirement:
        why = names.qualified_name(self.key)
        if why is not None:
            raise FieldError(why, "key", value=self.key)
        if self.operator in ("In", "NotIn") and not self.values:
            raise FieldError(
                "Required value: must be specified when `operator` is 'In' or 'NotIn'", "values"
            )
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise FieldError(
                "Forbidden: may not be specified when `operator` is 'Exists' or 'DoesNotExist'",
                "values",
            )
        for i, v in enumerate(self.values or ()):
            why = names.label_value(v)
            if why is not None:
                raise FieldError(why, "values", i, value=v)
        return self

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        if self.operator == "Exists":
            return present
        if self.operator == "DoesNotExist":
            return not present
        inside = present and labels[self.key] in (self.values or ())
        return inside if self.operator == "In" else not inside


class LabelSelector(StrictModel):
    """``{}`` selects everything; the terms are ANDed."""

    matchLabels: Labels | None = None
    matchExpressions: list[LabelSelectorRequirement] | None = None

    def matches(self, labels: dict[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in (self.matchLabels or {}).items()):
            return False
        return all(e.matches(labels) for e in self.matchExpressions or ())


# -- NetworkPolicy --------------------------------------------------------------------------


class IPBlock(StrictModel):
    cidr: str
    except_: list[str] | None = Field(default=None, alias="except")

    @model_validator(mode="after")
    def _rules(self) -> IPBlock:
        outer = _parse_cidr(self.cidr, "cidr")
        for i, text in enumerate(self.except_ or ()):
            inner = _parse_cidr(text, "except", i)
            if (
                inner.version != outer.version
                or inner.prefixlen <= outer.prefixlen
                or inner.network_address not in outer
            ):
                raise FieldError("must be a strict subset of `cidr`", "except", i, value=text)
        return self

    @property
    def network(self) -> IPNetwork:
        """``cidr`` as a network (host bits dropped, as the API server accepts them)."""
        return ipaddress.ip_network(self.cidr, strict=False)

    @property
    def excepted(self) -> list[IPNetwork]:
        return [ipaddress.ip_network(c, strict=False) for c in self.except_ or ()]


def _parse_cidr(text: str, *path: str | int) -> IPNetwork:
    if "/" not in text:
        raise FieldError("must be a valid CIDR (e.g. 10.0.0.0/8 or fd00::/8)", *path, value=text)
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise FieldError(
            "must be a valid CIDR (e.g. 10.0.0.0/8 or fd00::/8)", *path, value=text
        ) from None


class NetworkPolicyPeer(StrictModel):
    """Selectors (both: AND), or an ipBlock alone."""

    podSelector: LabelSelector | None = None
    namespaceSelector: LabelSelector | None = None
    ipBlock: IPBlock | None = None

    @model_validator(mode="after")
    def _exclusive(self) -> NetworkPolicyPeer:
        given = [x is not None for x in (self.podSelector, self.namespaceSelector, self.ipBlock)]
        if not any(given):
            raise FieldError("Required value: must specify a peer")
        if self.ipBlock is not None and sum(given) > 1:
            raise FieldError("Forbidden: may not specify both ipBlock and another peer")
        return self


class NetworkPolicyPort(StrictModel):
    """``port`` by number or by container-port name; ``endPort`` (numeric ``port`` only)
    makes an inclusive range. No ``port``: every port of the protocol."""

    protocol: Protocol = "TCP"
    port: IntOrString | None = None
    endPort: int | None = None

    @model_validator(mode="after")
    def _rules(self) -> NetworkPolicyPort:
        if isinstance(self.port, int):
            _port_number(self.port, "port")
            if self.endPort is not None:
                if self.endPort < self.port:
                    raise FieldError(
                        "must be greater than or equal to `port`", "endPort", value=self.endPort
                    )
                _port_number(self.endPort, "endPort")
        elif isinstance(self.port, str):
            if self.endPort is not None:
                raise FieldError(
                    "Forbidden: may not be specified when `port` is non-numeric", "endPort"
                )
            why = names.port_name(self.port)
            if why is not None:
                raise FieldError(why, "port", value=self.port)
        elif self.endPort is not None:
            raise FieldError(
                "Forbidden: may not be specified when `port` is not specified", "endPort"
            )
        return self


class NetworkPolicyIngressRule(StrictModel):
    """Empty ``from``: every source; empty ``ports``: every port."""

    ports: list[NetworkPolicyPort] | None = None
    from_: list[NetworkPolicyPeer] | None = Field(default=None, alias="from")


class NetworkPolicyEgressRule(StrictModel):
    ports: list[NetworkPolicyPort] | None = None
    to: list[NetworkPolicyPeer] | None = None


class NetworkPolicySpec(StrictModel):
    podSelector: LabelSelector = Field(default_factory=LabelSelector)
    ingress: list[NetworkPolicyIngressRule] | None = None
    egress: list[NetworkPolicyEgressRule] | None = None
    policyTypes: list[PolicyType] | None = None

    @model_validator(mode="after")
    def _policy_types(self) -> NetworkPolicySpec:
        if self.policyTypes is not None and len(self.policyTypes) > 2:
            raise FieldError("Too many: may not specify more than two policyTypes", "policyTypes")
        if not self.policyTypes:
            types: list[PolicyType] = ["Ingress"]
            if self.egress:
                types.append("Egress")
            self.policyTypes = types
        return self


class NetworkPolicy(Resource):
    API_VERSION: ClassVar[str] = "networking.k8s.io/v1"
    KIND: ClassVar[str] = "NetworkPolicy"
    NAMESPACED: ClassVar[bool] = True

    spec: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)


# -- Namespace and Pod ---------------------------------------------------------------------


class Namespace(Resource):
    """Only labels matter (for ``namespaceSelector``); ``kubernetes.io/metadata.name`` is
    always its name."""

    API_VERSION: ClassVar[str] = "v1"
    KIND: ClassVar[str] = "Namespace"
    NAME_RULE: ClassVar[Callable[[str], str | None]] = staticmethod(names.dns1123_label)

    @model_validator(mode="after")
    def _name_label(self) -> Namespace:
        if self.metadata.name:
            self.metadata.labels = names.namespace_labels(self.metadata.name, self.metadata.labels)
        return self


class ContainerPort(StrictModel):
    name: str | None = None
    containerPort: int
    protocol: Protocol = "TCP"

    @model_validator(mode="after")
    def _rules(self) -> ContainerPort:
        _port_number(self.containerPort, "containerPort")
        if self.name is not None:
            why = names.port_name(self.name)
            if why is not None:
                raise FieldError(why, "name", value=self.name)
        return self


class Container(StrictModel):
    name: str
    image: str | None = None
    ports: list[ContainerPort] | None = None

    @model_validator(mode="after")
    def _name(self) -> Container:
        why = names.dns1123_label(self.name)
        if why is not None:
            raise FieldError(why, "name", value=self.name)
        return self


class PodSpec(StrictModel):
    containers: list[Container] = Field(default_factory=list)
    nodeName: str | None = None
    #: the pod's service account (Calico's rules and policies select by it: ``serviceAccounts``,
    #: ``serviceAccountSelector``); the API server sets ``default`` when none is given
    serviceAccountName: str | None = None

    @model_validator(mode="after")
    def _node_name(self) -> PodSpec:
        for field in ("nodeName", "serviceAccountName"):
            value = getattr(self, field)
            if value is not None:
                why = names.dns1123_subdomain(value)
                if why is not None:
                    raise FieldError(why, field, value=value)
        return self

    @model_validator(mode="after")
    def _unique(self) -> PodSpec:
        seen: set[str] = set()
        for i, c in enumerate(self.containers):
            if c.name in seen:
                raise FieldError("Duplicate value", "containers", i, "name", value=c.name)
            seen.add(c.name)
            port_names: set[str] = set()
            for j, p in enumerate(c.ports or ()):
                if p.name is not None:
                    if p.name in port_names:
                        raise FieldError(
                            "Duplicate value", "containers", i, "ports", j, "name", value=p.name
                        )
                    port_names.add(p.name)
        return self


class PodIP(StrictModel):
    ip: str

    @model_validator(mode="after")
    def _address(self) -> PodIP:
        try:
            ipaddress.ip_address(self.ip)
        except ValueError:
            raise FieldError("must be an IP address", "ip", value=self.ip) from None
        return self


class PodStatus(StrictModel):
    podIPs: list[PodIP] | None = None


class Pod(Resource):
    """The labels and named ports a Kubernetes API server would hold for a pod, and (in
    Kubernetes mode, mirrored by tabby-kube-controllers) its node and addresses; applying
    one creates no pod. Its CNI attachments (WorkloadEndpoints) take its labels."""

    API_VERSION: ClassVar[str] = "v1"
    KIND: ClassVar[str] = "Pod"
    NAMESPACED: ClassVar[bool] = True

    spec: PodSpec = Field(default_factory=PodSpec)
    status: PodStatus | None = None

    def addresses(self) -> list[str]:
        """``status.podIPs`` (empty until the kubelet reports them)."""
        return [p.ip for p in self.status.podIPs or ()] if self.status is not None else []

    def named_ports(self) -> list[tuple[str, Protocol, int]]:
        """``(name, protocol, containerPort)`` of every named port, for resolving a policy's
        named ports (two containers may use the same name: it then stands for both)."""
        return [
            (p.name, p.protocol, p.containerPort)
            for c in self.spec.containers
            for p in c.ports or ()
            if p.name is not None
        ]
