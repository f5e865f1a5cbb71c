"""Tests of arrow_outputs.compare: deep, bit-exact comparison of model-runner outputs.

Every comparison is made between two separately built objects (never an object and
itself), so a shortcut on identity cannot make a test pass.
"""

from __future__ import annotations

import collections
import dataclasses
import struct
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable
from types import MappingProxyType, SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

import arrow_outputs
from arrow_outputs import (
    AuxRequestOutput,
    CUDAGraphStat,
    ECConnectorOutput,
    KVConnectorOutput,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
    SamplingMaskLists,
    assert_outputs_equal,
    first_difference,
    from_record_batch,
    outputs_equal,
    to_record_batch,
)
from arrow_outputs import compare as compare_module

# --------------------------------------------------------------------------- builders


def _output() -> ModelRunnerOutput:
    """A step with every field set; each call builds new objects with the same values."""
    return ModelRunnerOutput(
        req_ids=["a", "b"],
        req_id_to_index={"a": 0, "b": 1},
        sampled_token_ids=[[5], [6, 7]],
        logprobs=LogprobsLists(
            np.arange(12, dtype=np.int64).reshape(3, 4),
            np.linspace(-3.0, 0.0, 12, dtype=np.float32).reshape(3, 4),
            np.array([1, 2, 3], dtype=np.int64),
            [0, 1, 3],
        ),
        prompt_logprobs_dict={
            "a": LogprobsTensors(
                torch.arange(6, dtype=torch.int64).reshape(3, 2),
                torch.linspace(-2.0, 0.0, 6).reshape(3, 2),
                torch.tensor([1, 1, 2]),
            ),
            "b": None,
        },
        prompt_token_id_logprobs_dict={"a": torch.full((2, 3), -0.5)},
        pooler_output=[torch.tensor([0.5, -1.0, 2.0, 4.0], dtype=torch.bfloat16), None],
        kv_connector_output=KVConnectorOutput(
            finished_sending={"a"},
            kv_connector_stats={"bytes": [1, 2], "t": 1.5},
            invalid_block_ids={3, 4},
            expected_finished_count=0,
        ),
        ec_connector_output=None,
        num_nans_in_logits={"a": 0, "b": 2},
        cudagraph_stats=CUDAGraphStat(3, 4, 1, "FULL"),
        aux_output_connector_output={"b": AuxRequestOutput(1, np.ones((2, 3, 2), np.uint16))},
        sampling_masks=SamplingMaskLists(
            np.arange(5, dtype=np.int32), np.array([0, 2, 3, 5]), [0, 1, 3]
        ),
    )


def _changed(change: Callable[[ModelRunnerOutput], Any]) -> ModelRunnerOutput:
    out = _output()
    change(out)
    return out


def _set_logprobs(out: ModelRunnerOutput, **fields: Any) -> None:
    assert out.logprobs is not None
    out.logprobs = out.logprobs._replace(**fields)


def _kv(out: ModelRunnerOutput) -> Any:
    assert out.kv_connector_output is not None
    return out.kv_connector_output


def _prompt(out: ModelRunnerOutput) -> LogprobsTensors:
    tensors = out.prompt_logprobs_dict["a"]
    assert tensors is not None
    return tensors


def _aux(out: ModelRunnerOutput) -> AuxRequestOutput:
    assert out.aux_output_connector_output is not None
    return out.aux_output_connector_output["b"]


def _float64_bits(bits: int) -> float:
    value: float = struct.unpack("<d", struct.pack("<Q", bits))[0]
    return value


QUIET_NAN = _float64_bits(0x7FF8000000000000)
OTHER_NAN = _float64_bits(0x7FF8000000000001)  # another payload


# --------------------------------------------------------------------------- vLLM look-alikes


def _field_names(cls: type) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(cls._fields)  # type: ignore[attr-defined]


def _plain_class(name: str, fields: list[str], *, slots: bool = False) -> type:
    """A plain class (no dataclass, no NamedTuple) with ``fields`` as attributes."""

    def __init__(self: Any, **values: Any) -> None:
        for field in reversed(fields):  # attribute order is not what is compared
            setattr(self, field, values.get(field))

    namespace: dict[str, Any] = {"__init__": __init__, "__module__": "vllm.v1.outputs"}
    if slots:
        namespace["__slots__"] = tuple(fields)
    return type(name, (), namespace)


