"""The base of every resource model: strict pydantic, ObjectMeta, field-path errors.

Models are strict (no type coercion: ``"80"`` is not a port number) and forbid unknown
fields, as the API server's strict field validation does. Field names are the wire names
(camelCase), so a pydantic error location is already the field path.

A rule that spans fields raises ``FieldError`` naming the path below the model it belongs to
(``FieldError("must be ...", "endPort", value=70000)``); ``problems()`` turns a
``ValidationError`` into ``[(path, message)]`` with paths like
``spec.ingress[0].ports[0].port`` and map keys as ``metadata.labels[app]``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Annotated, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, model_validator

from bundle.types import JSON
from resources import names


class Key(str):
    """A map key in a field path (rendered ``[key]``)."""

    __slots__ = ()


PathPart = str | int


class FieldError(ValueError):
    """A validation failure at ``path`` below the model (or field) that raises it.

    With ``value`` the message reads ``Invalid value: <value>: <message>``, as Kubernetes
    words it; without, ``message`` is used as given.
    """

    def __init__(self, message: str, *path: PathPart, value: object = ...) -> None:
        if value is not ...:
            message = f"Invalid value: {show(value)}: {message}"
        super().__init__(message)
        self.message = message
        self.path: tuple[PathPart, ...] = path


def show(value: object, limit: int = 60) -> str:
    """A value as the operator wrote it (JSON), shortened."""
    try:
        text = json.dumps(value, separators=(",", ":"), default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render_path(loc: Sequence[PathPart]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, Key | int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


_MESSAGES = {
    "missing": "Required value",
    "extra_forbidden": "unknown field",
}


def problems(exc: ValidationError) -> list[tuple[str, str]]:
    """``[(field path, message)]`` of a ValidationError, in the order pydantic found them."""
    out: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        loc: list[PathPart] = [p for p in err["loc"] if isinstance(p, str | int)]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):
            loc.extend(cause.path)
            message = cause.message
        elif isinstance(cause, ValueError):
            message = str(cause)
        elif err["type"] in _MESSAGES:
            message = _MESSAGES[err["type"]]
        else:
            message = f"Invalid value: {show(err.get('input'))}: {err['msg']}"
        out.append((render_path(loc), message))
    return out


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=False)

    def wire(self) -> JSON:
        """The JSON form: wire names, unset optional fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# -- maps of strings --------------------------------------------------------------------------


def _string_map(
    key_rule: Callable[[str], str | None], value_rule: Callable[[str], str | None] | None
) -> Callable[[object], object]:
    def check(value: object) -> object:
        if not isinstance(value, dict):
            raise FieldError("must be a map of strings to strings", value=value)
        for k, v in value.items():
            if not isinstance(k, str):
                raise FieldError("keys must be strings", value=k)
            why = key_rule(k)
            if why is not None:
                raise FieldError(why, Key(k), value=k)
            if not isinstance(v, str):
                raise FieldError("must be a string", Key(k), value=v)
            why = value_rule(v) if value_rule is not None else None
            if why is not None:
                raise FieldError(why, Key(k), value=v)
        return value

    return check


def _annotations_size(value: object) -> object:
    if isinstance(value, dict):
        total = sum(len(str(k)) + len(str(v)) for k, v in value.items())
        if total > 256 * 1024:
            raise FieldError(f"Too long: may not be more than {256 * 1024} bytes")
    return value


#: ``metadata.labels``, ``matchLabels``: qualified-name keys, label values.
Labels = Annotated[
    dict[str, str], BeforeValidator(_string_map(names.qualified_name, names.label_value))
]
Annotations = Annotated[
    dict[str, str],
    BeforeValidator(_annotations_size),
    BeforeValidator(_string_map(names.qualified_name, None)),
]


def format_labels(labels: dict[str, str] | None) -> str:
    """``k=v,k2=v2`` for tables (``<none>`` when empty)."""
    return ",".join(f"{k}={v}" for k, v in sorted((labels or {}).items())) or "<none>"


