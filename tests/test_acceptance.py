"""Acceptance rules and the verifier on forced logits (named scenarios), and sampling statistics."""

from functools import partial

import pytest
import torch

from eagle_dropmatch.acceptance import (ARGMAX_BLOCK, DraftView, TargetView, choose_tokens, dropmatch_match, exact,
                                        first_argmax, longest_accepted_path, process_logits, top_k_rule)
from eagle_dropmatch.dropmatch import (RIVAL_BLOCK, AgreementTally, DropMatchConfig, agreement_counts,
                                       contested_children, contested_sample_tokens, deciding_nodes, dropout_inputs,
                                       dropout_masks, lm_head_with_samples, may_win, reachable_sample_tokens,
                                       rescale_needed, rival_tokens, shortlist_ids, shortlist_logits,
                                       tokens_of_samples)
from eagle_dropmatch.tree import DraftTree
from eagle_dropmatch.verify import TargetLMHead

V = 10

# A tree of 7 nodes (root first, depth-major):
#         0 (root)
#       /   \
#      1     2
#     / \     \
#    3   4     5
#             /
#            6
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 5])
TOKENS = torch.tensor([9, 1, 2, 3, 4, 5, 6])
CHAIN_FIRST_PARENTS = torch.tensor([-1, 0, 1, 1, 2, 3, 3])  # 0 -> 1 -> {2, 3}, 2 -> 4, 3 -> {5, 6}


def forced_logits(next_tokens: list[int]) -> torch.Tensor:
    """[N, V] logits whose argmax at row j is next_tokens[j] (the target's choice after node j)."""
    logits = torch.zeros(len(next_tokens), V)
    logits[torch.arange(len(next_tokens)), torch.tensor(next_tokens)] = 5.0
    return logits


def verify(next_tokens, rule=exact, sample_tokens=None):
    tree = DraftTree.from_parents(TOKENS, PARENTS)
    logits = forced_logits(next_tokens)
    view = TargetView(logits, logits.argmax(-1), sample_tokens)
    sets = rule(view, DraftView(tree.tokens, tree.parents))
    path = longest_accepted_path(tree.tokens, tree.parents, tree.depths, tree.ancestors, sets)
    bonus = int(view.tokens[path[-1]])
    return path.tolist(), bonus


def test_perfect_match_takes_the_deepest_branch():
    # root -> 2 -> 5 -> 6 is fully predicted; bonus after node 6 is 7
    assert verify([2, 0, 5, 0, 0, 6, 7]) == ([0, 2, 5, 6], 7)


def test_early_mismatch_accepts_nothing():
    assert verify([8, 0, 0, 0, 0, 0, 0]) == ([0], 8)


def test_mismatch_mid_branch_stops_there():
    # 0 -> 2 accepted, 2 predicts 7 (not 5): stop at 2, bonus 7
    assert verify([2, 0, 7, 0, 0, 0, 0]) == ([0, 2], 7)


def test_ties_pick_the_lowest_index_branch():
    # both 0->1->3 and 0->1->4 can't both match; build a tie between depth-2 ends 3 (via 1) and 5 (via 2)
    # by giving node 0 two acceptable children under DropMatch: sets {1} U {2}
    samples = torch.full((1, 7), -1)
    samples[0, 0] = 2
    path, bonus = verify([1, 3, 5, 0, 0, 0, 0], rule=dropmatch_match, sample_tokens=samples)
    assert path == [0, 1, 3]  # depth 2 via node 1 (index 3) beats depth 2 via node 2 (index 5)
    assert bonus == 0


def test_padding_never_matches():
    tree = DraftTree.from_parents(TOKENS, PARENTS)
    sets = torch.full((7, 3), -1)
    path = longest_accepted_path(tree.tokens, tree.parents, tree.depths, tree.ancestors, sets)
    assert path.tolist() == [0]
    # a node whose token is -1 is impossible; padding in the middle of a set is ignored
    sets[0] = torch.tensor([-1, 2, -1])
    assert longest_accepted_path(tree.tokens, tree.parents, tree.depths, tree.ancestors,
                                 sets).tolist() == [0, 2]


def test_dropmatch_sample_opens_a_branch_exact_rejects():
    samples = torch.full((2, 7), -1)
    samples[1, 0] = 2   # a sample at the root picks token 2
    samples[0, 2] = 5   # a sample at node 2 picks token 5
    exact_path, _ = verify([1, 0, 0, 0, 0, 9, 8])
    dm_path, bonus = verify([1, 0, 0, 0, 0, 9, 8], rule=dropmatch_match, sample_tokens=samples)
    assert exact_path == [0, 1]
    assert dm_path == [0, 2, 5]
    assert bonus == 9  # the bonus is the undropped token after node 5, never a sample


def test_top_k_rule_accepts_runner_up():
    logits = forced_logits([7, 0, 0, 0, 0, 0, 0])
    logits[0, 2] = 4.0  # token 2 is the root's runner-up; exact matching accepts nothing
    tree = DraftTree.from_parents(TOKENS, PARENTS)
    view = TargetView(logits, logits.argmax(-1))
    sets = top_k_rule(2)(view, DraftView(tree.tokens, tree.parents))
    assert longest_accepted_path(tree.tokens, tree.parents, tree.depths, tree.ancestors,
                                 sets).tolist() == [0, 2]


