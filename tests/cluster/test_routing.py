"""The routing policy alone (no Ray): session, then the longest cached prefix, then load, within a load bound."""
from fastdecode.cluster.routing import BLOCK_TOKENS, Route, RoutingTable, block_hashes

A, B = "replica-a", "replica-b"
SYSTEM = list(range(1000, 1000 + 4 * BLOCK_TOKENS))  # a system prompt of 4 blocks every session shares


def route(ids, session=None, namespace="", ticket=0, avoid=frozenset()):
    return Route(block_hashes(ids, namespace), session, namespace, ticket, avoid)


def send(table, r, live=(A, B)):
    """Routes `r`, lands it where the table chose, and returns the choice."""
    choice = table.choose(r, list(live))
    table.arrived(r, choice.replica)
    return choice


def test_block_hashes_cover_whole_blocks_and_chain_everything_before():
    ids = list(range(3 * BLOCK_TOKENS + 5))
    assert len(block_hashes(ids)) == 3  # the partial fourth block is no cache hit
    changed = [7] + ids[1:]
    assert all(x != y for x, y in zip(block_hashes(ids), block_hashes(changed)))  # a change early moves every block
    assert block_hashes(ids, "tenant:a") != block_hashes(ids, "tenant:b")


def test_a_named_session_stays_on_its_replica():
    table = RoutingTable()
    first = send(table, route(SYSTEM + [1] * 40, session="s1", ticket=1))
    table.finished(route([], ticket=1))
    again = send(table, route([5] * 200, session="s1", ticket=2))  # even with nothing in common
    assert again.replica == first.replica and again.reason == "session"


def test_the_longest_prefix_wins_and_ties_go_to_the_least_loaded():
    table = RoutingTable(imbalance=1)
    one, two, three = ([*SYSTEM, *range(k, k + 2 * BLOCK_TOKENS)] for k in (50, 90, 130))
    first = send(table, route(one, ticket=1))
    second = send(table, route(two, ticket=2))  # only `first`'s replica has the system prompt: there, 2 against 0
    assert second.reason == "prefix" and second.replica == first.replica
    third = send(table, route(three, ticket=3))  # 2 against 0 is over the bound: the other replica
    assert third.shed and third.replica != first.replica
    fourth = send(table, route([*SYSTEM, 7, 7], ticket=4))  # both hold the system prompt now: the less loaded
    assert fourth.reason == "prefix" and fourth.replica == third.replica
    for t in range(1, 5):
        table.finished(route([], ticket=t))
    later = send(table, route(one + [3] * 100, ticket=5))  # the conversation grew: back where its turns were
    assert later.replica == first.replica and later.reason == "prefix"


def busy(table, replica, n, first_ticket=100):
    for t in range(first_ticket, first_ticket + n):
        r = route([t] * 10, ticket=t)
        table.choose(r, [replica])
        table.arrived(r, replica)


def test_a_named_session_stays_on_its_busy_replica_an_unnamed_one_within_a_looser_bound():
    table = RoutingTable(imbalance=2)
    home = send(table, route(SYSTEM, session="s", ticket=1)).replica
    busy(table, home, 3)  # 4 in flight there against 0
    grown = send(table, route(SYSTEM + [9] * 40, ticket=2))  # no session named: its earlier prompt starts this one
    assert grown.replica == home and grown.reason == "prefix"
    assert send(table, route(SYSTEM + [9] * 40, session="s", ticket=3)).replica == home  # 6 against 0 now
    moved = send(table, route(SYSTEM + [9] * 60, ticket=4))
    assert moved.replica != home and moved.shed


def test_new_sessions_with_the_same_first_prompt_spread_over_the_replicas():
    table = RoutingTable(imbalance=2)
    first_turn = SYSTEM + [8] * 2 * BLOCK_TOKENS  # 8 subagents given the same task
    placed = [send(table, route(first_turn, session=f"agent-{k}", ticket=k)).replica for k in range(8)]
    # the first three where the prompt was first sent, the fourth over the bound elsewhere; from then on both hold
    # the prompt, and the less loaded takes each
    assert placed.count(A) == placed.count(B) == 4


def test_a_new_conversation_sheds_beyond_the_imbalance():
    table = RoutingTable(imbalance=2)
    home = send(table, route(SYSTEM + [8] * 2 * BLOCK_TOKENS, ticket=1)).replica  # a first turn: system prompt, task
    busy(table, home, 2)  # 3 in flight there against 0
    new = send(table, route(SYSTEM + list(range(5000, 5000 + 8 * BLOCK_TOKENS)), ticket=2))  # shares the system prompt
    assert new.replica != home and new.shed and new.reason == "load"
    assert table.counts()["shed"] == 1


def test_in_flight_counts_every_attempt_once_until_it_ends():
    table = RoutingTable()
    r = route(SYSTEM, ticket=1)
    table.choose(r, [A, B])
    table.choose(r, [A, B])  # Ray asked again (every replica was full): still one request
    assert sum(table.in_flight.values()) == 1
    table.arrived(r, B)  # Ray sent it elsewhere than chosen
    assert table.in_flight[B] == 1 and sum(table.in_flight.values()) == 1
    table.finished(r)
    table.finished(r)
    assert sum(table.in_flight.values()) == 0


def test_namespaces_share_neither_prefixes_nor_sessions():
    table = RoutingTable()
    first = send(table, route(SYSTEM, session="s", namespace="tenant:a", ticket=1))
    table.finished(route([], ticket=1))
    other = table.choose(route(SYSTEM, session="s", namespace="tenant:b", ticket=2), [A, B])
    assert other.reason == "load" and first.reason == "load"


def test_a_lost_replica_is_forgotten_and_its_sessions_move():
    table = RoutingTable()
    home = send(table, route(SYSTEM, session="s", ticket=1)).replica
    table.finished(route([], ticket=1))
    table.forget(home)
    survivor = B if home == A else A
    moved = send(table, route(SYSTEM, session="s", ticket=2), live=[survivor])
    assert moved.replica == survivor and moved.reason == "load"
    assert home not in table.counts()["in_flight"]


def test_memory_is_bounded():
    table = RoutingTable(max_blocks=10, max_sessions=3)
    for t in range(20):
        send(table, route(list(range(t * 1000, t * 1000 + 4 * BLOCK_TOKENS)), session=f"s{t}", ticket=t))
        table.finished(route([], ticket=t))
    counts = table.counts()
    assert counts["blocks"] == 10 and counts["sessions"] == 3 and not table.pending
