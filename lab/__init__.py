"""Labs: throwaway tabby clusters on one machine, for the demos, the tests and the benches.

::

    proc         signal-safe child processes, LabError
    cluster      an underlay bridge and node network namespaces, etcd on them, tabby-node
                 (BIRD or VXLAN) on every node, pods made by the installed binaries
    kubernetes   a real Kubernetes on such a cluster: control plane, containerd and kubelet
                 per node in a mount namespace of its own, tabby as its network

Nothing here touches a real node's state: every lab uses its own namespaces, data
directories, network names and ports, and removes everything, also on Ctrl-C.
"""
