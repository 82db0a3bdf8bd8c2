"""The ``tracer`` thread: this node's half of a ``tabbyctl policy trace`` that started on
another node (``resources.trace``).

A request addressed to this node (its watch brings it within milliseconds) is served at
once, one at a time: the trace is armed in this node's kernel (``dataplane.nfttrace``: a
table of its own matching only the probe), the answer ``armed`` written, the probe's events
read until tabby's table decided its fate (or the request's seconds passed, or the request
was deleted: tabbyctl saw the probe denied on its own node), the trace table deleted, and
the answer ``done`` written with the decisions (chain, rule and its comment, the chains on
the way), or ``failed`` with why. Answers live 60 s in the datastore, requests 30 s.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from datastore.base import leases
from resources.index import TRACES
from resources.trace import KIND, TraceAnswer, TraceRequest, answer_key

if TYPE_CHECKING:
    from datastore.base import Store
    from tabby_node.cache import Cache

log = logging.getLogger("tabby.node")

ANSWER_TTL = 60.0


class Tracer:
    def __init__(self, node: str, cache: Cache, store: Store, stopping: threading.Event) -> None:
        self.node = node
        self.cache = cache
        self.store = store
        self.stopping = stopping
        self.served: set[str] = set()

    def pending(self) -> list[TraceRequest]:
        """Requests for this node not served yet (the served ones are forgotten once their
        request is gone)."""
        entries = self.cache.of(TRACES)
        self.served &= set(entries)
        return [
            e.value
            for key, e in sorted(entries.items())
            if isinstance(e.value, TraceRequest)
            and e.value.node == self.node
            and key not in self.served
        ]

    def run(self) -> None:
        version = -1
        while not self.stopping.is_set():
            with self.cache.updated:
                if self.cache.version == version:
                    self.cache.updated.wait(1.0)
                version = self.cache.version
            for request in self.pending():
                self.served.add(request.id)
                try:
                    self.serve(request)
                except Exception as e:  # one odd request never ends the tracer
                    log.exception("policy trace %s failed", request.id)
                    self.answer(request, "failed", error=f"{type(e).__name__}: {e}")

    def serve(self, request: TraceRequest) -> None:
        from dataplane import nfttrace
        from policy import trace as policy_trace

        probe = nfttrace.Probe(
            request.family,
            request.src,
            request.dst,
            request.protocol,  # type: ignore[arg-type]  # checked by TraceRequest
            request.sport,
            request.dport,
            request.icmp_id,
        )
        log.info("policy trace %s: tracing %s here", request.id, probe.nft_match())
        deadline = time.monotonic() + request.seconds
        with nfttrace.Trace(probe) as trace:
            self.answer(request, "armed")
            while (left := deadline - time.monotonic()) > 0 and not self.stopping.is_set():
                ds, foreign = policy_trace.decisions(trace.collect(min(left, 0.2)), {})
                # this node decides the probe's ingress (its egress chain passes it on)
                if foreign or any(d.decided and d.direction == "ingress" for d in ds):
                    break
                if any(d.verdict == "drop" for d in ds):
                    break
                if self.cache.get(TRACES, request.id) is None:
                    break  # tabbyctl needs no answer any more
            listings = trace.rules()
        events = trace.events
        ds, foreign = policy_trace.decisions(events, listings)
        self.answer(
            request,
            "done",
            decisions=tuple(d.to_json() for d in ds),
            foreign=tuple(
                {"table": f.table, "chain": f.chain, "handle": f.handle} for f in foreign
            ),
            events=len(events),
        )

    def answer(self, request: TraceRequest, state: str, **fields: object) -> None:
        data = TraceAnswer(request.id, self.node, state, **fields).to_data()  # type: ignore[arg-type]
        key = answer_key(request.id, self.node)
        try:
            current = self.store.get(KIND, key)
            revision = current.revision if current is not None else None
            leases(self.store).put_leased(KIND, key, data, revision, ttl=ANSWER_TTL)
        except Exception as e:
            log.warning("policy trace %s: cannot write the answer: %s", request.id, e)


def start(node: str, cache: Cache, store: Store, stopping: threading.Event) -> threading.Thread:
    """The thread, in the calling thread's network namespace (the node's)."""
    tracer = Tracer(node, cache, store, stopping)
    thread = threading.Thread(target=tracer.run, name="tracer", daemon=True)
    thread.start()
    return thread


__all__ = ["Tracer", "start"]
