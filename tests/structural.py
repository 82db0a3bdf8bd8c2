"""What a Kubernetes 1.20 API server does with a custom resource and its CRD's schema, for
tests: the rules a schema must follow to be structural (:func:`structural_problems`), the
pruning of what the schema does not declare (:func:`prune`), and the validation
(:func:`validate`), each as apiextensions-apiserver 1.20 does them; :func:`admit` is a
create or an update.

Checked against a real kube-apiserver 1.20 (tests/kubernetes/test_crds.py runs the same
table of documents there). Where this model is simpler than the API server:

- when no alternative of an ``anyOf``/``oneOf`` holds, the API server reports the errors of
  the alternative that examined the most (go-openapi's ``MatchCount``, ties to the first);
  here, of the first one (tabby's schemas are written so that these agree: the rule first,
  its escape second);
- formats are not checked (tabby's schemas use none);
- ``x-kubernetes-int-or-string`` takes only its own form (``anyOf`` of ``type: integer``
  and ``type: string``, value checks in ``allOf``), and ``additionalProperties`` only a
  schema (a map's values), as tabby's schemas write them.

Patterns are Go regular expressions searched in the value: ``$`` is the end of the text
(Python's ``\\Z``), and what RE2 does not have (look-arounds, back-references) is refused.
"""

from __future__ import annotations

import re
from typing import Any

JUNCTORS = ("allOf", "anyOf", "oneOf", "not")
#: what a schema inside a junctor may not say (the types and the rest are the outer schema's)
NOT_IN_JUNCTORS = (
    "type",
    "description",
    "default",
    "nullable",
    "additionalProperties",
    "title",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-int-or-string",
    "x-kubernetes-embedded-resource",
)
VALUE_CHECKS = (
    "enum",
    "pattern",
    "maxLength",
    "minLength",
    "minimum",
    "maximum",
    "maxItems",
    "minItems",
    "required",
    "properties",
    "items",
    *JUNCTORS,
)
KNOWN = (*VALUE_CHECKS, *NOT_IN_JUNCTORS, "format")
TYPES = ("object", "array", "string", "integer", "number", "boolean")

Errors = list[tuple[str, str]]


# -- patterns ----------------------------------------------------------------------------------

_RE2_MISSING = re.compile(r"\(\?[=!<]|\\[1-9]|\(\?P=")
_compiled: dict[str, re.Pattern[str]] = {}


def go_regexp(pattern: str) -> re.Pattern[str]:
    """``pattern`` as Go's regexp reads it (RE2, ``$`` the end of the text)."""
    found = _compiled.get(pattern)
    if found is None:
        if _RE2_MISSING.search(pattern):
            raise ValueError(f"not an RE2 pattern (look-around or back-reference): {pattern}")
        python = re.sub(r"(?<!\\)\$", r"\\Z", pattern)
        found = _compiled[pattern] = re.compile(python)
    return found


# -- structural rules --------------------------------------------------------------------------


def structural_problems(schema: dict[str, Any]) -> list[str]:
    """Where ``schema`` (an ``openAPIV3Schema``) breaks the rules of a structural schema."""
    out: list[str] = []
    if schema.get("type") != "object":
        out.append("the root must be of type object")
    _outer(schema, "", out, root=True)
    meta = (schema.get("properties") or {}).get("metadata")
    if meta is not None:
        extra = set(meta) - {"type", "properties"}
        names = set(meta.get("properties") or {}) - {"name", "generateName"}
        if extra or names or meta.get("type") != "object":
            out.append("metadata: only its type and restrictions of name and generateName")
        for field, sub in (meta.get("properties") or {}).items():
            if sub.get("type") != "string":
                out.append(f"metadata.{field}: must be of type string")
    return out


