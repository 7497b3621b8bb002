"""What `fastdecode serve` is told, beside the engine's own options."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise: whoever reaches the port can run the model
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* and /metrics need `Authorization: Bearer <key>`
    api_keys: dict[str, str] = field(default_factory=dict)  # more keys: key -> tenant name
    # Tenants (one per key) share no cached prefix: a hit, or its speed, would tell one what another sent. A team
    # that wants its common system prompt prefilled once for all of them says so.
    share_prefix_cache: bool = False
    served_model_name: str | None = None  # the id clients send as `model` (default: the -m argument)
    max_queue: int = 64  # requests waiting beyond the one generating; the next gets 429 with Retry-After
    request_timeout_s: float = 600.0  # queue wait plus generation; past it the reply ends with finish_reason length
    max_body_bytes: int = 8 * 2**20  # a 128k-token conversation is about 0.5 MB of JSON
    # What parsing and validation may cost the event loop (limits.py): up to 6 us a value (a list of tool calls), so
    # 0.3 s. Claude Code's first request holds about 600; each turn after adds some 20.
    max_body_values: int = 50_000
    # Connections (connections.py): open at once, beyond which one waiting for its request is closed for the new
    # one (or, with none waiting, the new one gets 503); and the seconds a request's headers, then its body, may take.
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0  # 140 KB/s for the largest body
    disconnect_poll_s: float = 0.25  # how often a request that has no bytes out yet checks its client is there
    # Each response's drafted and accepted counts (in its `fastdecode` figures): off by default, since how well a
    # drafter guesses says something about what it has seen. Drafters' memory is per tenant either way.
    expose_speculation_stats: bool = False
    keepalive_s: float = 5.0  # a stream started before its first token (Messages, Responses) sends an event this often

    def tenants(self) -> dict[str, str]:
        """Every accepted key -> its tenant's name (empty: no key needed, one tenant)."""
        keys = {self.api_key: key_name(self.api_key)} if self.api_key else {}
        return {**keys, **self.api_keys}


def key_name(key: str) -> str:
    """A tenant's name for a key given without one: a digest, so logs and salts never hold the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