def test_rules_are_supersets_of_exact():
    gen = torch.Generator().manual_seed(0)
    tree = DraftTree.from_parents(TOKENS, PARENTS)
    for _ in range(50):
        logits = torch.randn(7, V, generator=gen)
        view = TargetView(logits, logits.argmax(-1), torch.randint(0, V, (4, 7), generator=gen))
        draft = DraftView(tree.tokens, tree.parents)
        n_exact = len(longest_accepted_path(tree.tokens, tree.parents, tree.depths, tree.ancestors,
                                            exact(view, draft)))
        for rule in (dropmatch_match, top_k_rule(3)):
            n = len(longest_accepted_path(tree.tokens, tree.parents, tree.depths, tree.ancestors,
                                          rule(view, draft)))
            assert n >= n_exact


def test_agreement_counts_on_forced_samples():
    target_tokens = torch.tensor([3, 4, 5, 6])
    samples = torch.tensor([[3, 4, 1, 6], [3, 2, 1, 6], [3, 4, 5, 6]])  # [K=3, N=4]
    positions, agree, set_total = agreement_counts(target_tokens, samples,
                                                   torch.tensor([True, True, True, False])).tolist()
    assert (positions, agree) == (3, 1)  # only position 0 has all samples equal to the target
    assert set_total == 1 + 2 + 2  # {3}, {4, 2}, {5, 1}


def test_agreement_tally_counts_the_paths_deciding_nodes_as_round_by_round_counts():
    """Counting all rounds at once over their paths gives the sums of per-round counts over whole trees
    with the nodes off the path or not deciding left out (how the engine counted before the tally)."""
    generator = torch.Generator().manual_seed(3)
    tally, summed = AgreementTally(), torch.zeros(3, dtype=torch.long)
    assert tally.counts() == [0, 0, 0]
    for _ in range(20):
        n = int(torch.randint(2, 12, (1,), generator=generator))
        target_tokens = torch.randint(0, 4, (n,), generator=generator)
        noise = torch.randint(-1, 4, (5, n), generator=generator)
        samples = torch.where(torch.rand(5, n, generator=generator) < 0.85, target_tokens, noise)  # mostly agree
        deciding = torch.rand(n, generator=generator) < 0.6
        path = torch.randperm(n, generator=generator)[:int(torch.randint(1, n + 1, (1,), generator=generator))]
        tally.add(target_tokens, samples, deciding, path)
        counted = torch.zeros(n, dtype=torch.bool)
        counted[path] = deciding[path]
        summed += agreement_counts(target_tokens, samples, counted)
    assert tally.counts() == summed.tolist() and summed[0] > summed[1] > 0


def sample_argmax(hidden, weight, nodes, cfg, seed, bias=None, rescale=True):
    """[K, N] DropMatch sample tokens at ``nodes`` (bool [N]; T = 0), -1 elsewhere, as the engine computes them."""
    samples = dropout_inputs(hidden, nodes, cfg, torch.Generator().manual_seed(seed), rescale)  # P of K x N
    logits = torch.nn.functional.linear(samples.inputs, weight, bias)  # [P, V]
    undropped = torch.nn.functional.linear(hidden, weight, bias).argmax(-1)  # [N]
    return tokens_of_samples(logits, samples, nodes, undropped, 0.0, 1.0, 0, None)[0]


def every_sample_argmax(hidden, weight, cfg, seed, rescale):
    """[K, N] the argmax of every sample at every node, each computed (the reference for the engine's skips)."""
    masks = dropout_masks(cfg.k, hidden, cfg.p, cfg.protect, torch.Generator().manual_seed(seed), rescale)
    return (hidden[None] * masks @ weight.T).argmax(-1)


def nodes_at(*indices, n=7):
    nodes = torch.zeros(n, dtype=torch.bool)
    nodes[list(indices)] = True
    return nodes


def test_sampled_rows_subset_gives_the_same_decisions():
    gen_data = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=gen_data)
    weight = torch.randn(V, 16, generator=gen_data)
    cfg = DropMatchConfig(k=4, p=0.3)
    all_rows = sample_argmax(hidden, weight, nodes_at(*range(7)), cfg, seed=3)
    some_rows = sample_argmax(hidden, weight, nodes_at(0, 2, 5), cfg, seed=3)
    assert torch.equal(all_rows[:, [0, 2, 5]], some_rows[:, [0, 2, 5]])
    assert (some_rows[:, [1, 3, 4, 6]] == -1).all()
    assert (all_rows >= 0).all()
    assert torch.equal(all_rows, every_sample_argmax(hidden, weight, cfg, seed=3, rescale=True))


def reachable_scenario(undropped: list[int], sample_token: int, tree: DraftTree | None = None):
    """``reachable_sample_tokens`` on the 7-node tree (or ``tree``) with every sample's argmax forced to
    ``sample_token`` (the score ignores its input) and masks that drop at least one dimension of every sample."""
    tree = tree or DraftTree.from_parents(TOKENS, PARENTS)
    n = len(tree)
    hidden = torch.ones(n, 16)
    masks = torch.ones(4, n, 16)
    masks[..., 0] = 0  # every sample drops dimension 0: none is the undropped row
    scored = []

    def score(dropped):
        scored.append(dropped.shape[0])
        return forced_logits([sample_token] * dropped.shape[0])
    undropped = torch.tensor(undropped)
    tokens, rows = reachable_sample_tokens(hidden, masks, tree, undropped, deciding_nodes(tree, undropped), False,
                                           score)
    return tokens, rows, scored


def test_reachable_rows_root_rejects_everything():
    """Neither the undropped token nor any sample matches a child of the root: only the root's 4 samples
    are scored, in one product, and no deeper node is computed."""
    tokens, rows, scored = reachable_scenario([0, 3, 5, 0, 0, 6, 0], sample_token=8)
    assert rows == 4 and scored == [4]
    assert (tokens[:, 0] == 8).all() and (tokens[:, 1:] == -1).all()