def _outer(node: dict[str, Any], path: str, out: list[str], *, root: bool = False) -> None:
    unknown = set(node) - set(KNOWN)
    if unknown:
        out.append(f"{path or '<root>'}: unknown keys {sorted(unknown)}")
    preserved = node.get("x-kubernetes-preserve-unknown-fields") is True
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    if int_or_string and node.get("anyOf") != [{"type": "integer"}, {"type": "string"}]:
        out.append(f"{path}: x-kubernetes-int-or-string needs anyOf of integer and string")
    if "type" not in node and not preserved and not int_or_string:
        out.append(f"{path or '<root>'}: no type")
    elif "type" in node and node["type"] not in TYPES:
        out.append(f"{path}: unknown type {node['type']}")
    if "additionalProperties" in node and "properties" in node:
        out.append(f"{path}: additionalProperties and properties together")
    _values(node, path, out)
    for name, sub in (node.get("properties") or {}).items():
        _outer(sub, f"{path}.{name}" if path else name, out)
    if "items" in node:
        _outer(node["items"], f"{path}[*]", out)
    if isinstance(node.get("additionalProperties"), dict):
        _outer(node["additionalProperties"], f"{path}[*]", out)
    for junctor in JUNCTORS:
        for i, sub in enumerate(_alternatives(node, junctor)):
            if int_or_string and junctor == "anyOf":
                continue  # its two types (checked above)
            _inner(sub, node, f"{path}.{junctor}[{i}]", out)


def _inner(node: dict[str, Any], outer: dict[str, Any], path: str, out: list[str]) -> None:
    """A schema inside a junctor: value checks only, on fields the outer schema declares."""
    said = [k for k in node if k in NOT_IN_JUNCTORS]
    if said:
        out.append(f"{path}: {said} may only be said outside a junctor")
    unknown = set(node) - set(KNOWN)
    if unknown:
        out.append(f"{path}: unknown keys {sorted(unknown)}")
    _values(node, path, out)
    declared = outer.get("properties") or {}
    for name, sub in (node.get("properties") or {}).items():
        if name not in declared:
            out.append(f"{path}.properties.{name}: not declared outside the junctor")
            continue
        _inner(sub, declared[name], f"{path}.{name}", out)
    if "items" in node:
        if "items" not in outer:
            out.append(f"{path}.items: not declared outside the junctor")
        else:
            _inner(node["items"], outer["items"], f"{path}[*]", out)
    for junctor in JUNCTORS:
        for i, sub in enumerate(_alternatives(node, junctor)):
            _inner(sub, outer, f"{path}.{junctor}[{i}]", out)


def _values(node: dict[str, Any], path: str, out: list[str]) -> None:
    if "pattern" in node:
        try:
            go_regexp(node["pattern"])
        except (ValueError, re.error) as e:
            out.append(f"{path}.pattern: {e}")
    for field in ("required",):
        if field in node and not (
            isinstance(node[field], list) and all(isinstance(x, str) for x in node[field])
        ):
            out.append(f"{path}.{field}: a list of field names")


def _alternatives(node: dict[str, Any], junctor: str) -> list[dict[str, Any]]:
    value = node.get(junctor)
    if value is None:
        return []
    return [value] if junctor == "not" else list(value)


# -- pruning -----------------------------------------------------------------------------------


def prune(value: Any, schema: dict[str, Any], *, root: bool = False) -> Any:
    """What the API server keeps of ``value``: the fields its schema declares (everything
    below ``x-kubernetes-preserve-unknown-fields``), without the nulls of fields that are
    not ``nullable``; at the root ``apiVersion``, ``kind`` and ``metadata`` as they are."""
    if isinstance(value, dict) and (schema.get("type") == "object" or "properties" in schema):
        declared = schema.get("properties") or {}
        keep = schema.get("x-kubernetes-preserve-unknown-fields") is True
        values = schema.get("additionalProperties")
        out = {}
        for key, item in value.items():
            if root and key in ("apiVersion", "kind", "metadata"):
                out[key] = item
            elif isinstance(values, dict):
                out[key] = prune(item, values)
            elif key in declared:
                sub = declared[key]
                if item is None and not sub.get("nullable"):
                    continue  # 1.20: the null of a field that is not nullable is dropped
                out[key] = prune(item, sub)
            elif keep:
                out[key] = item
        return out
    if isinstance(value, list) and "items" in schema:
        return [prune(item, schema["items"]) for item in value]
    return value