# -- ObjectMeta and the resource base ----------------------------------------------------------


class ObjectMeta(StrictModel):
    """The metadata tabby keeps. ``resourceVersion`` is the store revision (a string);
    ``uid`` and ``creationTimestamp`` are set when a resource is created and kept after."""

    name: str | None = None
    namespace: str | None = None
    labels: Labels | None = None
    annotations: Annotations | None = None
    resourceVersion: str | None = None
    uid: str | None = None
    creationTimestamp: str | None = None


DEFAULT_NAMESPACE = "default"


def effective_namespace(namespaced: bool, metadata: object) -> str | None:
    """The namespace of an applied document's ``metadata``: ``default`` when a namespaced
    kind leaves it out, None for a cluster-scoped kind (or a malformed value)."""
    if not namespaced:
        return None
    value = metadata.get("namespace") if isinstance(metadata, dict) else None
    if value is None:
        return DEFAULT_NAMESPACE
    return value if isinstance(value, str) else None


class Resource(StrictModel):
    """One resource document: ``apiVersion``, ``kind``, ``metadata`` (+ ``spec``).

    Subclasses set the class constants; the name and namespace rules are checked here once.
    A namespaced resource without ``metadata.namespace`` is in ``default``. A document of
    one of ``ACCEPTED_API_VERSIONS`` (Calico's ``projectcalico.org/v3`` for the Calico
    kinds) is taken as ``API_VERSION``'s: the model holds ``API_VERSION``.
    """

    API_VERSION: ClassVar[str]
    ACCEPTED_API_VERSIONS: ClassVar[tuple[str, ...]] = ()
    KIND: ClassVar[str]
    NAMESPACED: ClassVar[bool] = False
    NAME_RULE: ClassVar[Callable[[str], str | None]] = staticmethod(names.dns1123_subdomain)

    apiVersion: str
    kind: str
    metadata: ObjectMeta

    @model_validator(mode="before")
    @classmethod
    def _default_namespace(cls, data: object) -> object:
        if cls.NAMESPACED and isinstance(data, dict):
            meta = data.get("metadata")
            if isinstance(meta, dict) and meta.get("namespace") is None:
                namespace = effective_namespace(True, meta)
                data = {**data, "metadata": {**meta, "namespace": namespace}}
        return data

    @model_validator(mode="after")
    def _identity(self) -> Resource:
        if self.apiVersion in self.ACCEPTED_API_VERSIONS:
            self.apiVersion = self.API_VERSION
        if self.apiVersion != self.API_VERSION:
            raise FieldError(
                f"Unsupported value: {show(self.apiVersion)}: {self.KIND} is {self.API_VERSION}",
                "apiVersion",
            )
        if self.kind != self.KIND:
            raise FieldError(f"Unsupported value: {show(self.kind)}", "kind")
        name = self.metadata.name
        if not name:
            raise FieldError("Required value: name is required", "metadata", "name")
        why = type(self).NAME_RULE(name)
        if why is not None:
            raise FieldError(why, "metadata", "name", value=name)
        namespace = self.metadata.namespace
        if not self.NAMESPACED:
            if namespace is not None:
                raise FieldError("Forbidden: not allowed on this type", "metadata", "namespace")
        elif namespace is not None:
            why = names.dns1123_label(namespace)
            if why is not None:
                raise FieldError(why, "metadata", "namespace", value=namespace)
        return self

    @property
    def name(self) -> str:
        assert self.metadata.name is not None  # checked by _identity
        return self.metadata.name

    @property
    def namespace(self) -> str | None:
        return self.metadata.namespace

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.metadata.labels or {})

    def wire(self) -> JSON:
        data = super().wire()
        return {"apiVersion": data.pop("apiVersion"), "kind": data.pop("kind"), **data}
