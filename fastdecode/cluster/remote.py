"""The server's view of a cluster: `RemoteLLM` stands where `LLM` stands in `create_app`, so the ingress serves every
API the single server serves, with the same checks, limits and error shapes; its `astream` sends the request's token
ids to a replica through the deployment's handle, which routes it (router.py)."""
from __future__ import annotations

import dataclasses
import itertools
import logging

import ray.exceptions

from fastdecode.cluster.replica import ReplicaRequest, Started, shippable
from fastdecode.cluster.routing import Route, RoutingTable, block_hashes
from fastdecode.engine.llm import Prompts, StreamChunk
from fastdecode.engine.sampling import SamplingParams
from fastdecode.errors import EngineUnavailable
from fastdecode.loading import load_tokenizer

MAX_ATTEMPTS = 3  # replicas a request without a token yet is tried on before it fails with 503
REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)

log = logging.getLogger(__name__)
_tickets = itertools.count(1)


class RemoteLLM(Prompts):
    """`facts`: a replica's `describe()`. `slots`: requests the replicas batch at once (the server's scheduler lets
    that many through and queues the rest)."""
    engine = kv = None  # no engine in this process: the dashboard shows the server's own queue

    def __init__(self, handle, facts: dict, table: RoutingTable, slots: int):
        self.handle = handle.options(stream=True)
        self.table = table
        self.slots = slots
        self.name, self.path, self.config = facts["name"], facts["path"], facts["config"]
        self.context, self.speculate = facts["context"], facts["speculate"]
        self.max_seq_len = self.context.tokens
        self.tokenizer = load_tokenizer(self.path)

    def status(self) -> dict:
        """/health's per-replica part: the replicas the router may send to, what each has in flight, its last report
        (running, waiting, KV use, prefix-cache hits), and the routing decisions so far."""
        c = self.table.counts()
        replicas = {tag: {"in_flight": c["in_flight"].get(tag, 0), "routed": c["routed"].get(tag, 0),
                          **c["reports"].get(tag, {})} for tag in c["live"]}
        return {"status": "ok" if replicas else "unavailable", "replicas": replicas,
                "routing": {k: c[k] for k in ("decisions", "shed", "retried", "sessions")}}

    def astream(self, prompt, params: SamplingParams | None = None, logits_processor=None, salt: str = "",
                tenant: str | None = "", on_prefill=None, session: str | None = None) -> RemoteStream:
        """LLM.astream on some replica (the replica reports the prefill's progress in its own log, not
        `on_prefill`). `session`: the conversation the client named, which the router keeps on one replica."""
        prompt_ids = self.encode_prompt(prompt)
        request = ReplicaRequest(prompt_ids, params or SamplingParams(), shippable(logits_processor), salt, tenant)
        return RemoteStream(self, request, Route(block_hashes(prompt_ids, salt), session, salt, next(_tickets)))


class RemoteStream:
    """A request's chunks from its replica, as EngineStream gives them. A replica lost before the first token is
    left for another (MAX_ATTEMPTS in all); lost later, the stream raises EngineUnavailable (the API's 503)."""

    def __init__(self, llm: RemoteLLM, request: ReplicaRequest, route: Route):
        self.llm, self.request, self.route = llm, request, route
        self.replies = None  # Ray's DeploymentResponseGenerator of the current attempt
        self.replica: str | None = None
        self.attempts = 0
        self.tokens = 0
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamChunk:
        while True:
            if self.closed:
                raise StopAsyncIteration
            if self.replies is None:
                self.attempts += 1
                self.replies = self.llm.handle.generate.remote(self.request, route=self.route)
            try:
                item = await self.replies.__anext__()
            except StopAsyncIteration:
                self._end()
                raise
            except Exception as e:
                if self.closed:  # close() cancelled the request (a time limit, a client gone): its end, not an error
                    raise StopAsyncIteration from None
                if not isinstance(e, REPLICA_LOST):
                    raise
                self._retry_or_fail(e)
                continue
            if isinstance(item, Started):
                self.replica = item.replica
                self.llm.table.arrived(self.route, item.replica)
                continue
            self.tokens += len(item.token_ids)
            return item

    def _retry_or_fail(self, error: Exception):
        lost, retry = self.replica, not self.tokens and self.attempts < MAX_ATTEMPTS
        self.llm.table.lost(self.route, lost, retry)
        if not retry:
            self.closed = True
            raise EngineUnavailable(f"the replica serving this request stopped ({type(error).__name__}); "
                                    "retry the request") from None
        log.warning("replica %s lost before the request's first token: trying another", lost)
        avoid = self.route.avoid | ({lost} if lost else set())
        self.route = dataclasses.replace(self.route, ticket=next(_tickets), avoid=frozenset(avoid))
        self.replies, self.replica = None, None

    def _end(self):
        if not self.closed:
            self.closed = True
            self.llm.table.finished(self.route)

    def close(self):
        """Ends the request on its replica (its generator is cancelled: the engine frees the request)."""
        if self.replies is not None and not self.closed:
            self.replies.cancel()
        self._end()


def cluster_app(llm: RemoteLLM, config):
    """The server's app over a cluster: create_app's, with the routing and per-replica series in /metrics."""
    from fastdecode.cluster.metrics import ClusterCollector
    from fastdecode.server.app import create_app

    app = create_app(llm, config)
    app.state.metrics.registry.register(ClusterCollector(llm.table))
    return app