def test_reachable_rows_follow_exact_and_sample_accepted_branches():
    """The root's undropped token accepts node 1 and its samples (all 2) node 2: both are reached, so their
    samples are scored at depth 1, in one product of 8 rows. Neither opens a child (nodes 1 and 2 accept
    {7, 2}), so node 5 is not reached and nothing more is scored; leaves (3, 4, 6) never are."""
    tokens, rows, scored = reachable_scenario([1, 7, 7, 0, 0, 0, 0], sample_token=2)
    assert scored == [4, 8] and rows == 12
    assert (tokens[:, [0, 1, 2]] == 2).all() and (tokens[:, [3, 4, 5, 6]] == -1).all()


def test_reachable_rows_go_deeper_through_a_sample_accepted_node():
    """Node 2 is reached only through the root's samples; its undropped token (5) then reaches node 5, whose
    samples are scored at depth 2. Node 2's own samples are not scored: its only child is its undropped
    token, accepted whatever they say."""
    tokens, rows, scored = reachable_scenario([1, 7, 5, 0, 0, 0, 0], sample_token=2)
    assert scored == [4, 4, 4] and rows == 12
    assert (tokens[:, [0, 1, 5]] == 2).all() and (tokens[:, [2, 3, 4, 6]] == -1).all()


def test_reachable_rows_skip_nodes_whose_only_child_is_the_undropped_token():
    """The undropped tokens accept the chain 0 -> 2 -> 5 -> 6 alone (node 1 is not a root's sample: they all
    say 8). Nodes 2 and 5 have one child each, their undropped token: nothing is scored below the root."""
    tokens, rows, scored = reachable_scenario([2, 7, 5, 0, 0, 6, 0], sample_token=8)
    assert scored == [4] and rows == 4
    assert (tokens[:, 0] == 8).all() and (tokens[:, 1:] == -1).all()


def test_reachable_rows_pass_a_root_whose_only_child_is_the_undropped_token():
    """Chain 0 -> 1, then node 1 branches into 2 and 3. The root decides nothing (its only child is its
    undropped token), yet node 1 is reached and decides: its samples are scored at depth 1, and accept 3."""
    tree = DraftTree.from_parents(torch.tensor([9, 1, 2, 3]), torch.tensor([-1, 0, 1, 1]))
    tokens, rows, scored = reachable_scenario([1, 2, 0, 0], sample_token=3, tree=tree)
    assert scored == [4] and rows == 4
    assert (tokens[:, 1] == 3).all() and (tokens[:, [0, 2, 3]] == -1).all()


def test_deciding_nodes_have_a_child_other_than_the_undropped_token():
    tree = DraftTree.from_parents(TOKENS, PARENTS)
    # root: children 1, 2 (one differs); node 1: children 3, 4, undropped 3; node 2: only child 5 = undropped;
    # node 5: only child 6, undropped 0; leaves never decide.
    deciding = deciding_nodes(tree, torch.tensor([1, 3, 5, 9, 9, 0, 9]))
    assert deciding.tolist() == [True, True, False, False, False, True, False]


def test_reachable_rows_decide_as_all_rows_on_random_samples():
    """On random inputs and weights (masks shared), on two tree shapes (one whose root has an only child) with
    half the nodes carrying their parent's undropped token (so that many nodes do not decide), the scored
    nodes get the tokens the all-rows variant gives them, the verifier picks the same path from either, and
    every deciding node of the path (the agreement counts' nodes) is scored; over all trees, fewer rows are."""
    lazy_rows = all_rows = 0
    for seed in range(20):
        gen_data = torch.Generator().manual_seed(seed)
        hidden = torch.randn(7, 16, generator=gen_data, dtype=torch.float64)
        weight = torch.randn(V, 16, generator=gen_data, dtype=torch.float64)
        parents = PARENTS if seed % 2 else CHAIN_FIRST_PARENTS
        undropped = first_argmax(hidden @ weight.T)
        tokens_tree = torch.randint(0, V, (7,), generator=gen_data)
        on_path = torch.rand(7, generator=gen_data) < 0.5  # half the nodes carry their parent's undropped token
        tokens_tree[1:] = torch.where(on_path[1:], undropped[parents[1:]], tokens_tree[1:])
        tree = DraftTree.from_parents(tokens_tree, parents)
        masks = dropout_masks(5, hidden, 0.3, 0, torch.Generator().manual_seed(seed), rescale=False)
        every = first_argmax(torch.einsum("knh,vh->knv", hidden[None] * masks, weight))  # [K, N]
        every = torch.where(tree.has_children[None], every, -1)
        deciding = deciding_nodes(tree, undropped)
        lazy, rows = reachable_sample_tokens(hidden, masks, tree, undropped, deciding, False, lambda x: x @ weight.T)
        every_path, path = paths_of(tree, undropped, every, lazy)
        assert every_path == path
        computed = (lazy >= 0).any(0)
        assert torch.equal(lazy[:, computed], every[:, computed])
        path = torch.tensor(path)
        assert computed[path][deciding[path]].all()
        lazy_rows, all_rows = lazy_rows + rows, all_rows + 5 * int(tree.has_children.sum())
    assert lazy_rows < all_rows


def linear_head(weight: torch.Tensor) -> TargetLMHead:
    """A bias-free LM head with this [V, H] weight (its dtype too)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data.copy_(weight)
    return TargetLMHead(linear)


def paths_of(tree: DraftTree, undropped: torch.Tensor, *sample_tokens: torch.Tensor) -> list[list[int]]:
    """The verifier's path under the match rule for each [K, N] set of sample tokens."""
    paths = []
    for samples in sample_tokens:
        sets = dropmatch_match(TargetView(None, undropped, samples), DraftView(tree.tokens, tree.parents))
        paths.append(longest_accepted_path(tree.tokens, tree.parents, tree.depths, tree.ancestors, sets).tolist())
    return paths


