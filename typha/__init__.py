"""tabby-typha: the cluster's watches held once, fanned out to every tabby-node (Typha's role;
docs/typha.md). The protocol, the per-node views and the client are ``fanout``'s."""
