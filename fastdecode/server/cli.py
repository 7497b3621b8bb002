"""`fastdecode serve`: the OpenAI-compatible server on one model."""
from __future__ import annotations

import functools
import logging

import click

from fastdecode.console import err, log
from fastdecode.engine.cli import build_llm, model_kwargs, model_options
from fastdecode.errors import FastdecodeError
from fastdecode.cluster.routing import POLICIES
from fastdecode.server.banner import banner_lines
from fastdecode.server.config import ServerConfig, key_name
from fastdecode.server.connections import GuardedH11Protocol, connection_limits, quiet_connection_logs
from fastdecode.server.security import is_loopback
from fastdecode.server.stopping import run_server


@click.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Anything but loopback exposes the model to the network: set an API key.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", "api_keys", envvar="FASTDECODE_API_KEY", multiple=True,
              help="Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on /v1/* and /metrics (or set "
                   "FASTDECODE_API_KEY). Repeat it for several keys: each key is a tenant, whose prefix cache and "
                   "drafters' memory no other sees.")
@click.option("--api-keys-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="More keys, one tenant a line: `NAME KEY` (the name shows in logs instead of a digest).")
@click.option("--share-prefix-cache", is_flag=True,
              help="Let tenants hit each other's cached prefixes (a team's common system prompt prefilled once). "
                   "A hit, and its speed, then tells one tenant what another sent.")
@click.option("--served-model-name", default=None, help="The model id clients send (default: the -m argument).")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for the engine; one more gets 429 with Retry-After.")
@click.option("--request-timeout", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Seconds a request may take, queue wait included.")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=8 * 2**20, show_default=True)
@click.option("--max-body-values", type=click.IntRange(min=1000), default=50_000, show_default=True,
              help="JSON values (array elements and object members) a body may hold; more gets 413. What parsing "
                   "and validating one body may cost the other streams: about 0.3 s at the default.")
@click.option("--max-connections", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Connections open at once (fewer if `ulimit -n` is lower). One more closes the connection that has "
                   "waited longest for its request, or gets 503 when every one is inside a request.")
@click.option("--header-timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds a client has to send a request's headers; past them it gets 408 and is disconnected.")
@click.option("--body-timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Seconds a client has to send a request's body, from its headers; past them, 408.")
@click.option("--expose-speculation-stats", is_flag=True,
              help="Report each response's drafted and accepted token counts (off: they hint at what drafters saw).")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="Engine replicas, each with its own --threads, --max-batch and KV cache, behind this one endpoint; "
                   "each request goes to the replica holding its conversation's prefix (needs Ray Serve: "
                   "pip install 'fastdecode[cluster]'; docs/cluster.md).")
@click.option("--min-replicas", type=click.IntRange(min=1), default=None,
              help="With --max-replicas: scale the replicas between the two on requests in flight.")
@click.option("--max-replicas", type=click.IntRange(min=1), default=None)
@click.option("--routing", type=click.Choice(POLICIES), default=POLICIES[0],
              show_default=True, help="How --replicas share requests: each to the replica holding its session or "
                                      "longest prefix (load-bounded), or in turn (the baseline).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
def serve(host, port, api_keys, api_keys_file, share_prefix_cache, served_model_name, max_queue, request_timeout,
          max_body_bytes, max_body_values, max_connections, header_timeout, body_timeout, expose_speculation_stats,
          replicas, min_replicas, max_replicas, routing, log_level, **engine):
    """Serve MODEL over an OpenAI-compatible HTTP API (chat and text completions, tools, streaming)."""
    from fastdecode.server.app import create_app

    keys = {key: key_name(key) for key in api_keys if key}
    if api_keys_file:
        keys.update(read_keys_file(api_keys_file))
    config = ServerConfig(host=host, port=port, api_keys=keys, share_prefix_cache=share_prefix_cache,
                          served_model_name=served_model_name, max_queue=max_queue, request_timeout_s=request_timeout,
                          max_body_bytes=max_body_bytes, max_body_values=max_body_values,
                          max_connections=max_connections, header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                          expose_speculation_stats=expose_speculation_stats)
    if not is_loopback(host) and not config.tenants():
        err.print(f"[yellow]warning: serving on {host} without an API key: anyone who reaches the port can use "
                  "the model[/yellow]")
    engine_model = engine["model"]
    model = model_kwargs(engine)
    # Our own lines (what each agent request holds) beside uvicorn's, at the same level.
    logging.basicConfig(format="%(levelname)-9s %(name)s: %(message)s", level=log_level.upper())
    cluster = None
    if replicas > 1 or min_replicas or max_replicas:
        cluster = start_cluster(model, replicas, min_replicas, max_replicas, routing)
        llm, roofline = cluster.llm, None
        from fastdecode.cluster.remote import cluster_app
        app = cluster_app(llm, config)
    else:
        llm = build_llm(**model)
        roofline = ceiling(llm)
        app = create_app(llm, config, roofline)
    lines = banner_lines(llm, app.state.served.id, engine_model, host, port, config, roofline)
    err.print(f"[cyan]{lines[0]}[/cyan]")
    for line in lines[1:]:
        err.print(line, markup=False, highlight=False, soft_wrap=True)  # whole lines: they are pasted into shells
    quiet_connection_logs()
    limits = connection_limits(config.max_connections, config.header_timeout_s, config.body_timeout_s)
    try:
        run_server(app, app.state.scheduler.close, host=host, port=port, log_level=log_level,
                   timeout_graceful_shutdown=5, backlog=limits.backlog,
                   http=functools.partial(GuardedH11Protocol, limits=limits))
    finally:
        if cluster is not None:
            cluster.stop()


def start_cluster(model: dict, replicas: int, min_replicas: int | None, max_replicas: int | None, routing: str):
    """The replicas on a local Ray cluster; each takes --threads (default: this machine's cores shared out)."""
    import os

    from fastdecode.cluster.deployment import ClusterConfig
    from fastdecode.cluster.serve import LocalCluster

    if (min_replicas is None) != (max_replicas is None) or (min_replicas or 0) > (max_replicas or 0):
        raise FastdecodeError("--min-replicas and --max-replicas go together, the first no larger than the second")
    if model.get("tp", 1) > 1:
        raise FastdecodeError("--replicas and --tp do not combine: replicas add throughput, --tp splits one model")
    most = max_replicas or replicas
    model = dict(model, threads=model.get("threads") or max(1, (os.cpu_count() or 1) // most))
    config = ClusterConfig(model, replicas=min_replicas or replicas, min_replicas=min_replicas,
                           max_replicas=max_replicas, max_batch=model.pop("max_batch"), routing=routing)
    return LocalCluster(config, log=log)


def ceiling(llm) -> dict | None:
    """This machine's decode ceiling for the model (measured once a day: a few seconds, before serving starts)."""
    from fastdecode.roofline.probe import decode_ceiling

    if llm.engine is None or getattr(llm, "group", None) is not None:  # a cluster's front, a tensor-parallel rank:
        return None  # their bytes per token are not one model's in this process
    err.print("[dim]measuring memory bandwidth (cached for a day)...[/dim]")
    return decode_ceiling(llm.weight_bytes_per_token(), llm.engine.threads)


def read_keys_file(path: str) -> dict[str, str]:
    """`NAME KEY` lines (blank lines and # comments skipped) -> key -> tenant name."""
    keys = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if len(words) != 2:
                raise FastdecodeError(f"{path}:{n}: a line of --api-keys-file is `NAME KEY`")
            keys[words[1]] = words[0]
    return keys