def _vllm_classes() -> SimpleNamespace:
    """Classes named like ours, with the same fields, from another module and of other
    kinds: NamedTuples, dataclasses (one with its fields in another order) and plain
    classes. The field lists come from our classes, so the look-alikes follow the data
    model."""
    module = "vllm.v1.outputs"

    def namedtuple(cls: type) -> type:
        return collections.namedtuple(cls.__name__, _field_names(cls), module=module)

    def dataclass(cls: type, *, reverse: bool = False) -> type:
        fields = _field_names(cls)
        if reverse:
            fields.reverse()
        made = dataclasses.make_dataclass(cls.__name__, fields)
        made.__module__ = module
        return made

    classes = [
        namedtuple(LogprobsLists),
        namedtuple(LogprobsTensors),
        dataclass(SamplingMaskLists),  # a dataclass where ours is a NamedTuple
        dataclass(ECConnectorOutput),
        dataclass(CUDAGraphStat),
        dataclass(ModelRunnerOutput, reverse=True),
        _plain_class("KVConnectorOutput", _field_names(KVConnectorOutput)),
        _plain_class("AuxRequestOutput", _field_names(AuxRequestOutput), slots=True),
    ]
    return SimpleNamespace(**{cls.__name__: cls for cls in classes})


VLLM = _vllm_classes()


def _to_vllm(x: Any) -> Any:
    """``x`` with every data-model object rebuilt as its look-alike (same values)."""
    theirs = getattr(VLLM, type(x).__name__, None)
    if theirs is not None:
        return theirs(**{f: _to_vllm(getattr(x, f)) for f in _field_names(type(x))})
    if type(x) is dict:
        return {k: _to_vllm(v) for k, v in x.items()}
    if type(x) is list:
        return [_to_vllm(v) for v in x]
    return x


def _vllm_output() -> Any:
    """``_output()`` built from the look-alike classes."""
    return _to_vllm(_output())


# --------------------------------------------------------------------------- equal things


EQUAL_PAIRS: dict[str, Callable[[], Any]] = {
    "full output": _output,
    "empty output": lambda: ModelRunnerOutput([], {}),
    "logprobs lists": lambda: _output().logprobs,
    "logprobs tensors": lambda: _prompt(_output()),
    "sampling masks": lambda: _output().sampling_masks,
    "kv connector output": lambda: _output().kv_connector_output,
    "ec connector output": lambda: ECConnectorOutput({"x"}, ec_connector_worker_meta={"m": (1,)}),
    "cuda graph stat": lambda: _output().cudagraph_stats,
    "aux request output": lambda: _aux(_output()),
    "nan float": lambda: {"x": float("nan")},
    "nan array": lambda: np.array([np.nan, -0.0, 1.0]),
    "nan bfloat16": lambda: torch.tensor([float("nan"), -0.0], dtype=torch.bfloat16),
    "nested plain data": lambda: {"k": [(1, 2.5), {3, 4}, frozenset({"x"}), b"raw", None]},
    "0-d array": lambda: np.array(2.5),
    "empty arrays": lambda: [np.zeros((0, 3), np.int32), torch.zeros(0, 2)],
    "object array": lambda: np.array([{"a": 1}, [2]], dtype=object),
}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "loose"])
@pytest.mark.parametrize("make", EQUAL_PAIRS.values(), ids=EQUAL_PAIRS.keys())
def test_first_difference_equal_things_are_equal(make: Callable[[], Any], strict: bool) -> None:
    a, b = make(), make()
    assert first_difference(a, b, strict=strict) is None
    assert outputs_equal(a, b, strict=strict)
    assert_outputs_equal(a, b, strict=strict)


# --------------------------------------------------------------------------- every difference


def _pooler_numpy(out: ModelRunnerOutput) -> None:
    assert out.pooler_output is not None
    out.pooler_output[0] = out.pooler_output[0].float().numpy()


def _pooler_longer(out: ModelRunnerOutput) -> None:
    assert out.pooler_output is not None
    out.pooler_output[0] = torch.zeros(8, dtype=torch.bfloat16)


def _pooler_value(out: ModelRunnerOutput) -> None:
    assert out.pooler_output is not None
    out.pooler_output[0][3] = 8.0


def _prompt_value(out: ModelRunnerOutput) -> None:
    _prompt(out).logprobs[2, 1] = 0.25


