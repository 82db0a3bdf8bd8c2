"""The etcd v3 store and tabby's own etcd client (standard library only; ``h2`` for the watch).

==============  ====================================================================
``store``       ``EtcdStore``: the store protocol (``datastore.base``) on etcd: one key per
                document under ``<prefix>/``, every write one txn comparing the key's
                mod revision, ``sync`` over etcd's watch (resumed, never re-read)
``client``      the KV client over etcd's gRPC-JSON gateway: several endpoints with
                rotation, a deadline per operation, TLS, leases, the gateway's watch
``grpc``        the native gRPC watch (HTTP/2 by ``h2``, imported only when a watch starts)
==============  ====================================================================

Nothing is imported here: a CNI call that uses etcd imports ``datastore.etcd.store`` (and with it
``client``), never ``grpc``.
"""
