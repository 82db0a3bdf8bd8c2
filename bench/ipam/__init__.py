"""IPAM: the allocator on the file store and over etcd."""