def _logprob_value(out: ModelRunnerOutput) -> None:
    assert out.logprobs is not None
    out.logprobs.logprobs[1, 2] = 9.5


def _mask_offsets(out: ModelRunnerOutput) -> None:
    assert out.sampling_masks is not None
    out.sampling_masks.offsets[2] = 4


DIFFERENCES: dict[str, tuple[Callable[[ModelRunnerOutput], Any], str]] = {
    "req id": (lambda o: o.req_ids.__setitem__(1, "c"), "req_ids[1]: 'b' vs 'c'"),
    "token value": (
        lambda o: o.sampled_token_ids[1].__setitem__(1, 8),
        "sampled_token_ids[1][1]: 7 vs 8",
    ),
    "token count": (
        lambda o: o.sampled_token_ids[1].append(9),
        "sampled_token_ids[1]: length 2 vs 3",
    ),
    "list vs tuple": (
        lambda o: o.sampled_token_ids.__setitem__(0, (5,)),
        "sampled_token_ids[0]: list vs tuple",
    ),
    "int vs numpy int": (
        lambda o: o.sampled_token_ids[0].__setitem__(0, np.int64(5)),
        "sampled_token_ids[0][0]: int vs numpy.int64",
    ),
    "array dtype": (
        lambda o: _set_logprobs(o, logprob_token_ids=o.logprobs.logprob_token_ids.astype(np.int32)),
        "logprobs.logprob_token_ids: dtype int64 vs int32",
    ),
    "array element": (_logprob_value, "logprobs.logprobs[1, 2]: -1.3636364 vs 9.5"),
    "array shape": (
        lambda o: _set_logprobs(o, sampled_token_ranks=np.array([1, 2, 3, 4])),
        "logprobs.sampled_token_ranks: shape (3,) vs (4,)",
    ),
    "list vs None": (
        lambda o: _set_logprobs(o, cu_num_generated_tokens=None),
        "logprobs.cu_num_generated_tokens: list vs None",
    ),
    "structure vs None": (
        lambda o: setattr(o, "logprobs", None),
        "logprobs: LogprobsLists vs None",
    ),
    "structure name": (
        lambda o: setattr(o, "logprobs", SamplingMaskLists(np.arange(3))),
        "logprobs: LogprobsLists vs SamplingMaskLists",
    ),
    "dict keys": (
        lambda o: o.prompt_logprobs_dict.pop("b"),
        "prompt_logprobs_dict: keys ['a', 'b'] vs ['a']",
    ),
    "dict value": (
        lambda o: o.num_nans_in_logits.__setitem__("b", 3),
        "num_nans_in_logits['b']: 2 vs 3",
    ),
    "tensor element": (_prompt_value, "prompt_logprobs_dict['a'].logprobs[2, 1]: 0.0 vs 0.25"),
    "tensor dtype": (
        lambda o: o.prompt_token_id_logprobs_dict.__setitem__("a", torch.full((2, 3), -0.5).half()),
        "prompt_token_id_logprobs_dict['a']: dtype float32 vs float16",
    ),
    "numpy vs torch": (_pooler_numpy, "pooler_output[0]: torch.Tensor vs numpy.ndarray"),
    "tensor shape": (_pooler_longer, "pooler_output[0]: shape (4,) vs (8,)"),
    "bfloat16 element": (_pooler_value, "pooler_output[0][3]: 4.0 vs 8.0"),
    "set vs frozenset": (
        lambda o: setattr(_kv(o), "finished_sending", frozenset({"a"})),
        "kv_connector_output.finished_sending: set vs frozenset",
    ),
    "set items": (
        lambda o: _kv(o).invalid_block_ids.add(9),
        "kv_connector_output.invalid_block_ids: items [9] only in second",
    ),
    "int vs bool": (
        lambda o: setattr(_kv(o), "expected_finished_count", False),
        "kv_connector_output.expected_finished_count: int vs bool",
    ),
    "float vs numpy float": (
        lambda o: _kv(o).kv_connector_stats.__setitem__("t", np.float64(1.5)),
        "kv_connector_output.kv_connector_stats['t']: float vs numpy.float64",
    ),
    "None vs structure": (
        lambda o: setattr(o, "ec_connector_output", ECConnectorOutput()),
        "ec_connector_output: None vs ECConnectorOutput",
    ),
    "frozen dataclass field": (
        lambda o: setattr(o, "cudagraph_stats", CUDAGraphStat(3, 4, 1, "PIECEWISE")),
        "cudagraph_stats.runtime_mode: 'FULL' vs 'PIECEWISE'",
    ),
    "aux rows dtype": (
        lambda o: setattr(_aux(o), "rows", _aux(o).rows.astype(np.uint8)),
        "aux_output_connector_output['b'].rows: dtype uint16 vs uint8",
    ),
    "aux token start": (
        lambda o: setattr(_aux(o), "token_start", 2),
        "aux_output_connector_output['b'].token_start: 1 vs 2",
    ),
    "mask offsets": (_mask_offsets, "sampling_masks.offsets[2]: 3 vs 4"),
}


