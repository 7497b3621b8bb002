"""The cluster as Ray Serve deployments: the engine replicas (EngineReplica, routed by SessionPrefixRouter) and, for
a Ray cluster's own HTTP proxy (`serve run fastdecode.cluster:app`), an ingress deployment holding the server's app.
`fastdecode serve --replicas N` (serve.py) runs the same app in its own process instead."""
from __future__ import annotations

from dataclasses import dataclass, field

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from fastdecode.cluster.replica import EngineReplica

ENGINE = "fastdecode-engine"  # the engine deployment's name: the routing table is kept under it
ROUTING_STATS_S = 2.0  # how often Ray asks each replica for its load and cache hits (record_routing_stats)


@dataclass
class ClusterConfig:
    model: dict  # build_llm's keyword arguments, threads included (per replica)
    replicas: int = 2
    min_replicas: int | None = None  # both set: autoscaling on requests in flight, between them
    max_replicas: int | None = None
    max_batch: int = 8  # each replica's batch: Ray sends it no more at once (the rest wait in the router)
    imbalance: int | None = None  # a new conversation's load bound: routing.IMBALANCE unless set
    routing: str = "session-prefix"  # or "round-robin" (routing.POLICIES)
    drain_s: float = 600.0  # a replica scaled down or upgraded finishes its streams first, for at most this long
    ray_actor_options: dict = field(default_factory=dict)

    @property
    def threads(self) -> int:
        return self.model.get("threads") or 1

    @property
    def most_replicas(self) -> int:
        return self.max_replicas or self.replicas

    def slots(self) -> int:
        """Requests the server lets through to the replicas at once (with autoscaling: at the most replicas)."""
        return self.most_replicas * self.max_batch


def engine_deployment(cluster: ClusterConfig):
    """The bound engine deployment (an Application for serve.run, or an argument of the ingress)."""
    options = dict(
        name=ENGINE, max_ongoing_requests=cluster.max_batch, graceful_shutdown_timeout_s=cluster.drain_s,
        health_check_period_s=5, health_check_timeout_s=60,
        logging_config={"enable_access_log": False},  # the server logs each request once; our own lines stay
        ray_actor_options={"num_cpus": cluster.threads,
                           "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(cluster.threads)}},
                           **cluster.ray_actor_options},
        request_router_config=RequestRouterConfig(
            request_router_class="fastdecode.cluster.router.SessionPrefixRouter",
            request_router_kwargs={"imbalance": cluster.imbalance, "policy": cluster.routing},
            request_routing_stats_period_s=ROUTING_STATS_S))
    if cluster.min_replicas is not None and cluster.max_replicas is not None:
        # Queue depth: a replica is wanted for every half batch in flight or waiting.
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=cluster.min_replicas, max_replicas=cluster.max_replicas,
            target_ongoing_requests=max(1, cluster.max_batch // 2))
    else:
        options["num_replicas"] = cluster.replicas
    return serve.deployment(EngineReplica).options(**options).bind(dict(cluster.model, max_batch=cluster.max_batch))


@serve.deployment(name="fastdecode-ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """The server's app (create_app over RemoteLLM) inside a Ray Serve replica, behind Ray's HTTP proxy."""

    async def __init__(self, engine, server: dict, slots: int):
        from fastdecode.server.config import ServerConfig

        self.engine, self.server, self.slots = engine, ServerConfig(**server), slots
        self.facts = await engine.describe.remote()

    def __serve_build_asgi_app__(self):
        from fastdecode.cluster.remote import RemoteLLM, cluster_app
        from fastdecode.cluster.routing import table_for

        return cluster_app(RemoteLLM(self.engine, self.facts, table_for(ENGINE), self.slots), self.server)
