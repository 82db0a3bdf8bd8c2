"""manifests/tabby.yaml read as data: what PRODUCT "Installing on Kubernetes" asks of it and
what the programs it runs expect of it, so that a change on either side that breaks the other
fails here (the manifest is applied to a real API server, and run, by
tests/kubernetes/test_manifest.py)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from bundle import __version__
from cni_config.resolve import SOURCES
from tabby_node.options import ENV as NODE_ENV
from tests import REPO_ROOT as ROOT

DOCS = [d for d in yaml.safe_load_all((ROOT / "manifests" / "tabby.yaml").read_text()) if d]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    (doc,) = [d for d in DOCS if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return doc


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container.get("env", [])}


def test_one_file_in_one_namespace() -> None:
    kinds = [(d["kind"], d["metadata"]["name"]) for d in DOCS]
    assert kinds[0] == ("Namespace", "tabby-system")
    for doc in DOCS:
        if doc["kind"] not in (
            "Namespace",
            "ClusterRole",
            "ClusterRoleBinding",
            "CustomResourceDefinition",
        ):
            assert doc["metadata"]["namespace"] == "tabby-system", doc["metadata"]
    for kind in ("ConfigMap", "DaemonSet", "Deployment"):
        assert kind in {k for k, _ in kinds}


def test_every_image_is_this_version() -> None:
    """A new version needs the manifest's image tag changed with it."""
    for doc in (one("DaemonSet"), one("Deployment", "tabby-kube-controllers")):
        for c in containers(doc):
            assert c["image"] == f"localhost/tabby:{__version__}", c["name"]
            assert c["imagePullPolicy"] == "IfNotPresent"  # an imported image, or a pull


def test_the_daemonset_is_a_node_agent() -> None:
    ds = one("DaemonSet", "tabby-node")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in spec["tolerations"]  # every taint
    assert spec["serviceAccountName"] == "tabby-node"
    assert spec.get("automountServiceAccountToken", True) is True  # the Kubernetes datastore
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1},
    }
    (init,) = spec["initContainers"]
    assert init["command"][1:3] == ["node", "install"]
    assert env_of(init)["TABBY_NODENAME"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "spec.nodeName"}
    }
    (node,) = spec["containers"]
    assert "privileged" not in node["securityContext"]  # test_privileges.py: what it holds
    assert node["command"] == ["/opt/tabby/current/tabby-node"]
    for probe, path in (("livenessProbe", "/liveness"), ("readinessProbe", "/readiness")):
        assert node[probe]["httpGet"] == {"host": "127.0.0.1", "port": 9099, "path": path}
    # the host paths it needs, and no others
    host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert host_paths == {
        "/opt/tabby",
        "/opt/cni/bin",
        "/etc/cni/net.d",
        "/var/lib/tabby",
        "/run/tabby",
    }
    mounts = {m["mountPath"]: m for m in node["volumeMounts"]}
    assert mounts["/opt/tabby"].get("readOnly") is True  # it runs the installed copy
    # an uninstall removes the conflist the init container wrote (tabby_node.uninstall), in
    # a directory tabbyctl does not read by default: run in this container it would act
    # with the plugins' token (tabby-cni), not tabby-node's account
    assert mounts["/host/etc/cni/net.d"].get("readOnly") is not True
    assert "/etc/cni/net.d" not in mounts
    env = {e["name"]: e.get("value") for e in node["env"]}
    assert env["TABBY_CNI_CONF_DIR"] == "/host/etc/cni/net.d"
    assert "/opt/cni/bin" not in mounts
    # its own DaemonSet, read when it stops (gone or being deleted: an uninstall)
    meta = ds["metadata"]
    assert env_of(node)["TABBY_DAEMONSET"] == {
        "name": "TABBY_DAEMONSET",
        "value": f"{meta['namespace']}/{meta['name']}",
    }


