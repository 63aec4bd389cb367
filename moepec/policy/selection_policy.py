"""Which selection policies exist, and a policy of your own: the built-in names
(:class:`Selection`), the interface moepec calls (:class:`SelectionPolicy`), the registry
(:func:`register_selection`) and the checks on a user policy's answers. The policies'
behaviour (the built-in picks, the stateful :class:`~moepec.policy.selection.Selector`)
is :mod:`moepec.policy.selection`'s.

A user policy decides, per MoE layer and checkpoint, which K experts a tier (storage or
RAM) saves, like the built-in ``sequential`` and ``load_aware``. It is registered under a
name (:func:`register_selection`, exported as ``moepec.register_selection``) and
configured by that name (``CheckpointConfig(selection="name")``, Megatron's
``register(selection=...)``, DeepSpeed's ``{"moepec": {"selection": ...}}``), so the
manifest records a string and never code.

The contract, because every rank plans the same checkpoint without a collective:

- :meth:`SelectionPolicy.select` is a pure function of its :class:`SelectionContext`:
  deterministic, no randomness that is not seeded from the context, no I/O, no
  collectives, no change to the policy object. Every rank calls it with identical
  inputs and must get the identical answer. It is called on the training thread.
- Whatever the policy remembers between checkpoints lives in its *state*: one JSON value
  per MoE layer and tier, created by :meth:`~SelectionPolicy.initial_state`, replaced by
  :meth:`~SelectionPolicy.on_saved` after each checkpoint, saved in every manifest and
  handed back on restore. Attributes of the policy object do not travel; one object
  serves every selector of the process.
- No staleness bound comes built in: ``sequential`` saves every expert at least every
  ceil(N/K) checkpoints, a user policy only what it promises itself. ``full_every=M``
  in the config is the safety net (every M-th checkpoint saves every expert).

Why the manifest holds only a name, and what a restore does without the policy: the
config is the one place that says which policy runs, and it refuses a name this process
has not registered (ConfigError naming the fix: register it first), so a run never
starts, or resumes, with a policy it cannot call. A checkpoint taken under policy A and
restored with the config naming B is a policy switch, allowed as between the built-in
ones: the common bookkeeping (each expert's last save, tokens since) carries over, A's
own state is dropped (``ExpertSchedule.resume`` warns when A is not registered here).
We do not raise there: a switch is the only way off a policy whose code is gone, and
the fallback keeps every guarantee the configured policy gives from there on.
"""

from __future__ import annotations

import json
import operator
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from moepec.errors import ConfigError


class Selection(StrEnum):
    """Which experts a checkpoint saves (DESIGN.md, terms)."""

    SEQUENTIAL = "sequential"
    """Staggered round-robin: every expert saved at least every ceil(N/K) checkpoints."""
    LOAD_AWARE = "load_aware"
    """The experts that received the most tokens since their last save."""


BUILTIN_NAMES = frozenset(m.value for m in Selection)
"""The names a user policy cannot take."""


@dataclass(frozen=True, slots=True)
class SelectionContext:
    """What a policy knows when it picks the experts of one MoE layer for one checkpoint.

    All counts are per tier: the storage tier's selector and the RAM tier's keep their
    own (an expert copied to RAM but not written to storage is "saved" only for RAM).
    """

    layer: int
    """The MoE layer's index among the model's MoE layers (depth order)."""
    n_experts: int
    """Experts of this layer: ids 0..n_experts-1 (global expert indices)."""
    k: int
    """How many experts to return, exactly (already capped at the experts not excluded)."""
    checkpoint: int
    """Index of the checkpoint being planned (the run's first is 0; a restored run goes on
    counting from its checkpoint's index)."""
    tokens_since_save: tuple[int, ...]
    """Token assignments routed to each expert since its last save, summed over ranks
    (0 when nothing reports routing counts)."""
    last_saved: tuple[int, ...]
    """Checkpoint index of each expert's last save by this tier; -1 = never saved."""
    exclude: frozenset[int]
    """Experts that must not be returned (the RAM tier: those storage already takes)."""
    state: Any = None
    """This layer's policy state (a JSON value, read only; None unless the policy keeps one)."""

    @property
    def checkpoints_since_save(self) -> tuple[int, ...]:
        """Checkpoints since each expert's last save (``checkpoint + 1`` when never saved).
        With a fixed ``interval`` that is the training steps since, divided by it."""
        return tuple(self.checkpoint - s for s in self.last_saved)

    @property
    def candidates(self) -> tuple[int, ...]:
        """The experts a policy may return, ascending (all but ``exclude``)."""
        return tuple(e for e in range(self.n_experts) if e not in self.exclude)


