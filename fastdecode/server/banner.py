"""What `fastdecode serve` prints once the model is loaded: where it listens, the context and KV budget it runs with
and why, this machine's decode ceiling for the model, and the exact lines that connect each coding agent."""
from __future__ import annotations

import ipaddress

from fastdecode.agents.profiles import AGENTS, Endpoint

KEY_PLACEHOLDER = "YOUR_KEY"  # a banner goes to logs: never the key itself


def connect_url(host: str, port: int) -> str:
    """Where a client on this machine reaches a server bound to `host`: a wildcard bind through the loopback."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name
        return f"http://{host}:{port}"
    if address.is_unspecified:
        return f"http://127.0.0.1:{port}"
    return f"http://[{host}]:{port}" if address.version == 6 else f"http://{host}:{port}"


def banner_lines(llm, served_id: str, model_arg: str, host: str, port: int, config, ceiling: dict | None) -> list[str]:
    url = connect_url(host, port)
    batch = llm.slots  # a cluster's: every replica's batch
    auth = f", {len(config.tenants())} API key(s) required" if config.tenants() else ""
    lines = [f"{served_id} on {url}/v1 (speculate {llm.speculate}, batch {batch}, queue {config.max_queue}{auth})",
             f"  context    {llm.context.describe()}"]
    if llm.kv is not None:
        gb = llm.kv_bytes_per_token(llm.kv.capacity) / 1e9
        lines.append(f"  KV cache   {llm.kv.capacity:,} tokens, {gb:.1f} GB at most (memory is taken as it fills)")
    if ceiling is not None:
        lines.append(f"  roofline   decode ceiling {ceiling['decode_tok_s']:,.0f} tok/s for one stream: "
                     f"{ceiling['bandwidth_gb_s']:.1f} GB/s measured / {ceiling['bytes_per_token'] / 1e6:,.0f} MB "
                     f"read per token")
    lines.append(f"  dashboard  {url}/")
    if served_id == model_arg:
        option = "" if port == 8000 else f" --port {port}"
        lines.append(f"  agents     fastdecode launch claude|codex|opencode -m {model_arg}{option}   (uses this server)")
    endpoint = Endpoint(url, served_id, llm.max_seq_len, KEY_PLACEHOLDER if config.tenants() else None)
    lines.append("  or by hand:")
    lines += [f"    {agent.title}: {agent.by_hand(endpoint)}" for agent in AGENTS.values()]
    return lines
