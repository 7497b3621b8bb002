"""Which replica serves a request: the one that already holds its conversation's KV cache, unless that one is full.

An agent resends its whole, growing conversation every turn; the replica that served the last turn has its prefix
cached, any other prefills all of it again (minutes on a CPU at 20k tokens). So a request goes, in this order, to
1. its session's replica: the client named the conversation (a header or a body field, `Route.session`);
2. the replica that served the longest run of its leading token blocks (an approximate index of what each replica
   was sent, block by block, as SGLang's cache-aware router keeps; the replicas' own caches may have evicted some);
3. the least loaded replica.
The load bound: a named session stays on its replica until that replica's batch is full (`max_ongoing_requests`;
then the least loaded replica takes it, and holds it from then on): a second prefill of a whole conversation costs
more than a place in a busy batch. An unnamed conversation that goes on (an earlier request's whole prompt, up to its
last whole block, starts this one's) stays unless its replica has more than 4 requests in flight beyond the least
loaded one's. A new conversation (a new session, or a prompt that at most shares a system prompt with others) goes to
the replica that was sent that prefix unless it has more than `imbalance` (2) beyond the least loaded one's; among
replicas that match equally far, the least loaded wins. A replica that dies or is removed is forgotten: its
sessions move on their next request.

Pure Python, no Ray: the Ray request router (router.py) feeds it.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

BLOCK_TOKENS = 32  # the engine's KV block (engine/kv_cache.BLOCK_SIZE): a cache hit is whole blocks
MAX_BLOCKS = 262_144  # remembered block hashes (about 8M prompt tokens; ~40 MB)
MAX_SESSIONS = 65_536
IMBALANCE = 2  # requests in flight a new conversation's preferred replica may have beyond the least loaded one's
STICKY_IMBALANCE = 4  # the same for an unnamed conversation that goes on
REASONS = ("session", "prefix", "load", "round-robin")
POLICIES = ("session-prefix", "round-robin")  # round-robin: the baseline the benchmark compares against


@dataclass(frozen=True)
class Route:
    """What the router knows of a request. `namespace`: its prefix-cache namespace (tenant and cache_salt): blocks and
    sessions of one namespace never match another's, as in the engine's cache."""
    blocks: tuple[int, ...] = ()  # block_hashes of its prompt
    session: str | None = None
    namespace: str = ""
    ticket: int = 0  # this attempt of the request: the router's choice is kept under it until the request ends
    avoid: frozenset[str] = frozenset()  # replicas that failed this request already


def block_hashes(prompt_ids: list[int], namespace: str = "") -> tuple[int, ...]:
    """The chained hashes of the prompt's whole blocks: block i's hash covers every token before its end."""
    out, h = [], hash(("ns", namespace))
    for end in range(BLOCK_TOKENS, len(prompt_ids) + 1, BLOCK_TOKENS):
        h = hash((h, tuple(prompt_ids[end - BLOCK_TOKENS:end])))
        out.append(h)
    return tuple(out)


def session_key(route: Route) -> int:
    """A session as the table keeps it: a hash, so that a client's long `user` string costs no memory here."""
    return hash((route.namespace, route.session))


def put_recent(table: collections.OrderedDict, items, limit: int):
    """`items` ((key, value) pairs) into `table` as its most recent entries; past `limit` entries the least recent
    go."""
    for key, value in items:
        table[key] = value
        table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


@dataclass
class Choice:
    replica: str
    reason: str  # one of REASONS
    shed: bool = False  # the preferred replica was too busy


