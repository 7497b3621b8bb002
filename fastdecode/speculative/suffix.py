"""SuffixDecoding (Oliaro et al., 2024): a suffix trie over earlier requests' outputs in this process, and the same
trie's answers over the current request computed from an index of token positions (0.2 ms to build for 590 tokens). The
longest suffix of the context found leads to a node whose subtree holds every continuation seen after that pattern,
with counts. The draft is a tree of the most frequent continuations, grown best-first by path score, as deep as the
match is long (a long match predicts well; a one-token match, little).

A node's score given its parent is its empirical frequency times k / (k + 1), k the tokens of context matched before
it (the match plus the draft tokens above it), as the n-gram drafter ranks its matches: one-token matches that were
followed once are not scored like a file being copied, so the policy calibrates the two apart (they fail and hold
at very different rates)."""
from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict

from fastdecode.speculative.draft import Draft
from fastdecode.speculative.drafter import Drafter


class Node:
    __slots__ = ("children", "count", "seq")

    def __init__(self, seq: int = -1):
        self.children: dict[int, Node] = {}
        self.count = 0
        self.seq = seq  # the latest sequence whose suffix passed through here (for least-recently-used eviction)

    def child_counts(self) -> list[int]:
        return [c.count for c in self.children.values()]


class SuffixTrie:
    """Every suffix of the inserted sequences, cut at `depth` tokens, with occurrence counts per node."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node()

    def extend(self, active: list[Node], token: int, seq: int = -1) -> list[Node]:
        """Appends a token to a sequence being inserted: `active` are the nodes of its suffixes that are still
        shorter than `depth` (the root stands for the empty suffix). Returns the new active list."""
        out = []
        for node in active + [self.root]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node(seq)
            child.count += 1
            child.seq = seq
            out.append(child)
        return out[-self.depth + 1:] if self.depth > 1 else []

    def insert(self, tokens: list[int], seq: int = -1):
        active: list[Node] = []
        for t in tokens:
            active = self.extend(active, t, seq)

    def remove(self, tokens: list[int]):
        """Undoes insert(tokens): decrements every suffix path and drops nodes whose count reaches zero."""
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i:i + self.depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    break
                node = child

    def match(self, context: list[int], max_len: int) -> tuple[int, Node | None]:
        """The longest suffix of context (up to max_len tokens) present in the trie *and* followed by something:
        -> (its length, its node). The suffixes present are those up to some length (a suffix's own suffixes were
        inserted with it), so they are walked shortest first until one is missing: on text the trie has not seen,
        that is after a token or two, not max_len walks."""
        found: list[Node] = []
        for m in range(1, min(max_len, len(context), self.depth - 1) + 1):
            node = self.root
            for t in context[len(context) - m:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is None:
                break
            found.append(node)
        for m in range(len(found), 0, -1):
            if found[m - 1].children:
                return m, found[m - 1]
        return 0, None


class Occurrences:
    """A node of a suffix trie over one text, computed from positions instead of stored: the pattern (`length`
    tokens) ends, exclusive, at each of `ends`; its children group those ends by the token that follows."""
    __slots__ = ("text", "ends", "length", "depth", "_children")

    def __init__(self, text: list[int], ends: list[int], length: int, depth: int):
        self.text, self.ends, self.length, self.depth = text, ends, length, depth
        self._children: dict[int, Occurrences] | None = None

    @property
    def count(self) -> int:
        return len(self.ends)

    def child_counts(self) -> list[int]:
        """The children's counts, without grouping the occurrences into children (what the gate reads: on text where
        drafts fail it turns the match away, and grouping a short match's thousand occurrences was most of a step's
        drafting at 20k tokens of context)."""
        if self._children is not None or self.length >= self.depth:
            return [c.count for c in self.children.values()]
        n = len(self.text)
        return list(Counter(self.text[e] for e in self.ends if e < n).values())

    @property
    def children(self) -> dict[int, "Occurrences"]:
        if self._children is None:
            groups: dict[int, list[int]] = {}  # in order of first occurrence, as a trie creates its children
            if self.length < self.depth:
                n = len(self.text)
                for e in self.ends:
                    if e < n:
                        groups.setdefault(self.text[e], []).append(e + 1)
            self._children = {t: Occurrences(self.text, es, self.length + 1, self.depth) for t, es in groups.items()}
        return self._children


class TextIndex:
    """The current request's text with the positions of each token: the same matches and continuation counts as a
    SuffixTrie over it, cut at the same depth, without building one. A trie costs `depth` node insertions per token,
    about 70 ms for a 600-token prompt, which would stall the second output token; here a token is two appends and
    a lookup filters the occurrences of the context's last pair of tokens."""

    def __init__(self, depth: int):
        self.depth = depth
        self.text: list[int] = []
        self.positions: dict[int, list[int]] = {}
        # and of each pair of tokens (its second's): a common last token (a newline, a comma) occurs thousands of times
        # in an agent's 20k-token context, its pair far fewer (a match there took 66 us a step, 20 us from the pair)
        self.pair_positions: dict[tuple[int, int], list[int]] = {}

    def extend(self, tokens: list[int]):
        for t in tokens:
            n = len(self.text)
            self.positions.setdefault(t, []).append(n)
            if n:
                self.pair_positions.setdefault((self.text[-1], t), []).append(n)
            self.text.append(t)

    def match(self, context: list[int], max_len: int) -> tuple[int, Occurrences | None]:
        """As SuffixTrie.match, for a context that is the indexed text."""
        text, limit = self.text, min(max_len, len(context), self.depth - 1)
        n = len(text)
        if limit <= 0:
            return 0, None
        # Where the last pair occurred before, the longest match is at least that pair: start from its occurrences
        pairs = self.pair_positions.get((context[-2], context[-1]), ()) if limit > 1 else ()
        ends, m = [i + 1 for i in pairs if i + 1 < n], 2
        if not ends:
            ends, m = [i + 1 for i in self.positions.get(context[-1], ()) if i + 1 < n], 1
            if not ends:
                return 0, None
            limit = 1  # (no earlier pair: no longer match)
        while m < limit:
            want = context[-m - 1]
            longer = [e for e in ends if e > m and text[e - m - 1] == want]
            if not longer:
                break
            ends, m = longer, m + 1
        return m, Occurrences(text, ends, m, self.depth)


