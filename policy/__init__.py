"""Kubernetes NetworkPolicy for tabby-node: a pure policy engine and its nftables dataplane.

* :mod:`policy.engine`: typed inputs (policies, namespaces, pods, endpoints)
  -> :class:`~policy.engine.DesiredState`, an intermediate representation made
  for incremental programming (named address sets, shared per-policy chains, per-endpoint
  chains), plus ``explain`` (why is this traffic allowed or not). No I/O.
* :mod:`policy.incremental`: the same IR kept up to date change by change, with the delta
  of each change (what the table must be sent), so that an event costs what it touches.
* :mod:`dataplane.nft`: renders the IR into the one table ``inet tabby`` and
  applies it in single atomic transactions (full replacement on start, differences after).
* :class:`dataplane.nft.PolicyDataplane`: what tabby-node calls.
* :mod:`policy.inputs`: resource models -> engine inputs; changed documents -> updates.

See ``DESIGN.md`` beside this file for the ruleset layout and the measurements behind it.
"""
