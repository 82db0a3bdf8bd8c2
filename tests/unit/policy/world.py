"""The truth table's cluster (tests/policy_truth_table.py) as the datastore holds it and
tabby-node reads it: for the unit tests of the policy inputs, the incremental engine and
tabby-node's dataplane passes, which all start from the same documents.

``PolicyWorld`` holds kind -> key -> document, every write a new revision: namespaces x, y,
z and their pods, one workload endpoint per pod on ``node`` (host interface
``cali<index>``), the policies given, and one IPAM pool with outgoing NAT.
``full_table`` is the nft table a fresh full apply of a snapshot leaves (tests/nft_model.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from datastore.base import Doc
from policy.engine import Policy
from policy.render import Renderer, Snapshot
from tests import policy_truth_table as tt
from tests.nft_model import NftModel

KINDS = ("networkpolicy", "namespace", "pod", "workloadendpoint", "pool")
NODE = "node1"
POOL = "10.244.0.0/16"
#: What the incremental engine's and the dataplane passes' tests start from: x's
#: deny-ingress and the policy of case 14.
TWO_POLICIES = (tt.DENY_INGRESS, tt.CASES[13].steps[0].policies[0])


class PolicyWorld:
    def __init__(self, policies: Iterable[Policy] = (), node: str = NODE) -> None:
        self.node = node
        self.rev = 0
        self.docs: dict[str, dict[str, Doc]] = {k: {} for k in KINDS}
        for doc in tt.setup_docs():
            meta = doc["metadata"]
            assert isinstance(meta, dict)
            key = f"{meta['namespace']}/{meta['name']}" if "namespace" in meta else meta["name"]
            self.put(str(doc["kind"]).lower(), str(key), doc)
        for i, pod in enumerate(tt.PODS):
            self.wep(pod, f"cali{i:011x}")
        for p in policies:
            self.put("networkpolicy", p.key, tt.network_policy(p))
        pool = {"cidr": POOL, "block_size": 26, "name": "p", "nat_outgoing": True}
        self.put("pool", POOL, pool)

    def put(self, kind: str, key: str, doc: Mapping[str, object]) -> None:
        """Store ``doc`` (a resource, its apiVersion and kind dropped) at a new revision."""
        self.rev += 1
        data = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind")}
        self.docs[kind][key] = Doc(data, self.rev)

    def wep(self, pod: str, iface: str, address: str | None = None) -> None:
        """The workload endpoint of ``pod`` (``ns/name``) on this world's node."""
        ns, name = pod.split("/")
        meta = {"name": f"{name}-eth0", "namespace": ns, "labels": {"pod": name}}
        spec = {
            "pod": name,
            "node": self.node,
            "containerID": f"c-{ns}-{name}",
            "interface": "eth0",
            "hostInterface": iface,
            "ipNetworks": [f"{address or tt.address(pod)}/32"],
        }
        self.put("workloadendpoint", f"{ns}/{name}-eth0", {"metadata": meta, "spec": spec})


def full_table(snap: Snapshot) -> dict[str, object]:
    model = NftModel()
    model.run(Renderer().full(snap))
    return model.canonical()