def test_the_deployment_elects_a_leader_with_its_own_account() -> None:
    dep = one("Deployment", "tabby-kube-controllers")
    assert dep["spec"]["replicas"] == 2
    spec = dep["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "tabby-kube-controllers"
    (c,) = spec["containers"]
    args = c["args"]
    lease_ns = args[args.index("--lease-namespace") + 1]
    role = one("Role", "tabby-kube-controllers-lease")
    assert role["metadata"]["namespace"] == lease_ns
    # the ports keep two replicas off one node (host network)
    assert {p["containerPort"] for p in c["ports"]} == {9094, 9098}


def test_the_variables_set_are_the_ones_the_programs_read() -> None:
    from tabbyctl.policy import log_cmd

    # tabby-node's, the datastore's, and tabbyctl policy log's (kubectl exec runs it there)
    tabbyctl = {str(p.envvar) for p in log_cmd.params if p.envvar}
    known = set(NODE_ENV.values()) | {var for _, var in SOURCES.values()} | tabbyctl
    installer = {
        "TABBY_CNI_NETWORK_CONFIG",
        "TABBY_DATASTORE_TYPE",
        "TABBY_CNI_MTU",
        "TABBY_NODENAME",
        "TABBY_ETCD_ENDPOINTS",
        "TABBY_ETCD_PREFIX",
        "TABBY_ETCD_CA_CERT_FILE",
        "TABBY_ETCD_CERT_FILE",
        "TABBY_ETCD_KEY_FILE",
        "TABBY_IPV4_POOL",
        "TABBY_IPV6_POOL",
        "TABBY_LOG_LEVEL",
    }
    ds = one("DaemonSet")
    init, node = containers(ds)
    assert set(env_of(init)) == installer
    assert {n for n in env_of(node) if n.startswith("TABBY_")} <= known
    (ctl,) = containers(one("Deployment", "tabby-kube-controllers"))
    assert {n for n in env_of(ctl) if n.startswith("TABBY_")} <= known | {"TABBY_LOG_LEVEL"}
    from typha.options import ENV as TYPHA_ENV

    (typha,) = containers(one("Deployment", "tabby-typha"))
    typha_known = set(TYPHA_ENV.values()) | {var for _, var in SOURCES.values()}
    assert {n for n in env_of(typha) if n.startswith("TABBY_")} <= typha_known


def test_typha_is_served_to_every_node_with_the_names_the_certificates_carry() -> None:
    """tabby-node reads typha's Service; each side mounts its own Secret (the controllers
    make both) and checks the other's name; the Service's port is the one typha serves."""
    from kube_controllers import typha_certs

    _, node = containers(one("DaemonSet", "tabby-node"))
    (typha,) = containers(one("Deployment", "tabby-typha"))
    (ctl,) = containers(one("Deployment", "tabby-kube-controllers"))
    service = one("Service", "tabby-typha")
    env = {e["name"]: e.get("value") for e in node["env"]}
    assert env["TABBY_TYPHA_SERVICE"] == f"tabby-system/{service['metadata']['name']}"
    assert env["TABBY_TYPHA_CN"] == typha_certs.SERVER_NAME
    typha_env = {e["name"]: e.get("value") for e in typha["env"]}
    assert typha_env["TABBY_TYPHA_CLIENT_CN"] == typha_certs.CLIENT_NAME
    assert ctl["args"][ctl["args"].index("--typha-certs") + 1] == "tabby-system"

    def secrets(kind: str, name: str) -> set[str]:
        spec = one(kind, name)["spec"]["template"]["spec"]
        return {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}

    assert typha_certs.CLIENT_SECRET in secrets("DaemonSet", "tabby-node")
    assert typha_certs.SERVER_SECRET not in secrets("DaemonSet", "tabby-node")
    assert typha_certs.SERVER_SECRET in secrets("Deployment", "tabby-typha")
    assert typha_certs.CLIENT_SECRET not in secrets("Deployment", "tabby-typha")
    assert typha_certs.CA_SECRET not in secrets("Deployment", "tabby-typha")
    assert typha_certs.CA_SECRET not in secrets("DaemonSet", "tabby-node")
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["port"]) == ("typha", 5473)
    assert {"name": "typha", "containerPort": 5473} in typha["ports"]
    spec = one("Deployment", "tabby-typha")["spec"]
    assert spec["template"]["spec"]["hostNetwork"] is True
    assert spec["replicas"] >= 2
    anti = spec["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == (
        "kubernetes.io/hostname"
    )
    pdb = one("PodDisruptionBudget", "tabby-typha")["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["selector"] == spec["selector"]


def _doc_table(heading: str) -> dict[str, str]:
    """The table under the heading line ``heading`` of docs/kubernetes.md's "Installing on
    Kubernetes" (up to the next heading): its first column (a `key`) -> its second
    (backquotes off)."""
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    section = doc[doc.index("\n## Installing on Kubernetes\n") :]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    part = section[section.index(f"\n{heading}\n") + 1 :]
    part = part[: part.index("\n#", 1)] if "\n#" in part[1:] else part
    rows = re.findall(r"^\| `([A-Za-z0-9_.-]+)` \| ([^|]*) \|", part, re.M)
    return {key: default.strip().strip("`") for key, default in rows}


def test_every_configmap_key_is_used_and_documented() -> None:
    """docs/kubernetes.md's table of ConfigMap keys is the ConfigMap's: every key, none more,
    each with the manifest's default."""
    data = one("ConfigMap", "tabby-config")["data"]
    used = {
        e["valueFrom"]["configMapKeyRef"]["key"]
        for doc in (one("DaemonSet"), one("Deployment", "tabby-kube-controllers"))
        for c in containers(doc)
        for e in c.get("env", [])
        if "configMapKeyRef" in e.get("valueFrom", {})
    }
    assert used == set(data)
    table = _doc_table("### 2. The settings (ConfigMap `tabby-config`)")
    assert list(table) == list(data), "the documented keys, in the manifest's order"
    for key, value in data.items():
        if key == "cni_network_config":
            assert table[key] == "the conflist below"
        else:
            assert table[key] == (value if value else '""'), key


def test_the_optional_objects_are_documented() -> None:
    """What the pods take from objects the manifest does not create: the Secret's keys
    (mounted, named by the ConfigMap's etcd_* defaults in docs/kubernetes.md) and the
    optional ConfigMap tabby-kubernetes-api's keys, each in docs/kubernetes.md's table of
    them."""
    ds = one("DaemonSet")
    (ctl,) = containers(one("Deployment", "tabby-kube-controllers"))
    secrets = {
        v["secret"]["secretName"]
        for doc in (ds, one("Deployment", "tabby-kube-controllers"))
        for v in doc["spec"]["template"]["spec"]["volumes"]
        if "secret" in v and v["secret"].get("optional")
    }
    assert secrets == {"tabby-etcd-secrets", "tabby-metrics-tls"}
    table = _doc_table("#### etcd over TLS: the Secret `tabby-etcd-secrets`")
    assert set(table) == {"etcd-ca", "etcd-cert", "etcd-key"}
    for key, path in table.items():
        assert path == f"/etc/tabby/etcd-secrets/{key}"
    table = _doc_table("#### The metrics port over TLS: the Secret `tabby-metrics-tls`")
    assert set(table) == {"tls.crt", "tls.key", "ca.crt"}
    for key, path in table.items():
        assert path == f"/etc/tabby/metrics-tls/{key}"
    for container in (*containers(ds), ctl):  # the installer, tabby-node, the controllers
        (ref,) = container["envFrom"]
        assert ref["configMapRef"] == {"name": "tabby-kubernetes-api", "optional": True}
    api = _doc_table("#### Without kube-proxy: the ConfigMap `tabby-kubernetes-api`")
    assert set(api) == {"KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"}


# -- the Kubernetes datastore, as shipped ------------------------------------------------------


def test_the_kubernetes_datastore_is_the_default_and_etcd_one_configmap_change() -> None:
    """Every program takes its datastore from the ConfigMap's datastore_type ("kubernetes"
    as shipped), the conflist template too: etcd mode is that key (and the endpoints)."""
    data = one("ConfigMap", "tabby-config")["data"]
    assert data["datastore_type"] == "kubernetes"
    for doc in (one("DaemonSet"), one("Deployment", "tabby-kube-controllers")):
        for c in containers(doc):
            ref = env_of(c)["TABBY_DATASTORE_TYPE"]["valueFrom"]["configMapKeyRef"]
            assert ref == {"name": "tabby-config", "key": "datastore_type"}, c["name"]
    ipam = data["cni_network_config"]
    assert '"datastore_type": __DATASTORE_TYPE__' in ipam
    assert '"kubeconfig": __KUBECONFIG__' in ipam
    # the manifest's own comment says the change, and it is one line of the ConfigMap
    text = (ROOT / "manifests" / "tabby.yaml").read_text()
    assert 's#datastore_type: "kubernetes"#datastore_type: "etcdv3"#' in text
    assert text.count('datastore_type: "kubernetes"') == 2  # the key, and the comment's sed


def test_the_plugins_have_an_account_of_their_own() -> None:
    """tabby-cni: no pod runs as it; its token Secret (filled in by the token controller)
    is mounted into the installer only, where ``tabbyctl node install`` reads it."""
    from tabbyctl.install import CNI_CREDENTIALS

    sa = one("ServiceAccount", "tabby-cni")
    assert sa["automountServiceAccountToken"] is False
    secret = one("Secret", "tabby-cni-token")
    assert secret["type"] == "kubernetes.io/service-account-token"
    assert secret["metadata"]["annotations"] == {"kubernetes.io/service-account.name": "tabby-cni"}
    kinds = [(d["kind"], d["metadata"]["name"]) for d in DOCS]
    # the token controller deletes a token Secret whose account does not exist (yet)
    assert kinds.index(("ServiceAccount", "tabby-cni")) < kinds.index(("Secret", "tabby-cni-token"))
    spec = one("DaemonSet")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "cni-token"]
    assert volume["secret"]["secretName"] == "tabby-cni-token"
    assert {i["key"] for i in volume["secret"]["items"]} == {"token", "ca.crt"}
    assert "optional" not in volume["secret"]  # a node waits for its token
    (init,) = spec["initContainers"]
    mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert mounts["cni-token"]["mountPath"] == CNI_CREDENTIALS
    assert mounts["cni-token"]["readOnly"] is True
    for c in spec["containers"]:
        assert "cni-token" not in {m["name"] for m in c["volumeMounts"]}
    for doc in DOCS:
        if doc["kind"] in ("DaemonSet", "Deployment"):
            assert doc["spec"]["template"]["spec"]["serviceAccountName"] != "tabby-cni"