# A designed head for contested rows (H = 4): with hidden (1, 1, 0, 0) token 1 scores 2 and token 2 scores
# 1.5, so 1 is the undropped token; a sample that drops dimension 0 scores token 1 at 1 and token 2 at 1.5
# (token 2 wins), one that drops dimension 1 scores them 1 and 0 (token 1 wins). Token 3 is (0, 0, 1, 0).
CONTEST_WEIGHT = torch.zeros(V, 4)
CONTEST_WEIGHT[1, :2] = 1.0
CONTEST_WEIGHT[2, 1] = 1.5
CONTEST_WEIGHT[3, 2] = 1.0
ONE_ONE = torch.tensor([1.0, 1.0, 0.0, 0.0])


def contested_scenario(tokens: list[int], parents: list[int], hidden: torch.Tensor, root_drops: list[int | None]):
    """``contested_sample_tokens`` with ``CONTEST_WEIGHT``: sample k of the root drops dimension
    ``root_drops[k]`` (None: nothing); every other node's samples drop dimension 3, which no token reads.
    Returns the sample tokens, the rows scored, and the paths from them and from every sample's argmax."""
    tree = DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents))
    head = linear_head(CONTEST_WEIGHT)
    masks = torch.ones(len(root_drops), len(tokens), 4)
    masks[:, 1:, 3] = 0
    for k, dim in enumerate(root_drops):
        if dim is not None:
            masks[k, 0, dim] = 0
    logits = head(hidden)
    undropped = first_argmax(logits)
    scored = []

    def score(dropped):
        scored.append(dropped.shape[0])
        return head(dropped)
    tokens_out, rows = contested_sample_tokens(hidden, masks, tree, undropped, logits, head, False, score)
    every = first_argmax(head(hidden[None] * masks))  # [K, N]
    return tokens_out, rows, scored, paths_of(tree, undropped, tokens_out, every)


def test_contested_rows_score_only_the_sample_whose_child_wins():
    """Root 0 has children 1 (its undropped token) and 2; node 2's only child 3 is its undropped token.
    Only the root's sample that drops dimension 0 makes token 2 win: it alone is scored, and it accepts
    node 2, so the path 0 -> 2 -> 3 is the one every sample's argmax gives."""
    hidden = torch.stack([ONE_ONE, ONE_ONE, torch.tensor([0.0, 0.0, 1.0, 0.0]), ONE_ONE])
    tokens, rows, scored, (path, every_path) = contested_scenario(
        [9, 1, 2, 3], [-1, 0, 0, 2], hidden, root_drops=[0, 1, None, 2])
    assert rows == 1 and scored == [1]
    assert tokens[0, 0] == 2 and (tokens[1:, 0] == -1).all() and (tokens[:, 1:] == -1).all()
    assert path == every_path == [0, 2, 3]


def test_contested_rows_score_nothing_when_no_child_can_win():
    """The same tree, but no root sample drops dimension 0: token 1 wins every sample, nothing is scored,
    and the path is the undropped one (0 -> 1)."""
    hidden = torch.stack([ONE_ONE, ONE_ONE, torch.tensor([0.0, 0.0, 1.0, 0.0]), ONE_ONE])
    tokens, rows, scored, (path, every_path) = contested_scenario(
        [9, 1, 2, 3], [-1, 0, 0, 2], hidden, root_drops=[1, None, 2, 1])
    assert rows == 0 and scored == [] and (tokens == -1).all()
    assert path == every_path == [0, 1]


def test_contested_rows_skip_a_child_that_cannot_outrank_the_exact_path():
    """Node 2 (token 2) wins the root's sample that drops dimension 0, but it is a leaf at depth 1 while the
    exact rule already reaches node 3 at depth 2: accepting it cannot change the path, so nothing is scored.
    When the child instead leads to a node as deep as the exact path's end and with a lower index, the path
    would end there: the sample is scored, and the path moves to it."""
    leaf = torch.tensor([0.0, 0.0, 1.0, 0.0])  # token 3 wins it
    _, rows, scored, (path, every_path) = contested_scenario(
        [9, 1, 2, 3], [-1, 0, 0, 1], torch.stack([ONE_ONE, leaf, leaf, leaf]), root_drops=[0, 1, None, 1])
    assert rows == 0 and scored == []
    assert path == every_path == [0, 1, 3]
    tokens, rows, scored, (path, every_path) = contested_scenario(
        [9, 2, 1, 3, 3], [-1, 0, 0, 1, 2], torch.stack([ONE_ONE, leaf, leaf, leaf, leaf]),
        root_drops=[0, 1, None, 1])
    assert rows == 1 and tokens[0, 0] == 2
    assert path == every_path == [0, 1, 3]  # not the exact rule's 0 -> 2 -> 4