@pytest.mark.parametrize(("change", "expected"), DIFFERENCES.values(), ids=DIFFERENCES.keys())
def test_first_difference_names_the_path(change: Callable[..., Any], expected: str) -> None:
    assert first_difference(_output(), _changed(change)) == expected


@pytest.mark.parametrize(("change", "expected"), DIFFERENCES.values(), ids=DIFFERENCES.keys())
def test_outputs_equal_false_for_each_difference(change: Callable[..., Any], expected: str) -> None:
    assert outputs_equal(_output(), _output())
    assert not outputs_equal(_output(), _changed(change))


@pytest.mark.parametrize(("change", "expected"), DIFFERENCES.values(), ids=DIFFERENCES.keys())
def test_assert_outputs_equal_raises_the_first_difference(
    change: Callable[..., Any], expected: str
) -> None:
    with pytest.raises(AssertionError) as info:
        assert_outputs_equal(_output(), _changed(change))
    assert str(info.value) == expected


def test_first_difference_reports_the_first_field_in_order() -> None:
    b = _output()
    b.req_ids[0] = "z"
    b.sampled_token_ids[0][0] = 0
    b.num_nans_in_logits = None
    assert first_difference(_output(), b) == "req_ids[0]: 'a' vs 'z'"
    b.req_ids[0] = "a"
    assert first_difference(_output(), b) == "sampled_token_ids[0][0]: 5 vs 0"


def test_first_difference_dict_keys_compare_in_any_order() -> None:
    a, b = {"x": 1, "y": 2}, {"y": 2, "x": 1}
    assert first_difference(a, b) is None
    assert first_difference({"x": 1, "y": 2}, {"y": 2, "x": 3}) == "['x']: 1 vs 3"


# --------------------------------------------------------------------------- vLLM look-alikes


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "loose"])
def test_first_difference_ours_equals_vllm_lookalike(strict: bool) -> None:
    assert first_difference(_output(), _vllm_output(), strict=strict) is None
    assert first_difference(_vllm_output(), _output(), strict=strict) is None
    assert outputs_equal(_vllm_output(), _vllm_output(), strict=strict)


LOOKALIKE_DIFFERENCES: dict[str, tuple[Callable[[Any], Any], str]] = {
    "namedtuple field": (
        lambda o: setattr(o, "logprobs", o.logprobs._replace(cu_num_generated_tokens=[0, 2, 3])),
        "logprobs.cu_num_generated_tokens[1]: 1 vs 2",
    ),
    "dataclass vs namedtuple field": (
        lambda o: o.sampling_masks.offsets.__setitem__(1, 1),
        "sampling_masks.offsets[1]: 2 vs 1",
    ),
    "plain class field": (
        lambda o: setattr(o.kv_connector_output, "finished_sending", {"b"}),
        "kv_connector_output.finished_sending: items ['a'] only in first, ['b'] only in second",
    ),
    "slots class field": (
        lambda o: o.aux_output_connector_output["b"].rows.__setitem__((1, 2, 0), 7),
        "aux_output_connector_output['b'].rows[1, 2, 0]: 1 vs 7",
    ),
    "namedtuple tensor": (
        lambda o: o.prompt_logprobs_dict["a"].selected_token_ranks.__setitem__(0, 5),
        "prompt_logprobs_dict['a'].selected_token_ranks[0]: 1 vs 5",
    ),
}


@pytest.mark.parametrize(
    ("change", "expected"), LOOKALIKE_DIFFERENCES.values(), ids=LOOKALIKE_DIFFERENCES.keys()
)
def test_first_difference_walks_vllm_lookalikes(
    change: Callable[[Any], Any], expected: str
) -> None:
    theirs = _vllm_output()
    change(theirs)
    assert first_difference(_output(), theirs) == expected