def test_the_labs_install_is_the_documented_one() -> None:
    """lab.kubernetes.manifest (the Kubernetes tier's install): as shipped, the ConfigMap
    untouched but the backend; etcd mode, the documented change (datastore_type) and the
    lab's etcd."""
    from lab.kubernetes.manifest import render

    text = (ROOT / "manifests" / "tabby.yaml").read_text()
    lab = {"endpoints": ["http://10.1.0.1:2379"], "prefix": "/lab", "backend": "vxlan"}

    def config(rendered: str) -> dict[str, str]:
        docs = [d for d in yaml.safe_load_all(rendered) if d]
        (cm,) = [
            d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "tabby-config"
        ]
        return dict(cm["data"])

    shipped, data = config(render(text, **lab)), config(text)
    assert shipped == {**data, "backend": "vxlan"}
    etcd = config(render(text, **lab, datastore="etcdv3"))
    assert etcd == {
        **data,
        "backend": "vxlan",
        "datastore_type": "etcdv3",
        "etcd_endpoints": "http://10.1.0.1:2379",
        "etcd_prefix": "/lab",
    }


def test_tabby_node_may_read_its_kinds_definitions_and_nothing_else_of_them() -> None:
    """tabby-node reads a definition before it follows a deletion of its objects (an uninstall
    deletes them all: stores.kube.sync): ``get`` of exactly tabby's definitions."""
    from stores.kube.kinds import CRDS

    rules = [
        r
        for r in one("ClusterRole", "tabby-node")["rules"]
        if "apiextensions.k8s.io" in r["apiGroups"]
    ]
    assert rules == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "resourceNames": [crd.name for crd in CRDS.values()],
            "verbs": ["get"],
        }
    ]


