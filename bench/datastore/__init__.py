"""The datastore: etcd clients."""
