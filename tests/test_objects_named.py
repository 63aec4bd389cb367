"""Tagged JSON of Megatron-LM's common state and RNG states (moepec.state.objects): an
``argparse.Namespace``, torch dtypes, members of enum classes the caller allows, numpy's
RNG state tuple and torch's ByteTensor states, round trips exact; what is not allowed is
refused naming where it sits, and decoding builds an enum of an allowed class only."""

from __future__ import annotations

import enum
import random
import re
import signal
from argparse import Namespace

import numpy as np
import pytest
import torch

from moepec.errors import ConfigError, CorruptCheckpointError
from moepec.state.objects import DTYPES, decode_object, encode_object
from tests.test_objects import same


class Backend(enum.Enum):
    flash = 1
    auto = 5


class Scope(enum.Enum):
    attn = "attn"


ALLOWED = (Backend, Scope, signal.Signals)


def roundtrip(obj, enums=ALLOWED):
    return decode_object(encode_object(obj, "obj", enums=enums), "k", enums=enums)


def rng_state() -> dict:
    """One entry of Megatron-LM's ``rng_state`` ShardedObject (get_rng_state)."""
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.get_rng_state(),  # the CPU's stands in
            "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}


def lm_common() -> dict:
    """The common state Megatron-LM's save_checkpoint writes (generate_state_dict)."""
    args = Namespace(
        consumed_train_samples=640, skipped_train_samples=0, consumed_valid_samples=32,
        params_dtype=torch.bfloat16, main_grads_dtype=torch.float32,
        attention_backend=Backend.auto, cuda_graph_scope=[Scope.attn, "full"],
        exit_signal=signal.SIGTERM, lr=3e-4, min_lr=float("-inf"), data_path=None,
        rampup_batch_size=None, iterations_to_skip=[], moe_layer_freq=(1, 0),
        world_size=2, __odd__=1)
    return {"args": args, "checkpoint_version": 3.0, "iteration": 40,
            "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": 640, "decay_style": "cosine",
                                    "use_checkpoint_opt_param_scheduler": True},
            "num_floating_point_operations_so_far": 1.25e15,
            "rerun_state_machine": {"mode": "disabled", "state": None, "current_iteration": 40}}


def test_megatron_lms_common_state_round_trips_exactly():
    common = lm_common()
    back = roundtrip(common)
    assert type(back["args"]) is Namespace
    assert list(vars(back["args"])) == list(vars(common["args"]))
    for k, v in vars(common["args"]).items():
        got = getattr(back["args"], k)
        assert got is v if isinstance(v, enum.Enum | torch.dtype) else same(got, v), k
    assert same({k: v for k, v in back.items() if k != "args"},
                {k: v for k, v in common.items() if k != "args"})


def test_rng_states_round_trip_and_restore_the_same_numbers():
    state = [rng_state()]
    back = roundtrip(state)
    algo, keys, pos, gauss, cached = back[0]["np_rng_state"]
    assert (algo, keys.dtype, keys.shape) == ("MT19937", np.uint32, (624,))
    assert same(back, state)
    want = (random.random(), np.random.rand(), torch.rand(2))
    random.setstate(back[0]["random_rng_state"])
    np.random.set_state(back[0]["np_rng_state"])
    torch.set_rng_state(back[0]["torch_rng_state"])
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_torch_dtype_round_trips(dtype):
    assert roundtrip({"d": DTYPES[dtype]})["d"] is DTYPES[dtype]


def test_an_enum_of_a_class_not_allowed_is_refused_naming_it():
    with pytest.raises(ConfigError) as err:
        encode_object({"args": Namespace(backend=Backend.flash)}, "common", fix="allow it",
                      enums=(Scope,))
    assert re.fullmatch(
        r"common\['args'\]\['backend'\] is a (tests\.)?test_objects_named\.Backend \(enums "
        r"stored: (tests\.)?test_objects_named\.Scope\); moepec stores only JSON values and "
        r"tensors: allow it", str(err.value)), str(err.value)


@pytest.mark.parametrize(("value", "what"), [
    (Namespace(init=lambda: 0), r"\['args'\]\['init'\] is a function;"),
    (type("Args", (Namespace,), {})(a=1), r"\['args'\] is a .*Args;"),
    (Namespace(group=object()), r"\['args'\]\['group'\] is a object;"),
])
def test_an_args_value_that_is_not_data_is_refused_naming_the_key(value, what):
    with pytest.raises(ConfigError, match=what):
        encode_object({"args": value}, "common", enums=ALLOWED)


def test_decoding_builds_enums_of_the_allowed_classes_only():
    data = encode_object({"s": signal.SIGTERM, "b": Backend.auto}, "x", enums=ALLOWED)
    with pytest.raises(CorruptCheckpointError, match="not a member of an enum this reader"):
        decode_object(data, "k", enums=(Backend,))  # signal.Signals not allowed here
    with pytest.raises(CorruptCheckpointError, match="not a member of an enum"):
        decode_object(data, "k")


@pytest.mark.parametrize("value", [
    {"__enum__": ["os.system", "ls"]},
    {"__enum__": ["signal.Signals", "__class__"]},
    {"__enum__": ["signal.Signals"]},
    {"__dtype__": "Tensor"},
    {"__dtype__": ["float32"]},
    {"__namespace__": [1, 2]},
    {"__namespace__": {"__dict__": [[1, 2]]}},
])
def test_malformed_named_values_are_corrupt(value):
    import json

    doc = json.dumps({"format": "moepec-object/1", "value": value}).encode()
    with pytest.raises(CorruptCheckpointError):
        decode_object(torch.frombuffer(bytearray(doc), dtype=torch.uint8), "k",
                      enums=ALLOWED)
