"""Who reads a node's denied-flow log in Kubernetes (docs/kubernetes.md "Who reads the policy
log"), on the bird cluster (the Kubernetes datastore; tabby-node with the manifest's account
and RBAC, tests/kubernetes/conftest.py): a pod on node-1 asks node-2's
``:9091/policy/log``. Without a token: 401; with a token of a service account no role
allows: 403; with a token made for the API server (not for tabby-node): 401; with the
token of an account bound to the manifest's ``tabby-policy-log-reader``, or tabby-node's
own: the log. ``/metrics`` stays open. The API server did the reviews (tabby-node's
``tabby_http_refusals_total`` counts the refusals). A policy trace across nodes still
works (it passes through the API, not through the port)."""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import Iterator

import pytest

from daemon.http import parse_exposition
from lab.kubernetes.cluster import KubeLab, KubePod
from tabbyctl.demo.lab import http_get

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.parametrize("kube_lab", ["bird"], indirect=True),
]

AUDIENCE = "tabby-node"  # tabby_node.options.DEFAULT_LOG_AUDIENCE


@pytest.fixture
def scratch(kube_lab: KubeLab) -> Iterator[str]:
    ns = f"plog-{secrets.token_hex(3)}"
    kube_lab.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    yield ns
    kube_lab.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    kube_lab.kubectl("delete", "clusterrolebinding", f"{ns}-reader", check=False)


def token(kube: KubeLab, namespace: str, account: str, audience: str | None = AUDIENCE) -> str:
    """A token of ``namespace/account`` made for ``audience`` (TokenRequest, as a projected
    volume gets one); None: its legacy Secret's token (made for the API server)."""
    if audience is None:

        def legacy() -> str | None:
            sa = kube.kubectl_json("get", "serviceaccount", "-n", namespace, account)
            for ref in sa.get("secrets") or []:
                secret = kube.kubectl_json("get", "secret", "-n", namespace, ref["name"])
                value = (secret.get("data") or {}).get("token")
                if value:
                    return base64.b64decode(value).decode()
            return None

        return kube.wait_for(f"the token of {namespace}/{account}", legacy, 60)
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"audiences": [audience], "expirationSeconds": 600},
    }
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token"
    out = kube.kubectl("create", "--raw", path, "-f", "-", input=json.dumps(request)).stdout
    return str(json.loads(out)["status"]["token"])


def ask(kube: KubeLab, pod: KubePod, url: str, bearer: str | None = None) -> str:
    """What busybox's wget in ``pod`` got: the body, or its error line (the status)."""
    header = ["--header", f"Authorization: Bearer {bearer}"] if bearer else []
    # busybox 1.35's wget -T segfaults: its timeout applet bounds it instead
    proc = kube.exec(pod, ["timeout", "10", "wget", "-q", "-O", "-", *header, url], timeout=60)
    return proc.stdout if proc.returncode == 0 else proc.stderr.strip()


def test_another_nodes_log_is_served_to_the_tokens_rbac_allows(
    kube_lab: KubeLab, scratch: str
) -> None:
    kube = kube_lab
    for account in ("reader", "nobody"):
        kube.apply(
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": account, "namespace": scratch},
            }
        )
    kube.kubectl(
        "create",
        "clusterrolebinding",
        f"{scratch}-reader",
        "--clusterrole=tabby-policy-log-reader",
        f"--serviceaccount={scratch}:reader",
    )
    kube.apply(kube.sleeper_pod("client", scratch, {"app": "client"}, nodeName="node-1"))
    (client,) = kube.wait_pods(scratch, "app=client", 1)
    node2 = kube.node("node-2")
    url = f"http://{node2.ipv4.ip}:9091/policy/log?since=0"

    assert "401" in ask(kube, client, url)
    assert "403" in ask(kube, client, url, token(kube, scratch, "nobody"))
    assert "401" in ask(kube, client, url, token(kube, scratch, "reader", audience=None))
    answer = json.loads(ask(kube, client, url, token(kube, scratch, "reader")))
    assert answer["node"] == "node-2"
    own = token(kube, "tabby-system", "tabby-node")
    assert json.loads(ask(kube, client, url, own))["node"] == "node-2"
    # /metrics and health need nothing
    metrics = ask(kube, client, f"http://{node2.ipv4.ip}:9091/metrics")
    assert "tabby_node_up 1.0" in metrics
    samples = parse_exposition(metrics)
    refused = {
        code: samples.get(f'tabby_http_refusals_total{{code="{code}",path="/policy/log"}}', 0)
        for code in ("401", "403")
    }
    assert refused["401"] >= 2
    assert refused["403"] >= 1
    # on the node itself: no token needed
    code, body = http_get(node2.netns, "http://127.0.0.1:9091/policy/log?since=0")
    assert code == 200, body


def test_a_policy_trace_across_nodes_still_works(kube_lab: KubeLab, scratch: str) -> None:
    kube = kube_lab
    for name, node in (("src", "node-1"), ("dst", "node-2")):
        kube.apply(kube.sleeper_pod(name, scratch, {"app": name}, nodeName=node))
    kube.wait_pods(scratch, "app=src", 1)
    kube.wait_pods(scratch, "app=dst", 1)
    argv = [*kube.tabbyctl_bin, *kube.datastore_flags(), "policy", "trace"]
    proc = kube.run_on(
        "node-1", [*argv, f"{scratch}/src", f"{scratch}/dst", "--port", "8080", "-o", "json"]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["agree"], answer
    ingress = answer["kernel"]["ingress"]
    assert ingress["node"] == "node-2"
    assert ingress["verdict"] in ("allowed", "not policed"), answer
