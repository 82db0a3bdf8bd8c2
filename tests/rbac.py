"""manifests/tabby.yaml's RBAC read as the API server's RBAC authorizer reads it, and the
requests a component makes as RBAC sees them: what tests/unit/test_manifest_rbac.py (each
component's calls, against the fake API server) and tests/kubernetes/test_manifest.py (a real
API server's ``kubectl auth can-i``) check the manifest's roles with."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any, NamedTuple

import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "manifests" / "tabby.yaml"
NAMESPACE = "tabby-system"
#: the service accounts of the manifest, one per component
ACCOUNTS = ("tabby-node", "tabby-kube-controllers", "tabby-cni", "tabby-typha")


def manifest_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


class Call(NamedTuple):
    """One request as RBAC sees it."""

    group: str
    resource: str
    verb: str
    namespace: str | None
    name: str | None


def call_of(request: str) -> Call:
    """``GET /apis/tabby.io/v1/ippools/x`` (the fake's log) as a Call."""
    method, _, target = request.partition(" ")
    watch = target.endswith("?watch")
    path = urllib.parse.urlsplit(target.removesuffix("?watch")).path
    parts = path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    namespace = None
    if rest[0] == "namespaces" and len(rest) > 2:
        namespace, rest = rest[1], rest[2:]
    elif rest[0] == "namespaces" and len(rest) == 2:
        namespace = rest[1]  # one namespace is in itself, as the API server's RBAC sees it
    resource, name = rest[0], rest[1] if len(rest) > 1 else None
    verb = {"POST": "create", "PUT": "update", "DELETE": "delete", "PATCH": "patch"}.get(method)
    if verb is None:
        verb = "watch" if watch else ("get" if name else "list")
    return Call(group, resource, verb, namespace, name)


class Atom(NamedTuple):
    """One verb on one resource (of some names) that a rule grants."""

    group: str
    resource: str
    verb: str
    namespace: str | None  # a Role's namespace (None: cluster-wide)
    names: frozenset[str]  # resourceNames (empty: any)

    def grants(self, call: Call) -> bool:
        if (self.group, self.resource, self.verb) != (call.group, call.resource, call.verb):
            return False
        if self.namespace is not None and call.namespace != self.namespace:
            return False
        return not self.names or call.name in self.names


def _docs(kind: str) -> list[dict[str, Any]]:
    return [d for d in manifest_docs() if d["kind"] == kind]


def granted(account: str) -> set[Atom]:
    """What the manifest grants service account ``account`` of tabby-system."""
    out: set[Atom] = set()
    subject = {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    for binding_kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        for binding in _docs(binding_kind):
            if subject not in binding["subjects"]:
                continue
            ref = binding["roleRef"]
            assert ref["kind"] == role_kind
            (role,) = [r for r in _docs(role_kind) if r["metadata"]["name"] == ref["name"]]
            where = role["metadata"].get("namespace") if role_kind == "Role" else None
            for rule in role["rules"]:
                names = frozenset(rule.get("resourceNames", ()))
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            out.add(Atom(group, resource, verb, where, names))
    return out
