"""Kubernetes NetworkPolicy for tabby-node: a pure engine, the policy state tabby-node keeps,
and the nft text of its table. The dataplane (``dataplane.nft``) applies that text; it knows
no policy.

* :mod:`policy.engine`: typed inputs (policies, namespaces, pods, endpoints)
  -> :class:`~policy.engine.DesiredState`, an intermediate representation made
  for incremental programming (named address sets, shared per-policy chains, per-endpoint
  chains), plus ``explain`` (why is this traffic allowed or not). No I/O.
* :mod:`policy.incremental`: the same IR kept up to date change by change, with the delta
  of each change (what the table must be sent), so that an event costs what it touches.
  No I/O.
* :mod:`policy.render`: the IR (whole, or a delta) as the nft text of the one table
  ``inet tabby`` (full replacement on start, differences after). No I/O.
* :mod:`policy.counters`: the table's named counters and what each counts (the labels of
  ``tabby_policy_packets_total``). No I/O.
* :mod:`policy.state`: :class:`~policy.state.PolicyDataplane`, what tabby-node calls: the
  inputs and the IR kept, each change's text sent to the applier it is given
  (``dataplane.nft``) in one atomic transaction, the counters read and summed, ``explain``
  on the current inputs.
* :mod:`policy.trace`: what a traced packet's events (``dataplane.nfttrace``) say about the
  table: which chain and rule accepted or dropped it. No I/O.
* :mod:`policy.inputs`: resource models -> engine inputs; changed documents -> updates.

See ``DESIGN.md`` beside this file for the ruleset layout and the measurements behind it.
"""