def test_contested_rows_skip_nodes_that_cannot_be_reached():
    """Node 2 (token 2) hangs under the root, whose samples all drop dimension 1, so token 1 wins them and
    node 2 is never accepted. Node 2's samples drop dimension 0, so its child (token 2 again) wins them and
    passes the contest test; but node 2 cannot be reached, so none of them is scored."""
    hidden = torch.stack([ONE_ONE, ONE_ONE, ONE_ONE, ONE_ONE])
    tree_tokens, tree_parents = [9, 1, 2, 2], [-1, 0, 0, 2]
    tree = DraftTree.from_parents(torch.tensor(tree_tokens), torch.tensor(tree_parents))
    head = linear_head(CONTEST_WEIGHT)
    masks = torch.ones(3, 4, 4)
    masks[:, 0, 1] = 0  # the root's samples drop dimension 1: token 1 wins them
    masks[:, 2, 0] = 0  # node 2's samples drop dimension 0: token 2 (its child) wins them
    undropped = first_argmax(head(hidden))
    contest = contested_children(hidden, masks, tree, rival_tokens(head(hidden), undropped, 4), head)
    assert contest[:, 2].all() and not contest[:, 1].any()  # node 2's samples would accept node 3, the root's
    assert contest[:, 0].all()  # not node 2; node 1 carries the root's undropped token, a rival: it passes
    tokens, rows = contested_sample_tokens(hidden, masks, tree, undropped, head(hidden), head, False, head)
    assert rows == 0 and (tokens == -1).all()


@pytest.mark.parametrize("dtype, softcap", [(torch.float64, None), (torch.bfloat16, None), (torch.bfloat16, 2.0)])
def test_contested_rows_decide_as_all_rows_on_random_samples(dtype, softcap):
    """On random inputs and weights whose rows 1-4 nearly tie with row 0 (so that rounding decides many
    samples), in fp64 and in bf16 (the scorer rounds its logits), also soft-capped as Gemma's are (which ties
    more of them), on two tree shapes: every child that is a sample's argmax passes ``contested_children``,
    the scored samples get the tokens every sample's argmax gives them, the verifier picks the same path, and
    far fewer rows are scored."""
    contested_rows = all_rows = 0
    for seed in range(40):
        gen_data = torch.Generator().manual_seed(seed)
        hidden = torch.randn(7, 16, generator=gen_data).to(dtype)
        weight = torch.randn(V, 16, generator=gen_data)
        weight[1:5] = weight[0] + 0.02 * torch.randn(4, 16, generator=gen_data)
        head = linear_head(weight.to(dtype))
        head.softcap = softcap
        parents = PARENTS if seed % 2 else CHAIN_FIRST_PARENTS
        logits = head(hidden)
        undropped = first_argmax(logits)
        tokens_tree = torch.randint(0, 5, (7,), generator=gen_data)  # the near-tied tokens
        tree = DraftTree.from_parents(tokens_tree, parents)
        masks = dropout_masks(5, hidden, 0.3, 0, torch.Generator().manual_seed(seed), rescale=False)
        every = first_argmax(head(hidden[None] * masks))  # [K, N], as the scorer rounds them
        wins = (every[:, parents[1:]] == tokens_tree[1:]) & (tokens_tree[1:] != undropped[parents[1:]])
        contest = contested_children(hidden, masks, tree, rival_tokens(logits, undropped, 8), head)
        assert not (wins & ~contest).any()  # sound: no winning child fails the test
        lazy, rows = contested_sample_tokens(hidden, masks, tree, undropped, logits, head, False, head)
        scored = lazy >= 0
        assert torch.equal(lazy[scored], every[scored])
        path, every_path = paths_of(tree, undropped, lazy, torch.where(tree.has_children[None], every, -1))
        assert path == every_path
        contested_rows, all_rows = contested_rows + rows, all_rows + 5 * int(tree.has_children.sum())
    assert contested_rows < all_rows / 3


def test_may_win_allows_for_the_scorers_rounding_and_nothing_more():
    """One rounding (bf16 steps are 1/16 near 8): a child a whole step below its rival cannot win; one that
    rounds to the rival's value can (a tie goes to the lower id), and so can one that the sums' error may
    lift into it. A soft cap rounds three more times and can tie logits that differ, so after it a child is
    compared on its transformed logit, with a slack for the roundings of the soft cap's three ops."""
    bf16, zero = torch.bfloat16, torch.tensor(0.0)
    win = partial(may_win, dtype=bf16, steps=1, size=zero)
    assert not win(torch.tensor(8.0), torch.tensor(8.0625), zero)  # a step below
    assert win(torch.tensor(8.04), torch.tensor(8.0625), zero)  # rounds to 8.0625: a tie
    assert not win(torch.tensor(8.0), torch.tensor(8.125), torch.tensor(0.02))  # 8.02 and 8.105: a step apart
    assert win(torch.tensor(8.0), torch.tensor(8.125), torch.tensor(0.04))  # 8.04 and 8.085: a tie
    head = TargetLMHead(torch.nn.Linear(1, 2, bias=False))
    head.softcap = 30.0  # Gemma 2's
    raw = torch.tensor([15.8125, 15.875])  # bf16 values, the child's below its rival's
    capped = head.transform(raw.to(bf16))  # the scorer's logits, rounded at each op
    assert capped[0] == capped[1]  # the child (id 0) would win the tie
    child, best = head.transform(raw)  # this test's, in fp32: 14.494 and 14.542, a bf16 step apart
    assert child.to(bf16) < best.to(bf16)
    assert may_win(child, best, zero, bf16, head.rounding_steps, raw.abs().max())


def test_the_lm_heads_largest_row_norm_follows_its_weight():
    """The bound on the test's rounding uses the head's largest row norm, kept between rounds and computed
    again after the weight changes (in place or replaced)."""
    linear = torch.nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[3.0, 4.0, 0, 0], [1.0, 0, 0, 0], [0, 0, 0, 2.0]]))
    head = TargetLMHead(linear)
    assert head.max_row_norm().item() == 5.0
    with torch.no_grad():
        linear.weight[1, 0] = 12.0
    assert head.max_row_norm().item() == 12.0
    head.weight = torch.nn.Parameter(torch.ones(3, 4, dtype=torch.float64))
    assert head.max_row_norm().item() == 2.0 and head.max_row_norm().dtype == torch.float32


