"""PLT accounting: the ledger against a reference built from Eq. 7, and the analytic
estimate against a Monte-Carlo run of the ledger with sequential selection."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moepec.errors import ConfigError, StructureMismatchError
from moepec.policy.plt import PLTLedger, expected_plt_sequential, plt_from_history
from moepec.policy.selection import Selector


def test_worked_example():
    ledger = PLTLedger.create([2])
    ledger.observe([[3, 1]])          # step 0
    copy_e0 = ledger.counts()          # expert 0 saved at step 0
    ledger.observe([[2, 2]])          # step 1
    at_t = ledger.counts()             # checkpoint at step 1 (expert 1 saved here)
    ledger.observe([[5, 5]])          # step 2: recomputed after the fault, not lost
    lost = ledger.record_recovery(at_t, [[copy_e0[0][0], at_t[0][1]]])
    assert lost == [[2, 0]]            # expert 0 lost step 1's 2 assignments
    assert ledger.cumulative == at_t and ledger.recoveries == 1
    ledger.observe([[1, 3]])          # step 2 again, other routing
    assert ledger.plt() == pytest.approx(2 / (5 + 3 + 1 + 3))
    assert ledger.layer_plt() == [ledger.plt()]


def test_layers_without_tokens_count_zero():
    ledger = PLTLedger.create([2, 3])
    ledger.observe([[1, 1], [0, 0, 0]])
    ledger.record_recovery([[1, 1], [0, 0, 0]], [[0, 1], [0, 0, 0]])
    assert ledger.layer_plt() == [0.5, 0.0]
    assert ledger.plt() == 0.25


def test_rejects_corrupt_and_misshapen_input():
    ledger = PLTLedger.create([2])
    ledger.observe([[1, 1]])
    before = ledger.state_dict()
    with pytest.raises(ValueError, match="corrupted"):
        ledger.record_recovery([[1, 1]], [[2, 0]])
    assert ledger.state_dict() == before
    with pytest.raises(ConfigError, match="shape"):
        ledger.observe([[1, 1, 1]])
    with pytest.raises(ConfigError, match=">= 0"):
        ledger.observe([[-1, 0]])
    with pytest.raises(StructureMismatchError):
        PLTLedger.create([3]).load_state_dict(before)


@st.composite
def runs(draw):
    """A run with checkpoints saving random expert subsets and faults that restore a
    checkpoint no older than the previous restore point (plt_from_history's premise)."""
    n_experts = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    total = draw(st.integers(1, 30))
    rnd = random.Random(draw(st.integers(0, 2**32)))
    n_faults = draw(st.integers(0, 4))
    faults = sorted(rnd.sample(range(total), min(n_faults, total)))
    return n_experts, total, faults, rnd


@settings(max_examples=150, deadline=None)
@given(runs())
def test_ledger_matches_reference(run):
    n_experts, total, fault_steps, rnd = run
    ledger = PLTLedger.create(n_experts)
    history: list[list[list[int]]] = []           # surviving trajectory, by step
    # Per checkpoint: (step, counts, copy_counts, copy_steps) of the view it restores.
    ckpts: list[tuple[int, list, list, list]] = []
    copy_counts = [[0] * n for n in n_experts]
    copy_steps = [[-1] * n for n in n_experts]
    floor = -1
    faults: list[tuple[int, int, list]] = []
    step = 0
    while step < total:
        if fault_steps and step == fault_steps[0]:
            fault_steps.pop(0)
            usable = [c for c in ckpts if c[0] >= floor]
            if rnd.random() < 0.5 and len(usable) > 1:
                target = rnd.choice(usable)   # an older checkpoint, e.g. the newest is bad
            else:
                target = ckpts[-1] if ckpts else (-1, [[0] * n for n in n_experts],
                                                   [[0] * n for n in n_experts],
                                                   [[-1] * n for n in n_experts])
            t, at, cc, cs = target
            ledger.record_recovery(at, cc)
            faults.append((step, t, cs))
            floor = t
            ckpts = [c for c in ckpts if c[0] <= t]
            copy_counts = [list(r) for r in cc]
            copy_steps = [list(r) for r in cs]
            del history[t + 1:]
            step = t + 1
            continue
        counts = [[rnd.randrange(5) for _ in range(n)] for n in n_experts]
        ledger.observe(counts)
        history.append(counts)
        if rnd.random() < 0.4:
            now = ledger.counts()
            for layer, n in enumerate(n_experts):
                for e in range(n):
                    if rnd.random() < 0.5:
                        copy_counts[layer][e] = now[layer][e]
                        copy_steps[layer][e] = step
            ckpts.append((step, now, [list(r) for r in copy_counts],
                          [list(r) for r in copy_steps]))
        step += 1
    assert ledger.plt() == pytest.approx(plt_from_history(history, faults), abs=1e-12)
    assert ledger.recoveries == len(faults)
    restored = PLTLedger.create(n_experts)
    restored.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored.state_dict() == ledger.state_dict()


def simulate(n, k, interval, total, fault_steps, rnd, layers=2, uniform=True):
    """A whole PEC run with sequential selection; returns the ledger's PLT."""
    shape = [n] * layers
    sel, ledger = Selector.create(shape), PLTLedger.create(shape)
    copies = [[0] * n for _ in range(layers)]    # newest copy's counts per expert
    ckpts = []                                    # (step, counts, copies, selector state)
    pending = sorted(fault_steps)
    step = 0
    while step < total:
        if pending and step == pending[0]:
            pending.pop(0)
            t, at, cc, state = ckpts[-1] if ckpts else (-1, None, None, None)
            zeros = [[0] * n for _ in range(layers)]
            ledger.record_recovery(at or zeros, cc or zeros)
            copies = [list(r) for r in (cc or zeros)]
            sel = Selector.create(shape)
            if state:
                sel.load_state_dict(state)
            step = t + 1
            continue
        if uniform:
            counts = [[3] * n for _ in range(layers)]
        else:
            counts = [[0] * n for _ in range(layers)]
            for row in counts:
                for _ in range(4 * n):
                    row[rnd.randrange(n)] += 1
        ledger.observe(counts)
        if (step + 1) % interval == 0:
            picked = sel.select(k)
            now = ledger.counts()
            for layer, experts in enumerate(picked):
                for e in experts:
                    copies[layer][e] = now[layer][e]
            sel.commit(picked, len(ckpts))
            ckpts.append((step, now, [list(r) for r in copies], sel.state_dict()))
        step += 1
    return ledger.plt()


@pytest.mark.parametrize("n,k,interval,total", [(8, 1, 5, 60), (8, 2, 4, 50), (6, 4, 3, 40)])
def test_expected_plt_exact_for_one_uniform_fault(n, k, interval, total):
    """Averaging one fault over every step reproduces the analytic value exactly."""
    rnd = random.Random(0)
    mean = sum(simulate(n, k, interval, total, [f], rnd) for f in range(total)) / total
    assert mean == pytest.approx(expected_plt_sequential(n, k, interval, total, 1), rel=1e-12)


def test_expected_plt_monte_carlo_random_routing():
    rnd = random.Random(1234)
    n, k, interval, total, faults, trials = 8, 2, 5, 100, 3, 150
    mc = sum(
        simulate(n, k, interval, total, rnd.sample(range(total), faults), rnd, uniform=False)
        for _ in range(trials)
    ) / trials
    assert mc == pytest.approx(expected_plt_sequential(n, k, interval, total, faults), rel=0.06)


def test_expected_plt_shape():
    # K = N saves everything: nothing is lost. Smaller K, longer interval: more lost.
    assert expected_plt_sequential(8, 8, 10, 1000, 5) == 0.0
    values = [expected_plt_sequential(8, k, 10, 1000, 5) for k in (1, 2, 4)]
    assert values[0] > values[1] > values[2] > 0
    assert expected_plt_sequential(8, 1, 20, 1000, 5) > values[0]
    # Steady state: n_faults * I * mean age / T with mean age (N/K - 1)/2.
    assert expected_plt_sequential(8, 2, 10, 10**6, 5) == pytest.approx(
        5 * 10 * 1.5 / 10**6, rel=1e-3)
    with pytest.raises(ConfigError):
        expected_plt_sequential(8, 9, 10, 100, 1)
