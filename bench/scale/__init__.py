"""The control plane at 100-1000 nodes: etcd's fan-out, one node's cost and memory."""