class _Renamed(NamedTuple):
    logprob_token_ids: Any
    logprobs: Any
    sampled_token_ranks: Any
    cu_num_generated_tokens: Any = None


def _old_logprobs_lists() -> type:
    class LogprobsLists(NamedTuple):  # as before cu_num_generated_tokens existed
        logprob_token_ids: Any
        logprobs: Any
        sampled_token_ranks: Any

    return LogprobsLists


class ModelRunnerOutputPlain:  # not a data-model name: compared with ==, which is identity
    def __init__(self) -> None:
        self.req_ids: list[str] = []


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "loose"])
def test_first_difference_matches_structures_by_name_and_fields(strict: bool) -> None:
    ours = _output().logprobs
    assert ours is not None
    assert first_difference(ours, _Renamed(*ours), strict=strict) == ("LogprobsLists vs _Renamed")
    assert first_difference(ours, _old_logprobs_lists()(*ours[:3]), strict=strict) == (
        "LogprobsLists fields ['cu_num_generated_tokens'] vs []"
    )
    # A plain tuple with the same items is not a LogprobsLists, in either mode.
    assert first_difference(ours, tuple(_output().logprobs), strict=strict) == (
        "LogprobsLists vs tuple"
    )
    assert first_difference(ModelRunnerOutputPlain(), ModelRunnerOutputPlain(), strict=strict)


def test_first_difference_plain_lookalike_needs_all_fields() -> None:
    class KVConnectorOutput:  # named like the data-model class, but lacks its fields
        def __init__(self) -> None:
            self.finished_sending = None

    # Not walked: compared with ==, which for a plain class is identity.
    assert first_difference(KVConnectorOutput(), KVConnectorOutput()) is not None
    message = first_difference(_output().kv_connector_output, KVConnectorOutput())
    assert message is not None
    assert message.startswith("arrow_outputs.outputs.KVConnectorOutput vs ")


# --------------------------------------------------------------------------- strict vs loose


STRICT_ONLY: dict[str, tuple[Any, Any, str]] = {
    "list vs tuple": ([1, 2], (1, 2), "list vs tuple"),
    "set vs frozenset": ({1}, frozenset({1}), "set vs frozenset"),
    "int vs numpy int": (3, np.int64(3), "int vs numpy.int64"),
    "numpy int widths": (np.int32(3), np.int64(3), "numpy.int32 vs numpy.int64"),
    "int vs float": (1, 1.0, "int vs float"),
    "float vs numpy float": (1.5, np.float64(1.5), "float vs numpy.float64"),
    "float32 vs float": (np.float32(0.5), 0.5, "numpy.float32 vs float"),
    "bool vs numpy bool": (True, np.True_, f"bool vs numpy.{type(np.True_).__name__}"),
    "signed zero": (0.0, -0.0, "0.0 vs -0.0"),
    "nan payload": (
        QUIET_NAN,
        OTHER_NAN,
        "nan (0x7ff8000000000000) vs nan (0x7ff8000000000001)",
    ),
    "numpy vs torch": (np.arange(3), torch.arange(3), "numpy.ndarray vs torch.Tensor"),
    "array dtypes": (
        np.arange(3, dtype=np.int64),
        np.arange(3, dtype=np.int32),
        "dtype int64 vs int32",
    ),
    "tensor dtypes": (
        torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
        torch.tensor([1.0, 2.0]),
        "dtype bfloat16 vs float32",
    ),
    "array signed zero": (np.array([1.0, 0.0]), np.array([1.0, -0.0]), "[1]: 0.0 vs -0.0"),
    "bfloat16 vs numpy": (
        torch.tensor([1.0, 0.5], dtype=torch.bfloat16),
        np.array([1.0, 0.5], dtype=np.float32),
        "torch.Tensor vs numpy.ndarray",
    ),
    "nested": ({"k": [np.int64(1)]}, {"k": (1,)}, "['k']: list vs tuple"),
}


@pytest.mark.parametrize(("a", "b", "expected"), STRICT_ONLY.values(), ids=STRICT_ONLY.keys())
def test_first_difference_strict_only(a: Any, b: Any, expected: str) -> None:
    assert first_difference(a, b) == expected
    assert first_difference(a, b, strict=True) == expected
    assert first_difference(a, b, strict=False) is None
    assert outputs_equal(a, b, strict=False)
    assert not outputs_equal(a, b)