@dataclass
class RoutingTable:
    """The router's memory of where sessions and prefixes went, what each replica has in flight, and its decision
    counts. Thread-safe: Ray routes on its own event loop while /metrics and /health read from the server's."""
    imbalance: int = IMBALANCE
    policy: str = "session-prefix"
    max_blocks: int = MAX_BLOCKS
    max_sessions: int = MAX_SESSIONS
    sessions: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # session_key -> replica
    blocks: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # block hash -> {replica}
    ends: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # last blocks of prompts sent
    in_flight: collections.Counter = field(default_factory=collections.Counter)  # replica -> requests
    decisions: collections.Counter = field(default_factory=collections.Counter)  # reason -> requests
    routed: collections.Counter = field(default_factory=collections.Counter)  # replica -> requests
    shed: int = 0  # requests whose preferred replica was too busy
    retried: int = 0  # requests sent again after their replica was lost before their first token
    pending: dict = field(default_factory=dict)  # ticket -> Choice, until the request ends
    replica_stats: dict = field(default_factory=dict)  # replica -> its last report
    live: frozenset = frozenset()  # the replicas the router may send to now
    turn: int = 0  # round-robin's next replica
    lock: threading.Lock = field(default_factory=threading.Lock)

    def choose(self, route: Route, live: list[str]) -> Choice:
        """The replica for `route` among `live` (not empty); it counts as in flight there from now on (a burst of
        new requests sees the ones before it), until `arrived` says where Ray sent it and `finished` ends it."""
        with self.lock:
            load = self.in_flight
            least = min(live, key=lambda r: (load[r], r))
            preferred, reason, continues = None, "load", False
            if self.policy == "round-robin":
                self.turn += 1
                preferred, reason = sorted(live)[self.turn % len(live)], "round-robin"
            elif route.session is not None and self.sessions.get(session_key(route)) in live:
                preferred, reason = self.sessions[session_key(route)], "session"
            else:
                holders, best = set(live), None
                for h in route.blocks:  # the longest run of leading blocks some live replica was sent
                    holders = holders & self.blocks.get(h, set())
                    if not holders:
                        break
                    best, continues = holders, continues or h in self.ends
                if best:
                    preferred, reason = min(best, key=lambda r: (load[r], r)), "prefix"
            # A named session stays where its cache is until that replica is full: moving it costs its whole prefill
            # again, more than a place in a busy batch. So, within a looser bound, does an unnamed conversation that
            # goes on (an earlier request's whole prompt starts this one; the same first prompt sent by many clients
            # looks so too). A new one (a new session, or a prompt sharing at most a system prompt with others) goes
            # where it keeps the load even.
            bound = (None if reason in ("session", "round-robin") else
                     STICKY_IMBALANCE if continues and route.session is None else self.imbalance)
            if preferred is None:
                choice = Choice(least, "load")
            elif bound is not None and load[preferred] - load[least] > bound:
                choice = Choice(least, "load", shed=True)
            else:
                choice = Choice(preferred, reason)
            self._release(route.ticket)  # Ray asks again when every replica it was offered was full
            self.pending[route.ticket] = choice
            load[choice.replica] += 1
            self._remember(route, choice.replica)  # a session's next request follows at once, before this lands
            return choice

    def arrived(self, route: Route, replica: str):
        """The request reached `replica` (Ray's pick: the chosen one unless that one was full); counted here."""
        with self.lock:
            choice = self.pending.get(route.ticket)
            if choice is None:  # not routed by this table (a retry's old ticket)
                return
            if replica != choice.replica:
                self.in_flight[choice.replica] -= 1
                self.in_flight[replica] += 1
                choice.replica, choice.shed = replica, True
                self._remember(route, replica)
            self.decisions[choice.reason] += 1
            self.routed[replica] += 1
            self.shed += choice.shed

    def _remember(self, route: Route, replica: str):
        """The route's session and blocks are on `replica` now."""
        if route.session is not None:
            put_recent(self.sessions, [(session_key(route), replica)], self.max_sessions)
        put_recent(self.blocks, [(h, {*self.blocks.get(h, ()), replica}) for h in route.blocks], self.max_blocks)
        put_recent(self.ends, [(end, None) for end in route.blocks[-1:]], self.max_sessions)

    def finished(self, route: Route):
        """The request ended, however: its replica has one request less in flight."""
        with self.lock:
            self._release(route.ticket)

    def lost(self, route: Route, replica: str | None, retry: bool):
        """The request's replica (None: not known yet) was lost; `retry`: it goes again elsewhere."""
        self.finished(route)
        if replica is not None:
            self.forget(replica)
        with self.lock:
            self.retried += retry

    def _release(self, ticket: int):
        choice = self.pending.pop(ticket, None)
        if choice is not None and self.in_flight[choice.replica] > 0:
            self.in_flight[choice.replica] -= 1

    def observe_stats(self, stats: dict[str, dict]):
        """The replicas' own reports (EngineReplica.record_routing_stats), as Ray last polled them."""
        with self.lock:
            self.replica_stats = {tag: dict(s) for tag, s in stats.items() if s}

    def set_live(self, replicas: set[str]):
        with self.lock:
            self.live = frozenset(replicas)

    def forget(self, replica: str):
        """A replica died or left: its sessions and blocks go to others from their next request."""
        with self.lock:
            for key in [k for k, r in self.sessions.items() if r == replica]:
                del self.sessions[key]
            for h in [h for h, holders in self.blocks.items() if holders == {replica}]:
                del self.blocks[h]
            for holders in self.blocks.values():
                holders.discard(replica)
            self.in_flight.pop(replica, None)
            self.replica_stats.pop(replica, None)
            self.live = self.live - {replica}

    def counts(self) -> dict:
        with self.lock:
            return {"decisions": {r: self.decisions[r] for r in REASONS}, "routed": dict(self.routed),
                    "in_flight": dict(self.in_flight), "shed": self.shed,
                    "retried": self.retried, "sessions": len(self.sessions),
                    "blocks": len(self.blocks), "live": sorted(self.live),
                    "reports": {r: dict(s) for r, s in self.replica_stats.items()}}


_TABLES: dict[str, RoutingTable] = {}
_TABLES_LOCK = threading.Lock()


def table_for(deployment: str) -> RoutingTable:
    """The routing table of `deployment`'s router in this process, made on first use by either the router or the
    ingress (Ray constructs the router, so this registry is how the two meet)."""
    with _TABLES_LOCK:
        return _TABLES.setdefault(deployment, RoutingTable())
