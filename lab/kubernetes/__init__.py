"""A real Kubernetes (1.20, built from Debian's source package) on the namespace lab.

::

    build      kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kubectl
               from Debian's ``kubernetes`` source, cached under /var/cache/tabby/kubernetes
    images     the pause and busybox images (OCI archives), built offline and cached
    pki        a CA and every certificate and kubeconfig the cluster uses (openssl)
    node       one node's runtime: a holder process with a private mount namespace in the
               node's network namespace; containerd, kubelet and tabby-node inside it
    cluster    KubeLab: the demos' lab (tabbyctl.demo.lab.Lab) plus the control plane on
               node-1 and a kubelet on every node, tabby as the pod network; kubectl and
               helpers for tests
    controllers  tabby-kube-controllers as the manifest runs them (service account, RBAC)
    manifest   tabby installed by manifests/tabby.yaml, as the README tells an operator
    demo       ``python -m lab.kubernetes.demo``: tabby as the network of this Kubernetes,
               shown step by step
"""