NUMPY_BOOL = f"numpy.{type(np.True_).__name__}"

# (a, b, strict message, loose message): differences found in both modes.
BOTH_MODES: dict[str, tuple[Any, Any, str, str]] = {
    "int vs bool": (1, True, "int vs bool", "int vs bool"),
    "numpy bool vs int": (np.True_, 1, f"{NUMPY_BOOL} vs int", f"{NUMPY_BOOL} vs int"),
    "bool values": (True, np.False_, f"bool vs {NUMPY_BOOL}", "True vs False"),
    "number value": (1, 2.5, "int vs float", "1 vs 2.5"),
    "numpy number value": (np.float32(0.5), 0.25, "numpy.float32 vs float", "0.5 vs 0.25"),
    "nan vs number": (float("nan"), 1.0, "nan vs 1.0", "nan vs 1.0"),
    "str vs bytes": ("a", b"a", "str vs bytes", "str vs bytes"),
    "None vs 0": (None, 0, "None vs int", "None vs int"),
    "length": ([1, 2], (1, 2, 3), "list vs tuple", "length 2 vs 3"),
    "keys": ({"a": 1}, {"a": 1, "b": 2}, "keys ['a'] vs ['a', 'b']", "keys ['a'] vs ['a', 'b']"),
    "shape": (np.zeros(4), torch.zeros(8), "numpy.ndarray vs torch.Tensor", "shape (4,) vs (8,)"),
    "array value": (
        np.array([1, 2], np.int32),
        torch.tensor([1, 3]),
        "numpy.ndarray vs torch.Tensor",
        "[1]: 2 vs 3",
    ),
    "bool vs int arrays": (
        np.array([True]),
        np.array([1]),
        "dtype bool vs int64",
        "dtype bool vs int64",
    ),
    "set items": (
        {1, 2},
        frozenset({2, 3}),
        "set vs frozenset",
        "items [1] only in first, [3] only in second",
    ),
}


@pytest.mark.parametrize(
    ("a", "b", "strict_message", "loose_message"), BOTH_MODES.values(), ids=BOTH_MODES.keys()
)
def test_first_difference_in_both_modes(
    a: Any, b: Any, strict_message: str, loose_message: str
) -> None:
    assert first_difference(a, b) == strict_message
    assert first_difference(a, b, strict=False) == loose_message
    assert not outputs_equal(a, b)
    assert not outputs_equal(a, b, strict=False)


@pytest.mark.parametrize(
    "mapping",
    [MappingProxyType({"a": 1}), OrderedDict(a=1)],
    ids=["mappingproxy", "ordereddict"],
)
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "loose"])
def test_outputs_equal_any_mapping_class(mapping: Any, strict: bool) -> None:
    assert outputs_equal({"a": 1}, mapping, strict=strict)
    assert not outputs_equal({"a": 2}, mapping, strict=strict)


def test_outputs_equal_loose_output_with_other_kinds() -> None:
    a = _output()
    b = _output()
    assert b.logprobs is not None
    b.logprobs = b.logprobs._replace(
        logprob_token_ids=torch.from_numpy(b.logprobs.logprob_token_ids.astype(np.int32)),
        cu_num_generated_tokens=(0, 1, 3),
    )
    b.sampled_token_ids = [(np.int32(5),), [6.0, np.uint8(7)]]
    assert not outputs_equal(a, b)
    assert outputs_equal(a, b, strict=False)
    b.sampled_token_ids[1][1] = np.uint8(8)
    assert first_difference(a, b, strict=False) == "sampled_token_ids[1][1]: 7 vs 8"


# --------------------------------------------------------------------------- bit-exact floats


NAN_CASES: dict[str, tuple[Any, Any, Any]] = {
    "python float": (QUIET_NAN, QUIET_NAN * 1, OTHER_NAN),
    "numpy float64": (np.float64(QUIET_NAN), np.float64(QUIET_NAN), np.float64(OTHER_NAN)),
    "numpy array": (
        np.array([1.0, QUIET_NAN]),
        np.array([1.0, QUIET_NAN]),
        np.array([1.0, OTHER_NAN]),
    ),
    "float32 tensor": (
        torch.tensor([QUIET_NAN], dtype=torch.float32),
        torch.tensor([QUIET_NAN], dtype=torch.float32),
        torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32),
    ),
    "bfloat16 tensor": (
        torch.tensor([QUIET_NAN], dtype=torch.bfloat16),
        torch.tensor([QUIET_NAN], dtype=torch.bfloat16),
        torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16),
    ),
}


