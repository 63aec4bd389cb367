"""Selection policies: rotation formula, staleness bounds, load-aware ranking, state."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moepec.errors import ConfigError, StructureMismatchError
from moepec.policy.selection import (
    Selection,
    Selector,
    load_aware_pick,
    select_two_tier,
    sequential_pick,
    snapshot_gap_bound,
)

n_and_k = st.integers(1, 32).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n)))


def max_gaps(saves: list[list[int]], n: int, checkpoints: int) -> int:
    """Largest distance between saves of any expert, counting a virtual save at -1 and
    the open gap at the end (the next save must come by `checkpoints` at the latest)."""
    last = [-1] * n
    worst = 0
    for c, experts in enumerate(saves):
        for e in experts:
            worst = max(worst, c - last[e])
            last[e] = c
    return max([worst] + [checkpoints - x for x in last])


def run_sequential(sel: Selector, ks: list[int]) -> list[list[tuple[int, ...]]]:
    out = []
    for c, k in enumerate(ks):
        picked = sel.select(k)
        sel.commit(picked, c)
        out.append(picked)
    return out


# ---------------------------------------------------------------- sequential


def test_sequential_pick_worked_example():
    assert sequential_pick(6, 8, 3) == ((0, 6, 7), 1)
    assert sequential_pick(0, 8, 2, frozenset({0, 2})) == ((1, 3), 4)
    assert sequential_pick(0, 4, 9, frozenset({1})) == ((0, 2, 3), 0)  # capped at 3
    assert sequential_pick(5, 8, 0) == ((), 5)


def test_paper_k1_rule():
    """K=1: layer m saves expert (m + c) mod N at checkpoint c."""
    sel = Selector.create([8, 8, 8, 8])
    history = run_sequential(sel, [1] * 10)
    for c, picked in enumerate(history):
        assert picked == [((m + c) % 8,) for m in range(4)]


@settings(max_examples=60, deadline=None)
@given(n_and_k, st.integers(1, 5))
def test_constant_k_formula(nk, layers):
    n, k = nk
    history = run_sequential(Selector.create([n] * layers), [k] * (2 * n + 1))
    for c, picked in enumerate(history):
        for m in range(layers):
            assert picked[m] == tuple(sorted({(m + c * k + j) % n for j in range(k)}))


@settings(max_examples=100, deadline=None)
@given(st.lists(n_and_k, min_size=1, max_size=4))
def test_coverage_bound_mixed_layers(layer_nk):
    """Every expert is saved at least every ceil(N/K) checkpoints, from the start."""
    # One selector per layer so K may differ per layer (N differs per layer anyway).
    for m, (n, k) in enumerate(layer_nk):
        sel = Selector(n_experts=(n,), cursors=[m % n])
        steps = 2 * math.ceil(n / k) + 3
        history = [p[0] for p in run_sequential(sel, [k] * steps)]
        assert max_gaps(history, n, steps) <= math.ceil(n / k)


def test_coverage_exhaustive_small():
    for n in range(1, 33):
        for k in range(1, n + 1):
            steps = math.ceil(n / k) + 2
            history = [p[0] for p in run_sequential(Selector.create([n]), [k] * steps)]
            assert max_gaps(history, n, steps) <= math.ceil(n / k), (n, k)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 16), st.integers(2, 8))
def test_staggered_layers(n, layers):
    first = Selector.create([n] * layers).select(1)
    assert first == [(m % n,) for m in range(layers)]
    assert len(set(first[: min(n, layers)])) == min(n, layers)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 16).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.integers(1, n), min_size=1, max_size=40))))
def test_dynamic_k_stays_fair(n_ks):
    """With K varying, any run of checkpoints whose K sum to >= N saves every expert."""
    n, ks = n_ks
    history = [p[0] for p in run_sequential(Selector.create([n]), ks)]
    for start in range(len(ks)):
        total, seen = 0, set()
        for c in range(start, len(ks)):
            total += ks[c]
            seen |= set(history[c])
            if total >= n:
                assert seen == set(range(n))
                break


# ---------------------------------------------------------------- load aware


def reference_top_k(tokens, last, k, exclude):
    left = [e for e in range(len(tokens)) if e not in exclude]
    chosen = []
    for _ in range(min(k, len(left))):
        best = left[0]
        for e in left[1:]:
            if tokens[e] > tokens[best] or (
                tokens[e] == tokens[best]
                and (last[e] < last[best] or (last[e] == last[best] and e < best))
            ):
                best = e
        chosen.append(best)
        left.remove(best)
    return tuple(sorted(chosen))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 5), min_size=n, max_size=n),
    st.lists(st.integers(-1, 3), min_size=n, max_size=n),
    st.integers(0, n),
    st.frozensets(st.integers(0, n - 1)),
)))
def test_load_aware_is_top_k_with_ties(args):
    tokens, last, k, exclude = args
    assert load_aware_pick(tokens, last, k, exclude) == reference_top_k(tokens, last, k, exclude)


def test_load_aware_worked_example():
    # 1 and 3 tie on tokens; 3 is staler (never saved), so it wins.
    assert load_aware_pick([5, 9, 0, 9], [0, 2, -1, -1], 1) == (3,)
    assert load_aware_pick([5, 9, 0, 9], [0, 2, -1, -1], 2) == (1, 3)
    # All zero: never-saved first, then lowest id.
    assert load_aware_pick([0, 0, 0, 0], [1, -1, 0, -1], 3) == (1, 2, 3)
    sel = Selector.create([4], "load_aware")
    sel.observe([[1, 7, 3, 0]])
    assert sel.select(2) == [(1, 2)]
    sel.commit([(1, 2)], 0)
    assert sel.tokens_since_save == [[1, 0, 0, 0]] and sel.last_saved == [[-1, 0, 0, -1]]
    assert sel.select(2) == [(0, 3)]


# ---------------------------------------------------------------- state


counts_strategy = st.lists(st.lists(st.integers(0, 20), min_size=6, max_size=6),
                           min_size=3, max_size=3)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(Selection), st.lists(counts_strategy, max_size=6),
       st.lists(counts_strategy, min_size=1, max_size=6), st.integers(1, 6))
def test_select_pure_and_json_round_trip(policy, before, after, k):
    sel = Selector.create([6, 6, 6], policy)
    for c, counts in enumerate(before):
        sel.observe(counts)
        sel.commit(sel.select(k), c)
    frozen = sel.state_dict()
    sel.select(k)
    sel.select(k, exclude=[frozenset({0})] * 3)
    assert sel.state_dict() == frozen  # select does not mutate

    copy = Selector.create([6, 6, 6], policy)
    copy.load_state_dict(json.loads(json.dumps(frozen)))
    for c, counts in enumerate(after, start=len(before)):
        for s in (sel, copy):
            s.observe(counts)
        a, b = sel.select(k), copy.select(k)
        assert a == b
        sel.commit(a, c)
        copy.commit(b, c)
    assert sel.state_dict() == copy.state_dict()


def test_load_state_dict_rejects_other_structure():
    with pytest.raises(StructureMismatchError):
        Selector.create([8, 8]).load_state_dict(Selector.create([8, 4]).state_dict())


def test_bad_input_names_the_fix():
    with pytest.raises(ConfigError, match="sequential"):
        Selector.create([8], "random")
    sel = Selector.create([8, 4])
    for k in (0, 5):
        with pytest.raises(ConfigError, match="1..4"):
            sel.select(k)
    with pytest.raises(ConfigError, match="shape"):
        sel.observe([[1] * 8])
    with pytest.raises(ConfigError, match="outside"):
        sel.commit([(8,), (0,)], 0)
    with pytest.raises(ConfigError):
        sequential_pick(0, 4, 1, frozenset({4}))
    with pytest.raises(ConfigError):
        select_two_tier(Selector.create([8]), Selector.create([8]), 3, 2)


# ---------------------------------------------------------------- two tiers


def run_two_tier(n, kp, ks, steps, layers=1, policy="sequential"):
    persist = Selector.create([n] * layers, policy)
    ram = Selector.create([n] * layers, policy)
    snaps, pers = [], []
    for c in range(steps):
        s, p = select_two_tier(persist, ram, kp, ks)
        for sl, pl in zip(s, p):
            assert set(pl) <= set(sl) and len(sl) == ks and len(pl) == kp
        persist.commit(p, c)
        ram.commit(s, c)
        snaps.append(s)
        pers.append(p)
    return snaps, pers


two_tier_case = st.integers(1, 32).flatmap(lambda n: st.integers(1, n).flatmap(
    lambda kp: st.tuples(st.just(n), st.just(kp), st.integers(kp, n))))


@settings(max_examples=150, deadline=None)
@given(two_tier_case, st.integers(1, 3))
def test_two_tier_bounds(case, layers):
    n, kp, ks = case
    steps = 2 * math.ceil(n / kp) + 2
    snaps, pers = run_two_tier(n, kp, ks, steps, layers)
    bound = snapshot_gap_bound(n, kp, ks)
    assert bound <= math.ceil(n / kp)
    if ks % kp == 0:
        assert bound == math.ceil(n / ks)
    for m in range(layers):
        assert max_gaps([p[m] for p in pers], n, steps) <= math.ceil(n / kp)
        assert max_gaps([s[m] for s in snaps], n, steps) <= bound


def test_two_tier_worked_example():
    # N=8, K_p=1, K_s=2: the RAM copy sits opposite the persist cursor, so every expert
    # is in RAM every 4 checkpoints and on storage every 8.
    snaps, pers = run_two_tier(8, 1, 2, 4)
    assert [p[0] for p in pers] == [(0,), (1,), (2,), (3,)]
    assert [s[0] for s in snaps] == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_snapshot_bound_is_tight_where_ceil_n_over_ks_is_impossible():
    # N=6, K_p=2, K_s=3: no schedule meets ceil(6/3)=2 (S would alternate between a set
    # and its complement, but P_0 and P_2 = {0,1} and {4,5} must share one S); we get 3.
    assert snapshot_gap_bound(6, 2, 3) == 3
    snaps, _ = run_two_tier(6, 2, 3, 12)
    assert max_gaps([s[0] for s in snaps], 6, 12) == 3


@settings(max_examples=40, deadline=None)
@given(two_tier_case)
def test_two_tier_load_aware_subset(case):
    n, kp, ks = case
    run_two_tier(n, kp, ks, 5, layers=2, policy="load_aware")