class SelectionPolicy(ABC):
    """Base class of a user-supplied expert selection policy.

    Subclass it and implement :meth:`select`; override :meth:`initial_state` and
    :meth:`on_saved` when the policy remembers something between checkpoints (a plain
    function ``ctx -> experts`` registered with :func:`moepec.register_selection` is a
    stateless policy). The module docstring states the contract: deterministic on every
    rank, state in JSON only, no staleness bound unless the policy keeps one.
    """

    @abstractmethod
    def select(self, ctx: SelectionContext) -> Iterable[int]:
        """The ``ctx.k`` experts of layer ``ctx.layer`` to save at ``ctx.checkpoint``:
        distinct ids in 0..n_experts-1, none in ``ctx.exclude`` (``ctx.candidates``), in
        any order. Called on the training thread of every rank with identical ``ctx``;
        must not change anything. A wrong answer raises ConfigError naming the policy."""

    def initial_state(self, layer: int, n_experts: int) -> Any:
        """The state of MoE layer ``layer`` (of ``n_experts``) before any checkpoint, and
        after a restore from a checkpoint taken under another policy. A JSON value."""
        return None

    def on_saved(self, state: Any, *, layer: int, n_experts: int, experts: tuple[int, ...],
                 checkpoint: int) -> Any:
        """The next state of MoE layer ``layer`` (of ``n_experts``), once checkpoint
        ``checkpoint`` saved ``experts`` of it: sorted ids, every expert for a full
        checkpoint, for the RAM tier the whole snapshot set. Called on every rank when
        the checkpoint starts (the storage tier's only when it persists), with a copy of
        the state: return the new value (JSON) rather than changing it in place."""
        return state


class FunctionPolicy(SelectionPolicy):
    """A stateless policy from a plain function ``ctx -> experts``."""

    def __init__(self, fn: Callable[[SelectionContext], Iterable[int]]) -> None:
        self.fn = fn

    def select(self, ctx: SelectionContext) -> Iterable[int]:
        return self.fn(ctx)

    def __repr__(self) -> str:
        return f"FunctionPolicy({getattr(self.fn, '__qualname__', self.fn)!r})"


def as_policy(policy: object, name: str) -> SelectionPolicy:
    """``policy`` as a SelectionPolicy (a function is wrapped). Raises ConfigError."""
    if isinstance(policy, SelectionPolicy):
        return policy
    if isinstance(policy, type) and issubclass(policy, SelectionPolicy):
        raise ConfigError(f"selection policy {name!r}: register an instance of "
                          f"{policy.__name__}, not the class ({policy.__name__}())")
    if callable(policy):
        return FunctionPolicy(policy)
    raise ConfigError(f"selection policy {name!r} must be a moepec.SelectionPolicy or a "
                      f"function ctx -> expert ids, got {type(policy).__name__}")


def checked_answer(name: str, ctx: SelectionContext, answer: Any) -> tuple[int, ...]:
    """The experts ``answer`` names, sorted, once checked against ``ctx``: exactly
    ``ctx.k`` distinct ints in 0..n-1, none excluded. Raises ConfigError naming the
    policy, the layer, the checkpoint and every problem found."""
    where = (f"selection policy {name!r} answered {{}} for MoE layer {ctx.layer} at "
             f"checkpoint {ctx.checkpoint} (k={ctx.k} of {ctx.n_experts} experts, excluded "
             f"{sorted(ctx.exclude)})")
    fix = "; a policy returns exactly k distinct expert ids from ctx.candidates"
    try:
        ids = [_expert_id(e) for e in answer]
    except TypeError:
        raise ConfigError(where.format(repr(answer)) + ": not an iterable of int expert ids"
                          + fix) from None
    problems = []
    if len(ids) != ctx.k:
        problems.append(f"{len(ids)} experts instead of {ctx.k}")
    if dup := sorted({e for e in ids if ids.count(e) > 1}):
        problems.append(f"duplicates {dup}")
    if out := sorted({e for e in ids if not 0 <= e < ctx.n_experts}):
        problems.append(f"out of range 0..{ctx.n_experts - 1}: {out}")
    if excluded := sorted(set(ids) & ctx.exclude):
        problems.append(f"excluded experts {excluded}")
    if problems:
        raise ConfigError(where.format(ids) + ": " + ", ".join(problems) + fix)
    return tuple(sorted(ids))