def first_scores(node: Node | Occurrences, matched: int) -> list[float]:
    """The scores grow_tree gives the nodes hanging under the root."""
    counts = node.child_counts()
    total = sum(counts)
    return [c / total * matched / (matched + 1) for c in counts]


def grow_tree(node: Node | Occurrences, matched: int, budget: int, max_depth: int, min_prob: float,
              drafter: str) -> Draft:
    """Best-first: always adds the candidate continuation with the highest path score; `node` is where the last
    `matched` tokens of the context lead."""
    draft = Draft(drafter=drafter)
    heap = []  # (-probability, tie-breaker, token, trie node, parent index in the draft, depth)
    order = itertools.count()

    def push_children(n: Node, prob: float, parent: int, depth: int):
        total = sum(c.count for c in n.children.values())
        k = matched + depth - 1
        for token, c in n.children.items():
            p = prob * c.count / total * k / (k + 1)
            if p >= min_prob:
                heapq.heappush(heap, (-p, next(order), token, c, parent, depth))

    push_children(node, 1.0, -1, 1)
    while heap and len(draft) < budget:
        neg_p, _, token, c, parent, depth = heapq.heappop(heap)
        index = draft.add(token, parent, -neg_p)
        if depth < max_depth and c.children:
            push_children(c, -neg_p, index, depth + 1)
    return draft


PROMPT_TAIL = 64  # prompt tokens remembered before a request's output: what leads into it (the same question asked
# again, a tool call's preamble), so a later request that ends the same way drafts the output's start


class SuffixMemory:
    """Earlier requests' outputs in one suffix trie, at most `max_tokens` of them (least recently used
    requests evicted first). One memory serves the requests of one tenant: a drafter that drew on another user's
    text would reveal it (through what it drafts, and so through speed and acceptance counts)."""

    def __init__(self, depth: int = 24, max_tokens: int = 32768):
        self.trie = SuffixTrie(depth)
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()  # least recently used first
        self.max_tokens, self.stored, self.next_seq = max_tokens, 0, 0

    def touch(self, seq: int):
        if seq in self.sequences:
            self.sequences.move_to_end(seq)  # used: evict it last

    def remember(self, tokens: list[int]):
        tokens = list(tokens[-self.max_tokens:])
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.trie.insert(tokens, seq)
        self.sequences[seq] = tokens
        self.stored += len(tokens)
        while self.stored > self.max_tokens and len(self.sequences) > 1:
            _, old = self.sequences.popitem(last=False)
            self.trie.remove(old)
            self.stored -= len(old)


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(self, depth: int = 24, max_match: int = 16, depth_per_match: float = 2.0, min_prob: float = 0.05,
                 global_tokens: int = 32768, memory: SuffixMemory | None = None):
        """`memory`: earlier requests to draw on, shared with other drafters of the same tenant (default: this
        drafter's own)."""
        self.depth, self.max_match = depth, max_match
        self.depth_per_match, self.min_prob = depth_per_match, min_prob
        self.memory = memory or SuffixMemory(depth, global_tokens)
        self.start([])

    def start(self, prompt_ids: list[int], params=None):
        self.local = TextIndex(self.depth)
        self.prompt_len = len(prompt_ids)
        self.observe(prompt_ids)

    def observe(self, context: list[int]):
        self.local.extend(context[len(self.local.text):])

    def propose(self, context: list[int], budget: int, promising=None) -> Draft | None:
        self.observe(context)
        best = None
        for trie in (self.local, self.memory.trie):
            m, node = trie.match(context, self.max_match)
            if node is None or (promising is not None and not any(promising(s) for s in first_scores(node, m))):
                continue
            draft = grow_tree(node, m, budget, max(1, int(self.depth_per_match * m)), self.min_prob, self.name)
            if trie is self.memory.trie:
                self.memory.touch(node.seq)
            if best is None or sum(draft.scores) > sum(best.scores):
                best = draft
        return best if best else None

    def finish(self, context: list[int]):
        """Keeps the finished request's output, and the prompt's last PROMPT_TAIL tokens before it, for later
        requests, as SuffixDecoding's global tree holds outputs: a later request's own prompt is in its own index, and
        remembering whole prompts cost the engine thread 24 trie insertions a token when the request ended (0.5 s for
        an 8k-token agent turn on an AVX2 EPYC, 1.5 s for Claude Code's 20k-token first one), every other request
        waiting; an output's insertions cost microseconds beside the decode steps that made it."""
        self.memory.remember(context[max(0, self.prompt_len - PROMPT_TAIL):])
