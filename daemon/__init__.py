"""What tabby's resident daemons (tabby-node, tabby-kube-controllers) share: their HTTP
health and metrics endpoints (``daemon.http``)."""
