"""A real Kubernetes (1.20, built from Debian's source package) on the namespace lab.

::

    build      kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kubectl
               from Debian's ``kubernetes`` source, cached under /var/cache/tabby/kubernetes
    images     the pause and busybox images (OCI archives), built offline and cached
    pki        a CA and every certificate and kubeconfig the cluster uses (openssl)
    node       one node's runtime: a holder process with a private mount namespace in the
               node's network namespace; containerd, kubelet and tabby-node inside it
    cluster    KubeLab: lab.cluster.Lab plus the control plane on node-1 and a kubelet on
               every node, tabby as the pod network; kubectl and helpers for tests
"""
