"""The fan-out of the cluster's watched documents to the nodes (tabby-typha's role): the wire
(``wire.py``, documented by ``typha.proto``), what each node receives of each document
(``views.py``), the server's state, history and per-client streams (``hub.py``) and the
client tabby-node reads them with (``client.py``, a ``sync`` source like a store's).
docs/typha.md."""

#: The gRPC method of the stream (``typha.proto``: package, service, rpc).
SERVICE = "tabby.typha.v1.Typha"
METHOD = f"/{SERVICE}/Sync"
DEFAULT_PORT = 5473
