"""`fastdecode serve --replicas N`: a local Ray cluster with N engine replicas, and the server's app in this process
(the same uvicorn, connection guards and API as one engine) sending each request to a replica through the engine
deployment's handle. No Ray HTTP proxy: one hop from the server to a replica."""
from __future__ import annotations

import logging
import os

from fastdecode.errors import FastdecodeError

RAY_MISSING = "--replicas needs Ray Serve, an optional extra: pip install 'fastdecode[cluster]'"
OBJECT_STORE_BYTES = 128 << 20  # what crosses is token ids and chunks: Ray's default (30% of memory) would idle


def import_ray():
    """ray and ray.serve, or one line saying how to install them."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise FastdecodeError(RAY_MISSING) from None
    return ray, serve


class LocalCluster:
    """Ray on this machine with the engine deployment running; `stop()` ends both (with the replicas' streams)."""

    def __init__(self, cluster, log=lambda msg: None):
        ray, serve = import_ray()
        from fastdecode.cluster.deployment import ENGINE, engine_deployment
        from fastdecode.cluster.remote import RemoteLLM
        from fastdecode.cluster.routing import table_for

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network, no prompt
        self.ray, self.serve = ray, serve
        cpus = max(os.cpu_count() or 1, cluster.most_replicas * cluster.threads)
        # address="local": a cluster of this server's own, never one another server (or `ray start`) runs here.
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
                 logging_level=logging.WARNING, log_to_driver=True)
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        log(f"starting {cluster.replicas} engine replicas x {cluster.threads} threads on Ray "
            f"{ray.__version__} ({cpus} CPUs)")
        handle = serve.run(engine_deployment(cluster), name="fastdecode", route_prefix=None)
        facts = handle.describe.remote().result()
        self.llm = RemoteLLM(handle, facts, table_for(ENGINE), cluster.slots())

    def stop(self):
        """Ends the local cluster's processes. (The server has closed its streams by now; serve.shutdown() would wait
        for a controller that a Ctrl-C in the terminal, which reaches Ray's processes too, may have stopped.)"""
        self.ray.shutdown()
