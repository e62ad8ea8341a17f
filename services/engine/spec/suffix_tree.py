"""A depth-bounded suffix trie with counts: every suffix of the sequences it holds, cut at
`max_depth` tokens, so a node's count is how often its path occurred and its children say
what followed. Built incrementally (one sequence grows a token at a time) or a whole sequence
at once (the global tree over finished outputs, which also removes them again)."""
from __future__ import annotations


class Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] | None = None

    def child(self, token: int) -> "Node | None":
        return None if self.children is None else self.children.get(token)

    def add_child(self, token: int) -> "Node":
        if self.children is None:
            self.children = {}
        node = self.children.get(token)
        if node is None:
            node = self.children[token] = Node()
        return node


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node()
        self.num_nodes = 0
        # Growing sequence: the nodes of its suffixes that are shorter than max_depth, the
        # longest first, and how many of its tokens they cover.
        self._open: list[Node] = []
        self.num_tokens = 0

    # ---- one growing sequence ------------------------------------------------------------
    def extend(self, tokens: list[int]) -> None:
        """Append tokens[num_tokens:] of the growing sequence."""
        for token in tokens[self.num_tokens:]:
            self._open.append(self.root)
            grown = [self._grow(node, token) for node in self._open]
            # Suffixes at max_depth stop growing: drop the longest when the list is full.
            self._open = grown[-(self.max_depth - 1):] if self.max_depth > 1 else []
        self.num_tokens = max(self.num_tokens, len(tokens))

    def _grow(self, node: Node, token: int) -> Node:
        child = node.child(token)
        if child is None:
            child = node.add_child(token)
            self.num_nodes += 1
        child.count += 1
        return child

    # ---- whole sequences (the global tree) -------------------------------------------------
    def add(self, tokens: list[int]) -> None:
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.max_depth]:
                node = self._grow(node, token)

    def remove(self, tokens: list[int]) -> None:
        """Undo add(tokens): counts go down, paths that reach zero are cut."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.max_depth]:
                child = node.child(token)
                if child is None:
                    break
                child.count -= 1
                if child.count <= 0:
                    self.num_nodes -= _size(child)
                    del node.children[token]
                    break
                node = child

    # ---- matching ---------------------------------------------------------------------------
    def deepest_match(self, context: list[int], room: int = 1) -> tuple[Node | None, int]:
        """The longest suffix of `context` whose node has continuations, at most
        max_depth - room tokens long so that `room` tokens can follow it in the tree;
        (None, 0) if none has."""
        best, best_len = None, 0
        limit = min(len(context), max(1, self.max_depth - room))
        for length in range(1, limit + 1):
            node = self.root
            for token in context[len(context) - length:]:
                node = node.child(token)
                if node is None:
                    break
            if node is None:
                break  # a longer suffix contains this one: none of them is here either
            if node.children:
                best, best_len = node, length
        return best, best_len


def likeliest_path(node: Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """From `node`, follow the most frequent continuation while the path's probability stays
    at or above min_prob; returns the tokens and the sum of their path probabilities (the
    expected number accepted, if the counts were the truth)."""
    tokens, prob, expected = [], 1.0, 0.0
    while len(tokens) < max_tokens and node.children:
        total = sum(child.count for child in node.children.values())
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        prob *= child.count / total
        if prob < min_prob:
            break
        tokens.append(token)
        expected += prob
        node = child
    return tokens, expected


def _size(node: Node) -> int:
    count, stack = 0, [node]
    while stack:
        current = stack.pop()
        count += 1
        if current.children:
            stack.extend(current.children.values())
    return count