@pytest.mark.parametrize(("nan", "same", "other"), NAN_CASES.values(), ids=NAN_CASES.keys())
def test_first_difference_nan_is_bit_exact(nan: Any, same: Any, other: Any) -> None:
    assert first_difference(nan, same) is None
    message = first_difference(nan, other)
    assert message is not None
    assert "nan" in message
    assert "0x" in message
    assert first_difference(nan, other, strict=False) is None


ZERO_CASES: dict[str, tuple[Any, Any]] = {
    "python float": (0.0, -0.0),
    "numpy float32": (np.float32(0.0), np.float32(-0.0)),
    "numpy array": (np.zeros(2), np.array([0.0, -0.0])),
    "tensor": (torch.zeros(2), torch.tensor([0.0, -0.0])),
    "bfloat16 tensor": (
        torch.zeros(2, dtype=torch.bfloat16),
        torch.tensor([0.0, -0.0], dtype=torch.bfloat16),
    ),
}


@pytest.mark.parametrize(("zero", "negative"), ZERO_CASES.values(), ids=ZERO_CASES.keys())
def test_first_difference_signed_zero_strict_only(zero: Any, negative: Any) -> None:
    message = first_difference(zero, negative)
    assert message is not None
    assert message.endswith("0.0 vs -0.0")
    assert first_difference(zero, negative, strict=False) is None


def test_first_difference_float32_array_shows_numpy_precision() -> None:
    a = np.array([0.1, 0.2], dtype=np.float32)
    b = a.copy()
    b[1] = np.float32(0.3)
    assert first_difference(a, b) == "[1]: 0.2 vs 0.3"


# --------------------------------------------------------------------------- torch


def test_first_difference_bfloat16_tensors() -> None:
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    assert first_difference(a, a.clone()) is None
    b = a.clone()
    b[1, 0] = 3.5
    assert first_difference(a, b) == "[1, 0]: 3.0 vs 3.5"
    assert first_difference(a, a.float()) == "dtype bfloat16 vs float32"
    assert first_difference(a, a.float(), strict=False) is None
    assert first_difference(a, a.float().numpy(), strict=False) is None
    c = a.float()
    c[0, 1] = 2.001  # not a bfloat16 value: differs by value too
    assert first_difference(a, c, strict=False) == "[0, 1]: 2.0 vs 2.000999927520752"


def test_first_difference_tensor_layout_and_grad_do_not_matter() -> None:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert first_difference(a.t(), a.t().contiguous()) is None
    assert first_difference(a.clone().requires_grad_(), a) is None
    b = a.t().contiguous()
    b[2, 1] = -1.0
    assert first_difference(a.t(), b) == "[2, 1]: 5.0 vs -1.0"


def test_first_difference_torch_dtype_kinds_loose() -> None:
    ints = torch.tensor([1, 2], dtype=torch.int32)
    assert first_difference(ints, np.array([1.0, 2.0]), strict=False) is None
    assert first_difference(torch.tensor([True]), np.array([1]), strict=False) == (
        "dtype bool vs int64"
    )


def test_import_compare_does_not_import_torch() -> None:
    code = "import sys, arrow_outputs.compare; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- round trip


def _special_floats() -> ModelRunnerOutput:
    """Logprobs with NaNs of two payloads, -0.0 and -inf: only bits tell them apart."""
    out = _output()
    assert out.logprobs is not None
    values = out.logprobs.logprobs
    values.view(np.uint32)[0, :2] = [0x7FC00000, 0x7FC00001]
    values[1, :2] = [-0.0, -np.inf]
    return out


ROUND_TRIPS: dict[str, Callable[[], ModelRunnerOutput]] = {
    "full output": _output,
    "empty output": lambda: ModelRunnerOutput([], {}),
    "special floats": _special_floats,
    "with ec connector output": lambda: _changed(
        lambda o: setattr(o, "ec_connector_output", ECConnectorOutput(finished_recving={"b"}))
    ),
}