# -- who reads the policy log ------------------------------------------------------------------


def test_the_policy_log_is_for_tokens_the_api_server_reviews() -> None:
    """tabby-node may review tokens (TokenReview, SubjectAccessReview) and read other
    nodes' logs with its own token, which is made for tabby-node's audience only (the API
    server does not take it) and found by tabbyctl in its pod; the reader role is bound to
    no one; the rule the reviews ask about is the one the role grants."""
    from tabby_node.access import API_GROUP, PRIVATE, RESOURCE, VERB
    from tabby_node.options import DEFAULT_LOG_AUDIENCE

    rules = one("ClusterRole", "tabby-node")["rules"]
    for group, resource in (
        ("authentication.k8s.io", "tokenreviews"),
        ("authorization.k8s.io", "subjectaccessreviews"),
    ):
        assert {"apiGroups": [group], "resources": [resource], "verbs": ["create"]} in rules
    reading = {
        "apiGroups": [API_GROUP],
        "resources": [f"{RESOURCE}/{PRIVATE['/policy/log']}"],
        "verbs": [VERB],
    }
    assert reading in rules
    assert one("ClusterRole", "tabby-policy-log-reader")["rules"] == [reading]
    bound = {d["roleRef"]["name"] for d in DOCS if d["kind"].endswith("Binding")}
    assert "tabby-policy-log-reader" not in bound
    spec = one("DaemonSet")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "policy-log-token"]
    (source,) = volume["projected"]["sources"]
    token = source["serviceAccountToken"]
    assert token["audience"] == DEFAULT_LOG_AUDIENCE
    assert token["expirationSeconds"] <= 3600
    node = containers(one("DaemonSet"))[-1]
    (mount,) = [m for m in node["volumeMounts"] if m["name"] == "policy-log-token"]
    assert env_of(node)["TABBY_POLICY_LOG_TOKEN_FILE"]["value"] == (
        f"{mount['mountPath']}/{token['path']}"
    )
    # the metrics port's TLS: from the ConfigMap, files of the optional Secret
    for var in ("TABBY_METRICS_CERT_FILE", "TABBY_METRICS_KEY_FILE"):
        assert env_of(node)[var]["valueFrom"]["configMapKeyRef"]["name"] == "tabby-config"
    mounts = {m["name"]: m["mountPath"] for m in node["volumeMounts"]}
    assert mounts["metrics-tls"] == "/etc/tabby/metrics-tls"