def test_rival_tokens_are_the_undropped_token_and_the_best_of_the_best_blocks():
    """Over a vocabulary of many blocks, the rivals are the undropped token, then the best few tokens of each
    of the blocks with the highest maxima; over a small one, its exact top tokens."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 16 * RIVAL_BLOCK + 7, generator=gen)  # a partial last block too
    undropped = first_argmax(logits)
    rivals = rival_tokens(logits, undropped, blocks=4, per_block=2)
    assert rivals.shape == (3, 9) and torch.equal(rivals[:, 0], undropped)
    blocks = logits[:, :16 * RIVAL_BLOCK].unflatten(-1, (16, RIVAL_BLOCK))
    best_blocks = blocks.amax(-1).topk(4, dim=-1).indices  # [3, 4]
    assert torch.equal(rivals[:, 1:] // RIVAL_BLOCK, best_blocks.repeat_interleave(2, dim=1))
    inside = blocks.gather(1, best_blocks[..., None].expand(-1, -1, RIVAL_BLOCK)).topk(2, dim=-1).values
    assert torch.equal(logits.gather(1, rivals[:, 1:]), inside.flatten(1))
    small = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    assert rival_tokens(small, torch.tensor([1]), blocks=3, per_block=1).tolist() == [[1, 1, 3, 2]]


def test_samples_that_drop_nothing_are_skipped_and_take_the_undropped_token():
    gen_data = torch.Generator().manual_seed(4)
    hidden = torch.randn(7, 16, generator=gen_data, dtype=torch.float64)
    weight = torch.randn(V, 16, generator=gen_data, dtype=torch.float64)
    for p in (0.01, 0.05, 0.3):
        cfg = DropMatchConfig(k=5, p=p)
        samples = dropout_inputs(hidden, nodes_at(*range(7)), cfg, torch.Generator().manual_seed(2), rescale=False)
        masks = dropout_masks(5, hidden, p, 0, torch.Generator().manual_seed(2), rescale=False)
        touched = (masks == 0).any(-1)  # [K, N]
        assert len(samples.sample) == int(touched.sum())  # exactly the samples that drop something
        assert touched[samples.sample, samples.node].all()
        tokens = sample_argmax(hidden, weight, nodes_at(*range(7)), cfg, seed=2, rescale=False)
        assert torch.equal(tokens, every_sample_argmax(hidden, weight, cfg, seed=2, rescale=False))
    few = dropout_inputs(hidden, nodes_at(*range(7)), DropMatchConfig(k=5, p=0.01),
                         torch.Generator().manual_seed(2), rescale=False)
    assert len(few.sample) < 35 // 2  # at p = 0.01 over 16 dims most samples drop nothing: not computed
    rescaled = dropout_inputs(hidden, nodes_at(*range(7)), DropMatchConfig(k=5, p=0.01),
                              torch.Generator().manual_seed(2), rescale=True)
    assert len(rescaled.sample) == 35  # with the factor every sample differs from the undropped row


def test_one_matmul_gives_the_undropped_and_the_sample_logits():
    gen_data = torch.Generator().manual_seed(5)
    lm_head = TargetLMHead(torch.nn.Linear(16, V, bias=True))
    hidden = torch.randn(7, 16, generator=gen_data)
    samples = dropout_inputs(hidden, nodes_at(0, 1, 2, 5), DropMatchConfig(k=3, p=0.3),
                             torch.Generator().manual_seed(1))
    assert samples.inputs.shape == (3 * 4, 16)
    with torch.no_grad():
        logits, sample_logits = lm_head_with_samples(lm_head, hidden, samples.inputs)
        assert torch.allclose(logits, lm_head(hidden), atol=1e-6)
        assert sample_logits.shape == (12, V)
        assert torch.allclose(sample_logits, lm_head(samples.inputs), atol=1e-6)
        plain, none = lm_head_with_samples(lm_head, hidden, None)
    assert none is None and torch.equal(plain, lm_head(hidden).detach())


def test_shortlist_holds_each_decision_nodes_top_tokens_and_the_drafts_sorted():
    logits = torch.tensor([[0., 5, 4, 3, 0, 0, 0, 0, 0, 1],   # node 0: top-2 {1, 2}
                           [9., 0, 0, 0, 0, 0, 0, 0, 8, 0],   # node 1: no children, its top is not needed
                           [0., 0, 0, 0, 0, 0, 7, 6, 0, 0]])  # node 2: top-2 {6, 7}
    draft_tokens = torch.tensor([9, 4, 4])
    ids = shortlist_ids(logits, torch.tensor([True, False, True]), draft_tokens, m=2)
    assert ids.tolist() == [1, 2, 4, 6, 7, 9]
    assert shortlist_ids(logits, torch.tensor([True, False, True]), draft_tokens, m=V).tolist() == list(range(V))


def test_shortlist_sample_token_is_its_best_shortlisted_token():
    """A sample whose full argmax lies outside the shortlist takes its best token inside it (the approximation
    ``--dropmatch-shortlist`` makes); one whose argmax is inside gets the same token as the full rule."""
    lm_head = TargetLMHead(torch.nn.Linear(2, V, bias=False))
    with torch.no_grad():
        lm_head.weight.zero_()
        lm_head.weight[3] = torch.tensor([1.0, 0.0])   # the undropped favourite: reads dimension 0
        lm_head.weight[5] = torch.tensor([0.0, 0.6])   # a draft token: reads dimension 1
        lm_head.weight[8] = torch.tensor([-1.0, 0.9])  # outside the shortlist, best once dimension 0 drops
    hidden = torch.tensor([[2.0, 1.0]])  # one node: undropped logits 3 -> 2.0, 5 -> 0.6, 8 -> -1.1
    nodes = torch.tensor([True])
    samples = dropout_inputs(hidden, nodes, DropMatchConfig(k=2, p=0.5), None, rescale=False)
    samples.inputs = torch.tensor([[0.0, 1.0], [2.0, 0.0]])  # sample 0 drops dimension 0, sample 1 dimension 1
    samples.sample, samples.node = torch.tensor([0, 1]), torch.tensor([0, 0])
    with torch.no_grad():
        logits, full_logits = lm_head_with_samples(lm_head, hidden, samples.inputs)
        ids = shortlist_ids(logits, nodes, torch.tensor([5]), m=1)
        short_logits = shortlist_logits(lm_head, samples.inputs, ids)
    assert ids.tolist() == [3, 5] and short_logits.shape == (2, 2)
    undropped = logits.argmax(-1)
    full, _ = tokens_of_samples(full_logits, samples, nodes, undropped, 0.0, 1.0, 0, None)
    short, _ = tokens_of_samples(short_logits, samples, nodes, undropped, 0.0, 1.0, 0, None, vocab_ids=ids)
    assert full[:, 0].tolist() == [8, 3]
    assert short[:, 0].tolist() == [5, 3]  # token 8 is not scored: the draft token 5 wins sample 0


def test_masks_are_inverted_dropout_and_protect_dimensions():
    hidden = torch.randn(6, 32)
    hidden[:, 7] = 100.0
    masks = dropout_masks(8, hidden, 0.5, 1, torch.Generator().manual_seed(0))
    assert set(masks.unique().tolist()) <= {0.0, 2.0}
    assert (masks[:, :, 7] == 2.0).all()
    assert not (dropout_masks(8, hidden, 0.5, 0, torch.Generator().manual_seed(0))[:, :, 7] == 2.0).all()
    plain = dropout_masks(8, hidden, 0.5, 1, torch.Generator().manual_seed(0), rescale=False)
    assert torch.equal(plain * 2.0, masks)  # the same draws, without the 1/(1-p) factor


def test_rescale_is_left_out_only_where_it_cannot_change_a_decision():
    match = DropMatchConfig(k=5, p=0.3)
    assert not rescale_needed(match, 0.0, None)
    assert rescale_needed(match, 0.7, None)  # sampling: the scale sharpens the distribution
    assert rescale_needed(match, 0.0, torch.zeros(V))  # a bias: the scale moves the argmax
    assert rescale_needed(DropMatchConfig(k=5, p=0.3, rule="js"), 0.0, None)  # js compares distributions


def test_a_sample_that_drops_nothing_is_bit_identical_in_bf16():
    # Why an uncomputed sample may take the undropped token: computed, its row is bit for bit the undropped one.
    gen_data = torch.Generator().manual_seed(3)
    hidden = (torch.randn(7, 16, generator=gen_data) * 4).to(torch.bfloat16)
    lm_head = TargetLMHead(torch.nn.Linear(16, V, bias=False).to(torch.bfloat16))
    nothing_dropped = dropout_masks(5, hidden, 0.01, 16, torch.Generator().manual_seed(0), rescale=False)
    assert (nothing_dropped == 1).all()  # every dimension protected
    with torch.no_grad():
        logits, samples = lm_head_with_samples(lm_head, hidden, (hidden[None] * nothing_dropped).reshape(35, 16))
    assert torch.equal(samples.reshape(5, 7, V), logits.expand(5, -1, -1))
    skipped = dropout_inputs(hidden, nodes_at(*range(7)), DropMatchConfig(k=5, p=0.01, protect=16),
                             torch.Generator().manual_seed(0), rescale=False)
    assert len(skipped.sample) == 0  # and the engine does not compute them at all


def test_protecting_every_dimension_is_exact():
    hidden = torch.randn(7, 16)
    weight = torch.randn(V, 16)
    logits = hidden @ weight.T
    cfg = DropMatchConfig(k=5, p=0.3, protect=16)
    tokens = sample_argmax(hidden, weight, nodes_at(*range(7)), cfg, seed=0)
    # protected everywhere: h_i = h / (1 - p), a positive rescale, so every sample is the argmax
    assert torch.equal(tokens, logits.argmax(-1).expand(5, -1))


def test_process_logits_top_p_and_top_k():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(process_logits(logits, 1.0, top_p=0.7), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(process_logits(logits, 1.0, top_k=1), torch.tensor([1.0, 0, 0, 0]))
    assert torch.allclose(process_logits(logits, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("vocab", [3 * ARGMAX_BLOCK, 3 * ARGMAX_BLOCK + 37, 49152])
def test_first_argmax_is_max_indices_with_its_tie_break(dtype, vocab):
    """The blocked CPU argmax returns what ``max(dim=-1).indices`` returns: the first maximum, also over
    ties across blocks, a maximum in the partial last block, all -inf rows and NaNs."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-3, 4, (2, 6, vocab), generator=gen).to(dtype)  # integer values: ties everywhere
    logits[0, 0] = float("-inf")
    logits[0, 1, -1] = 50  # the winner is the last entry
    logits[0, 2, [5, ARGMAX_BLOCK + 5, vocab - 2]] = 50  # tied winners in three blocks: the first one
    logits[0, 3, [ARGMAX_BLOCK + 9, vocab - 1]] = float("nan")
    logits[1] = torch.randn(6, vocab, generator=gen).to(dtype)
    expected = logits.max(dim=-1).indices
    assert torch.equal(first_argmax(logits), expected)
    assert int(expected[0, 2]) == 5 and int(expected[0, 1]) == vocab - 1
    assert torch.equal(choose_tokens(logits, 0.0, 1.0, 0, None), expected)


