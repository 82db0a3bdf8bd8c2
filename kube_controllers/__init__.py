"""tabby-kube-controllers: Kubernetes drives tabby (calico-kube-controllers' role, etcd mode).

::

    kubeapi      a small client of the Kubernetes API (list, watch, get, create, update)
    reflector    one kind of object kept by list + watch (bookmarks, 410 Gone: list again)
    leader       leader election on a coordination.k8s.io/v1 Lease
    mirror       Kubernetes objects -> tabby resources, and the writer of the difference
    ipamgc       blocks of deleted nodes and leaked addresses, released after a grace
    metrics      Prometheus metrics
    options      flags and environment
    controller   the program: threads, leadership, health; ``main``
"""