def _expert_id(e: Any) -> int:
    if isinstance(e, bool):  # True is an int to Python, never an expert id here
        raise TypeError("bool")
    return operator.index(e)  # ints, and numpy / torch integer scalars


def json_state(name: str, state: Any, what: str) -> Any:
    """``state`` after a JSON round trip: what a restored run would read back (tuples
    become lists, dict keys strings), so the run and its restart see the same value.
    Raises ConfigError when it is not JSON."""
    if type(state) is list and not any(s is not None for s in state):
        return [None] * len(state)  # the built-in policies' (each manifest holds 2 selectors)
    try:
        return json.loads(json.dumps(state, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"selection policy {str(name)!r}: {what} is not JSON ({exc}); keep "
                          f"only dicts, lists, str, int, finite float, bool and None there "
                          f"(it travels in the checkpoint's manifest)") from None


_POLICIES: dict[str, SelectionPolicy] = {}
"""User policies by name (this process's; every rank registers its own)."""
_POLICIES_LOCK = threading.Lock()
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")


def register_selection(name: str, policy: SelectionPolicy | Callable[[SelectionContext],
                                                                       Iterable[int]],
                       *, replace: bool = False) -> None:
    """Make ``policy`` the selection policy ``name`` of this process, for
    ``CheckpointConfig(selection=name)`` and the doors' ``selection`` field.

    ``policy``: a :class:`SelectionPolicy` instance, or a function ``ctx -> expert ids``
    (a stateless policy). Call it on every rank, before the config naming it is created
    and before a checkpoint taken with it is restored (at import of your module is
    simplest): the manifest records only the name. Registering the same object again is
    a no-op; another object under a taken name needs ``replace=True``. Raises
    ConfigError for a built-in name, a name that is not letters, digits and ``_.:-``,
    or a policy of the wrong kind.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"a selection policy name is letters, digits and _.:- (starting "
                          f"with a letter or digit), got {name!r}")
    if name in BUILTIN_NAMES:
        raise ConfigError(f"{name!r} is a built-in selection policy; register yours under "
                          f"another name")
    impl = as_policy(policy, name)
    with _POLICIES_LOCK:
        old = _POLICIES.get(name)
        same = old is impl or (isinstance(old, FunctionPolicy) and old.fn is policy)
        if old is not None and not replace and not same:
            raise ConfigError(f"selection policy {name!r} is already registered ({old!r}); "
                              f"pass replace=True to replace it")
        _POLICIES[name] = impl


def unregister_selection(name: str) -> None:
    """Forget the user policy ``name`` (configs naming it are refused from now on).
    Raises ConfigError when no user policy has that name."""
    with _POLICIES_LOCK:
        if _POLICIES.pop(name, None) is None:
            raise ConfigError(f"no user selection policy {name!r} is registered "
                              f"(registered: {', '.join(sorted(_POLICIES)) or 'none'})")


def selection_names() -> tuple[str, ...]:
    """Every selection policy this process knows: the built-in ones, then the registered."""
    with _POLICIES_LOCK:
        return tuple(m.value for m in Selection) + tuple(sorted(_POLICIES))


def resolve_selection(value: object, what: str = "selection") -> Selection | str:
    """``value`` as a built-in :class:`Selection` or the name of a registered policy.
    Raises ConfigError listing the names this process knows and how to add one."""
    if isinstance(value, str) and value in BUILTIN_NAMES:
        return Selection(value)
    with _POLICIES_LOCK:
        if isinstance(value, str) and value in _POLICIES:
            return value
    raise ConfigError(f"unknown {what} {value!r}; choose one of "
                      f"{', '.join(selection_names())}, or register a policy of your own "
                      f"first: moepec.register_selection({value!r}, policy) on every rank "
                      f"before creating the config or restoring a checkpoint taken with it")


def user_policy(name: str) -> SelectionPolicy | None:
    """The registered policy ``name``; None for a built-in. Raises ConfigError when
    ``name`` is neither (it was unregistered since the config was made)."""
    if name in BUILTIN_NAMES:
        return None
    with _POLICIES_LOCK:
        policy = _POLICIES.get(name)
    if policy is None:
        resolve_selection(name, "selection policy")  # raises, naming the fix
    return policy
