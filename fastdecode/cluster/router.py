"""The engine deployment's request router, on Ray Serve's request-router API: session, then prefix, then load
(routing.py). It runs in the process that holds the deployment's handle (the ingress), on Ray's router loop.

Ray builds the router itself, so the table it decides with lives in this process's registry (routing.table_for), where
the ingress finds it to tell it where each request landed (the replica's first item) and when it ended, and to report
it in /metrics and /health. (Ray ships this module by value to wherever the handle is: it holds no state of its own.)
"""
from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from fastdecode.cluster.routing import Route, table_for


class SessionPrefixRouter(RequestRouter):
    """Offers Ray the table's choice alone while it has room for the request (its count includes this one); when its
    batch is full, the others after it, least loaded first: Ray sends to the first rank with room. (No FIFOMixin: it
    hands a replica chosen for one request to the oldest one waiting, whatever that one's conversation.)"""

    @property
    def supports_rejection_protocol(self) -> bool:
        """No: the router offers a replica only while it has room by the router's own count (Ray's rejection
        protocol would cost each request a round trip to the replica before it is sent)."""
        return False

    def initialize_state(self, imbalance: int | None = None, policy: str = "session-prefix"):
        self.table = table_for(self._deployment_id.name)
        self.table.policy = policy
        if imbalance is not None:
            self.table.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        route = pending_request.kwargs.get("route") if pending_request is not None else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self.table.observe_stats({tag: r.routing_stats for tag, r in by_id.items()})
        if not isinstance(route, Route) or not by_id:
            return [sorted(candidate_replicas, key=lambda r: self.table.in_flight[r.replica_id.unique_id])]
        live = [tag for tag in by_id if tag not in route.avoid] or list(by_id)
        choice = self.table.choose(route, live)
        chosen = by_id[choice.replica]
        if self.table.in_flight[choice.replica] <= chosen.max_ongoing_requests:
            # Room there by our count: only there. (Ray probes a replica's queue before sending, and a replica busy
            # prefilling can miss the probe's 100 ms deadline; offered the others too, Ray would move the request
            # away from its cache for that alone. Offered only this one, it asks again after a short backoff.)
            return [[chosen]]
        rest = sorted((tag for tag in by_id if tag != choice.replica), key=lambda t: (self.table.in_flight[t], t))
        return [[chosen], [by_id[tag] for tag in rest]]

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]):
        gone = set(self._replica_id_set)
        super().update_replicas(replicas)
        for replica_id in gone - set(self._replica_id_set):
            self.table.forget(replica_id.unique_id)
        self.table.set_live({r.unique_id for r in self._replica_id_set})
