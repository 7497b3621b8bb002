"""/metrics of a cluster: the routing decisions and each replica's load and prefix-cache hits, beside the server's
own series (which count what the ingress served, all replicas together)."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fastdecode.cluster.routing import RoutingTable


class ClusterCollector:
    def __init__(self, table: RoutingTable):
        self.table = table

    def collect(self):
        c = self.table.counts()
        yield labelled(CounterMetricFamily("fastdecode_routing_decisions", "Requests routed, by why their replica was "
                                           "chosen: session, prefix or load", labels=["reason"]), c["decisions"])
        yield CounterMetricFamily("fastdecode_routing_shed", "Requests whose preferred replica was too busy",
                                  value=c["shed"])
        yield CounterMetricFamily("fastdecode_routing_retried", "Requests sent to another replica after theirs was "
                                  "lost before their first token", value=c["retried"])
        yield GaugeMetricFamily("fastdecode_replicas_live", "Engine replicas the router may send to",
                                value=len(c["live"]))
        yield labelled(CounterMetricFamily("fastdecode_replica_requests", "Requests routed to each replica",
                                           labels=["replica"]), c["routed"])
        yield labelled(GaugeMetricFamily("fastdecode_replica_in_flight", "Requests in flight on each replica",
                                         labels=["replica"]), c["in_flight"])
        reports = {"running": "Requests each replica's engine is generating",
                   "waiting": "Requests waiting in each replica's engine",
                   "kv_used_tokens": "KV-cache slots in use on each replica",
                   "prompt_tokens": "Prompt tokens of the requests each replica finished",
                   "cached_tokens": "Of those, the tokens found in the replica's prefix cache"}
        for key, text in reports.items():
            yield labelled(GaugeMetricFamily(f"fastdecode_replica_{key}", text + " (its last report)",
                                             labels=["replica"]),
                           {replica: stats[key] for replica, stats in c["reports"].items() if key in stats})


def labelled(family, values: dict):
    """`family` with one sample per label value in `values` (label -> its sample)."""
    for label, value in values.items():
        family.add_metric([label], value)
    return family
