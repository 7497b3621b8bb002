"""Engine replicas on Ray Serve behind one endpoint, each request routed to the replica that holds its conversation.

Two ways in: `fastdecode serve --replicas N` on one machine (serve.py), or on an existing Ray cluster
`serve run fastdecode.cluster:app model=... replicas=N threads=T` (or a config file naming `fastdecode.cluster:app`;
docs/cluster.md). Ray is an optional extra: `pip install 'fastdecode[cluster]'`.
"""


def app(args: dict):
    """Ray Serve's application builder: `args` are `serve run`'s key=value pairs or a config file's `args`:
    model (required), replicas, min_replicas, max_replicas, threads, max_batch, quant, max_seq_len, kv_cache_gb,
    speculate, api_key (one, or a list), served_model_name, max_queue, request_timeout."""
    from fastdecode.cluster.deployment import ClusterConfig, Ingress, engine_deployment
    from fastdecode.server.config import key_name

    args = dict(args)

    def take(key, kind=str, default=None):
        value = args.pop(key, None)
        return kind(value) if value is not None else default

    model = dict(model=take("model"), dtype=None, quant=take("quant"), group_size=32, threads=take("threads", int, 1),
                 max_seq_len=take("max_seq_len", int), speculate=take("speculate", default="none"),
                 kv_cache_gb=take("kv_cache_gb", float))
    cluster = ClusterConfig(model, replicas=take("replicas", int, 2), min_replicas=take("min_replicas", int),
                            max_replicas=take("max_replicas", int), max_batch=take("max_batch", int, 8))
    keys = args.pop("api_key", None) or []
    server = {"api_keys": {k: key_name(k) for k in ([keys] if isinstance(keys, str) else keys)},
              "served_model_name": take("served_model_name"), "max_queue": take("max_queue", int, 64),
              "request_timeout_s": take("request_timeout", float, 600.0)}
    if model["model"] is None or args:
        raise ValueError("fastdecode.cluster:app needs model=... and takes only the arguments its docstring names"
                         + (f", not {', '.join(sorted(args))}" if args else ""))
    return Ingress.bind(engine_deployment(cluster), server, cluster.slots())