@pytest.mark.parametrize("make", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_assert_outputs_equal_after_record_batch_round_trip(
    make: Callable[[], ModelRunnerOutput],
) -> None:
    out = make()
    back = from_record_batch(to_record_batch(out, step=0))
    assert_outputs_equal(back, out)
    assert_outputs_equal(out, back, strict=False)
    assert first_difference(out, back) is None


def test_first_difference_finds_one_bit_after_round_trip() -> None:
    out = _special_floats()
    back = from_record_batch(to_record_batch(out, step=0))
    assert back.logprobs is not None
    changed = back.logprobs.logprobs.copy()  # decoded arrays are read-only views
    changed.view(np.uint32)[0, 1] ^= 1  # one NaN payload becomes the other
    back.logprobs = back.logprobs._replace(logprobs=changed)
    assert first_difference(out, back) == (
        "logprobs.logprobs[0, 1]: nan (0x7fc00001) vs nan (0x7fc00000)"
    )
    assert first_difference(out, back, strict=False) is None


# --------------------------------------------------------------------------- other objects


class _Payload:
    """A connector payload with its own ``__eq__`` (like a decoded record)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Payload) and self.value == other.value

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"_Payload({self.value!r})"


class _Ambiguous:
    """``==`` gives no single truth value, like an array."""

    def __eq__(self, other: object) -> Any:
        return np.array([True, False])

    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "loose"])
def test_first_difference_other_objects_use_eq(strict: bool) -> None:
    a = KVConnectorOutput(kv_connector_stats=_Payload({"x": 1}))
    assert first_difference(a, KVConnectorOutput(kv_connector_stats=_Payload({"x": 1}))) is None
    assert first_difference(
        a, KVConnectorOutput(kv_connector_stats=_Payload({"x": 2})), strict=strict
    ) == ("kv_connector_stats: _Payload({'x': 1}) vs _Payload({'x': 2})")
    message = first_difference([_Ambiguous()], [_Ambiguous()], strict=strict)
    assert message == "[0]: == on _Ambiguous failed (ValueError)"
    assert first_difference(_Payload(1), None, strict=strict) == "_Payload vs None"


@dataclasses.dataclass
class _Stats:
    counts: Any


def test_first_difference_walks_payload_dataclasses() -> None:
    # A dataclass payload holding arrays: its own == would fail, it is walked instead.
    a = KVConnectorOutput(kv_connector_stats=_Stats(np.array([1, 2])))
    b = KVConnectorOutput(kv_connector_stats=_Stats(np.array([1, 2])))
    assert first_difference(a, b) is None
    b.kv_connector_stats.counts[1] = 3
    assert first_difference(a, b) == "kv_connector_stats.counts[1]: 2 vs 3"


# --------------------------------------------------------------------------- limits


def test_first_difference_cycles_are_reported_not_followed() -> None:
    a: list[Any] = []
    a.append(a)
    b: list[Any] = []
    b.append(b)
    message = first_difference(a, b)
    assert message is not None
    assert "nested deeper than 100 levels" in message
    assert len(message) < 250


def test_first_difference_deep_nesting_does_not_crash() -> None:
    a: Any = 0
    b: Any = 0
    for _ in range(5000):
        a, b = [a], [b]
    message = first_difference({"k": a}, {"k": b})
    assert message is not None
    assert "nested deeper than" in message
    assert message.startswith("['k'][0][0]")


def test_first_difference_shortens_long_values() -> None:
    message = first_difference({"k": "x" * 500}, {"k": "y" * 500})
    assert message is not None
    assert len(message) < 140
    assert message.startswith("['k']: 'xxx")
    assert "..." in message
    keys = first_difference({str(i): i for i in range(100)}, {"a": 1})
    assert keys is not None
    assert len(keys) < 140


class _Multiline:
    def __init__(self, value: int) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"_Multiline(\n    value={self.value},\n)"


def test_first_difference_is_one_line() -> None:
    message = first_difference({"k": _Multiline(1)}, {"k": _Multiline(1)})
    assert message == "['k']: _Multiline( value=1, ) vs _Multiline( value=1, ) (" + (
        f"{__name__}._Multiline vs {__name__}._Multiline)"
    )


# --------------------------------------------------------------------------- package


def test_outputs_equal_exported_from_package_root() -> None:
    for name in ("assert_outputs_equal", "first_difference", "outputs_equal"):
        assert name in arrow_outputs.__all__
        assert getattr(arrow_outputs, name) is getattr(compare_module, name)
    assert sorted(compare_module.__all__) == compare_module.__all__