# -- validation --------------------------------------------------------------------------------


def validate(value: Any, schema: dict[str, Any], path: str = "") -> Errors:
    """The errors of ``value`` against ``schema``, as ``(field path, message)``."""
    if value is None:
        if schema.get("nullable"):
            return []
        if "type" in schema:
            return [(path, f"must be of type {schema['type']}: null")]
    if "type" in schema and not _has_type(value, schema["type"]):
        return [(path, f"must be of type {schema['type']}: {_json_type(value)}")]
    errors: Errors = []
    errors += _scalar(value, schema, path)
    if isinstance(value, dict):
        for name in schema.get("required") or ():
            if name not in value:
                errors.append((_join(path, name), "Required value"))
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                errors += validate(value[name], sub, _join(path, name))
        values = schema.get("additionalProperties")
        if isinstance(values, dict):
            for name, item in value.items():
                errors += validate(item, values, f"{path}[{name}]")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += validate(item, schema["items"], f"{path}[{i}]")
    errors += _junctors(value, schema, path)
    return errors


def _scalar(value: Any, schema: dict[str, Any], path: str) -> Errors:
    errors: Errors = []
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        errors.append((path, f"Unsupported value: {value!r}: supported values: {schema['enum']}"))
    if isinstance(value, str):
        if "pattern" in schema and not go_regexp(schema["pattern"]).search(value):
            errors.append((path, f"should match '{schema['pattern']}'"))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append((path, f"should be at most {schema['maxLength']} chars long"))
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append((path, f"should be at least {schema['minLength']} chars long"))
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append((path, f"should be greater than or equal to {schema['minimum']}"))
        if "maximum" in schema and value > schema["maximum"]:
            errors.append((path, f"should be less than or equal to {schema['maximum']}"))
    return errors


def _junctors(value: Any, schema: dict[str, Any], path: str) -> Errors:
    errors: Errors = []
    where = path or "<root>"
    for sub in schema.get("allOf") or ():
        errors += validate(value, sub, path)
    alternatives = [validate(value, sub, path) for sub in schema.get("anyOf") or ()]
    if alternatives and all(alternatives):
        errors.append((where, "must validate at least one schema (anyOf)"))
        errors += alternatives[0]
    branches = [validate(value, sub, path) for sub in schema.get("oneOf") or ()]
    if branches and sum(1 for b in branches if not b) != 1:
        errors.append((where, "must validate one and only one schema (oneOf)"))
        failed = [b for b in branches if b]
        if failed and not any(not b for b in branches):
            errors += failed[0]
    if "not" in schema and not validate(value, schema["not"], path):
        errors.append((where, "must not validate the schema (not)"))
    return errors


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _has_type(value: Any, kind: str) -> bool:
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":  # JSON numbers: 26.0 is an integer to the API server
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    raise ValueError(kind)


def _json_type(value: Any) -> str:
    for kind in ("boolean", "integer", "number", "string", "array", "object"):
        if _has_type(value, kind):
            return kind
    return "null"


def _same(a: Any, b: Any) -> bool:
    return (type(a) is type(b) and a == b) or (_has_type(a, "number") and a == b)


# -- a write -----------------------------------------------------------------------------------


def admit(obj: dict[str, Any], schema: dict[str, Any]) -> tuple[dict[str, Any], Errors]:
    """What a create or an update of ``obj`` keeps, and the errors that refuse it. The
    object's ``metadata.name`` checked against the schema's restrictions of it, its
    namespace dropped (tabby's kinds are cluster-scoped)."""
    kept = prune(obj, schema, root=True)
    meta = dict(kept.get("metadata") or {})
    meta.pop("namespace", None)
    kept["metadata"] = meta
    checked = {k: v for k, v in kept.items() if k != "metadata"}
    errors = validate(checked, {**schema, "properties": _without_metadata(schema)})
    name_schema = ((schema.get("properties") or {}).get("metadata") or {}).get("properties") or {}
    for field, sub in name_schema.items():
        if field in meta:
            errors += validate(meta[field], sub, f"metadata.{field}")
    return kept, errors


def _without_metadata(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
