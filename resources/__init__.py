"""tabby's resources: the kinds an operator applies with ``tabbyctl apply`` and tabby-node
watches, as strict pydantic models over the same Store as the IPAM documents.

::

    names      name/label syntax and store keys (standard library)
    selector   Calico selector expressions (standard library)
    wep        WorkloadEndpoints as the CNI plugin writes them (standard library)
    errors     ResourceError and its subclasses (standard library)
    meta       the model base: strict config, ObjectMeta, field-path errors   (pydantic)
    k8s        NetworkPolicy, Namespace, Pod                                   (pydantic)
    tabby      IPPool, BGPConfiguration, BGPPeer, Node, WorkloadEndpoint       (pydantic)
    storage    kind -> store kind and key; resource <-> stored document        (pydantic)
    client     ResourceClient: get, list, apply, delete                        (pydantic)
    migrate    copy every document of one store into another (standard library)

This package imports nothing itself, so the CNI binaries can use the standard-library
modules without paying for pydantic.
"""
