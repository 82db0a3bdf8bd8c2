"""``tabbyctl demo``: tabby proved on one machine, in throwaway network namespaces.

::

    single    ``tabbyctl demo``: a node namespace and its pods, the installed plugins exec'd
              as a runtime does, a tabby-node of its own serving the calls
    cluster   ``tabbyctl demo --nodes N``: the lab below with pods on every node, the
              reachability matrix, a NetworkPolicy, the IPAM view
    lab       the throwaway cluster the cluster demo builds: an underlay bridge, node
              namespaces, etcd on them, tabby-node (BIRD or VXLAN) on every node, pods made
              by the installed binaries
    proc      signal-safe child processes and the one error type (LabError)

Shipped in the bundle: the demos run from the installed binaries. The cluster test tier,
the benches and the Kubernetes lab (the repository's ``lab`` package, not shipped) build on
``lab`` and ``proc`` here. Nothing here touches a real node's state: every demo uses its
own namespaces, data directories, network names and ports, and removes everything, also
on Ctrl-C.
"""
