"""Draft trees: positions by depth, the ancestor mask, renumbering."""
import torch

from fastdecode.speculative.draft import Draft


def tree() -> Draft:
    # root -> a(0) -> b(1) -> d(3);  root -> c(2)
    d = Draft()
    a = d.add(10, -1, 0.9)
    b = d.add(11, a, 0.8)
    d.add(12, -1, 0.3)
    d.add(13, b, 0.5)
    return d


def test_chain_has_no_mask_and_consecutive_positions():
    tokens, positions, mask = Draft.chain([5, 6, 7], [0.9, 0.8, 0.7]).tree_inputs(4, 100)
    assert tokens == [4, 5, 6, 7]
    assert positions.tolist() == [100, 101, 102, 103]
    assert mask is None


def test_tree_positions_are_depths_and_mask_holds_ancestors():
    tokens, positions, mask = tree().tree_inputs(9, 50)
    assert tokens == [9, 10, 11, 12, 13]
    assert positions.tolist() == [50, 51, 52, 51, 53]
    expected = torch.tensor([[1, 0, 0, 0, 0],   # root
                             [1, 1, 0, 0, 0],   # a
                             [1, 1, 1, 0, 0],   # b under a
                             [1, 0, 0, 1, 0],   # c under root: does not see a or b
                             [1, 1, 1, 0, 1]],  # d under b
                            dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_children_index_rows_by_node_plus_one():
    children = tree().children()
    assert children[0] == {10: 1, 12: 3}
    assert children[1] == {11: 2}
    assert children[2] == {13: 4}
    assert children[3] == {} and children[4] == {}


def test_subset_renumbers_parents():
    kept = tree().subset([0, 2, 1])
    assert kept.tokens == [10, 11, 12]
    assert kept.parents == [-1, 0, -1]
