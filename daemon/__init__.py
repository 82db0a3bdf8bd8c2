"""What tabby's resident daemons (tabby-node, tabby-kube-controllers) share: their HTTP
health and metrics endpoints (``daemon.http``) and the bounds of every server they run
(``daemon.limits``)."""