def test_choose_tokens_is_seeded():
    logits = torch.randn(5, V)
    a = choose_tokens(logits, 1.0, 1.0, 0, torch.Generator().manual_seed(0))
    b = choose_tokens(logits, 1.0, 1.0, 0, torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    assert torch.equal(choose_tokens(logits, 0.0, 1.0, 0, None), logits.argmax(-1))


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    expected = probs * n
    keep = expected >= 5
    rest_e, rest_c = expected[~keep].sum(), counts[~keep].sum()
    stat = (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum()
    cells = int(keep.sum())
    if rest_e > 0:
        stat = stat + (rest_c - rest_e) ** 2 / rest_e
        cells += 1
    return float(stat), cells - 1


def test_sampling_preserves_the_target_distribution():
    """The joint law of the first two tokens under tree decoding at T=0.9, top-p 0.95 equals the target's.

    Three tokens are generated so that the second one is committed by the first speculative round as an
    accepted draft or as the round's own draw (with two, the commit cuts that round to one token, so no draft
    ever counts): about 30% of the runs take their second token from an accepted draft, and the chi-square
    test of the first two tokens covers both ways.
    """
    from conftest import tiny_head, tiny_target
    from eagle_dropmatch.drafters import Eagle3Drafter
    from eagle_dropmatch.generate import DecodeConfig, SpeculativeDecoder
    vocab = 8
    target = tiny_target(seed=2, vocab=vocab, hidden=32)
    with torch.no_grad():  # flatten the random target so several tokens carry mass
        target.lm_head.weight.mul_(0.2)
    prompt = torch.tensor([1, 5, 3])
    temperature, top_p = 0.9, 0.95
    with torch.no_grad():
        p1 = process_logits(target(prompt[None]).logits[0, -1], temperature, top_p)
        seqs = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        p2 = process_logits(target(seqs).logits[:, -1], temperature, top_p)
    joint = (p1[:, None] * p2).flatten()
    engine = SpeculativeDecoder(target, [2, 4, 5])
    drafter = Eagle3Drafter(tiny_head(target, seed=1, std=0.5), 8, 3, 3)
    runs = 2400
    counts = torch.zeros(vocab * vocab)
    accepted_drafts = 0
    for seed in range(runs):
        out = engine.generate(prompt, drafter, DecodeConfig(max_new_tokens=3, temperature=temperature,
                                                            top_p=top_p, seed=seed))
        assert len(out.token_ids) == 3 and sum(out.accept_lengths) == 3 and out.accept_lengths[0] == 1
        counts[out.token_ids[0] * vocab + out.token_ids[1]] += 1
        accepted_drafts += out.accept_lengths[1] > 1  # the second token is a draft the first round accepted
    assert accepted_drafts > runs * 0.2, accepted_drafts  # the draft path is really exercised
    assert counts[joint == 0].sum() == 0  # nothing outside the nucleus (the statistic pools those cells)
    stat, dof = _chi_square(counts, joint)
    assert stat < dof + 6 * (2 * dof) ** 0.5, (stat, dof)


def full_vocabulary_disagreement(hidden, weight, p, seed, k=5):
    """Share of positions where one of K fresh dropout samples' full-vocabulary argmax is not the undropped one."""
    masks = dropout_masks(k, hidden, p, 0, torch.Generator().manual_seed(seed))  # [K, P, H]
    dropped = hidden[None] * masks
    return float(((dropped @ weight.T).argmax(-1) != (hidden @ weight.T).argmax(-1)).any(0).float().mean())


def test_auto_p_reaches_the_requested_disagreement_rate_and_is_deterministic():
    from eagle_dropmatch.dropmatch import calibrate_dropout_p
    gen_data = torch.Generator().manual_seed(5)
    vocab, width = 500, 48
    hidden = torch.randn(64, width, generator=gen_data)
    weight = torch.randn(vocab, width, generator=gen_data)
    for rate in (0.05, 0.2, 0.5):
        p1 = calibrate_dropout_p(hidden, weight, None, 5, rate, 0, torch.Generator().manual_seed(1))
        p2 = calibrate_dropout_p(hidden, weight, None, 5, rate, 0, torch.Generator().manual_seed(1))
        assert p1 == p2 and 1e-4 < p1 < 0.5
        # measured over the whole vocabulary on fresh masks, the disagreement is near the requested rate
        measured = full_vocabulary_disagreement(hidden, weight, p1, seed=9)
        assert abs(measured - rate) < 0.12, (rate, p1, measured)


def test_calibration_shortlist_covering_the_vocabulary_is_the_full_rate():
    from eagle_dropmatch.dropmatch import disagreement_rate
    gen_data = torch.Generator().manual_seed(6)
    hidden = torch.randn(40, 16, generator=gen_data)
    weight = torch.randn(V, 16, generator=gen_data)
    uniforms = torch.rand((5,) + hidden.shape, generator=torch.Generator().manual_seed(2))
    for p in (0.05, 0.3):
        rate = disagreement_rate(hidden, weight[None].expand(40, -1, -1), None, uniforms, p, 0)
        dropped = hidden[None] * (uniforms >= p) / (1 - p)
        direct = ((dropped @ weight.T).argmax(-1) != (hidden @ weight.T).argmax(-1)).any(0).float().mean()
        assert rate == pytest.approx(float(direct)) and 0 < rate < 1


def test_auto_protect_finds_the_outlier_dimensions():
    from eagle_dropmatch.dropmatch import choose_protect
    hidden = torch.randn(30, 64)
    assert choose_protect(hidden) == 0
    hidden[:, 17] = 12.0
    hidden[:, 40] = -9.0
    assert choose_protect(hidden) == 2
