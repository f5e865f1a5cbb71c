"""The compiled walks (``_speedups``) against their specification (``_pyspeedups``).

Every test that takes ``impl`` runs on both implementations (the C one is skipped where it was
not built); the ``agree`` tests call both on the same input and require the same answer, or
the same exception type. pyarrow and numpy are the references for the valid answers.
"""

from __future__ import annotations

import collections
import gc
import itertools
import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from conftest import BUILT_IMPLS as BOTH
from conftest import SPEEDUP_IMPLS as IMPLS
from conftest import codec_on
from conftest import impls_agree as agree
from conftest import speedups_c as _speedups
from hypothesis import given, settings
from hypothesis import strategies as st

from arrow_outputs import ModelRunnerOutput, _accel, _pyspeedups, from_record_batch, to_record_batch
from arrow_outputs.errors import UnsupportedValueError

FUNCS = (
    "flatten_int_lists",
    "utf8_array",
    "index_in_order",
    "str_list",
    "split_int_lists",
    "mask_rows",
    "mask_supports",
    "int_offsets",
    "same_items",
    "copy_from_address",
    "sampled_rows",
    "int32_head",
    "message_custom_metadata",
    "offsets_ok",
)
# The whole-batch assembly: node helpers and the batch (pure Python), build_array (C); their
# tests are in test_speed_assembly.py.
ASSEMBLY = ("array_of", "node_of", "record_batch")
I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Any:
    return request.param


def i32(b: bytes) -> list[int]:
    return np.frombuffer(b, "<i4").tolist()


def ref_flatten(lists: list[list[int]], itemsize: int) -> tuple[bytes, bytes]:
    flat = list(itertools.chain.from_iterable(lists))
    values = np.array(flat, dtype=f"<i{itemsize}").tobytes()
    offsets = np.zeros(len(lists) + 1, "<i4")
    np.cumsum([len(x) for x in lists], out=offsets[1:])
    return values, offsets.tobytes()


def ref_utf8(strs: list[str]) -> tuple[bytes, bytes]:
    arr = pa.array(strs, pa.string())
    _, offs, data = arr.buffers()
    offsets = np.frombuffer(offs, "<i4", count=len(strs) + 1)
    return offsets.tobytes(), data.to_pybytes()[: offsets[-1]]


class IntSub(int):
    pass


class ListSub(list):
    pass


class StrSub(str):
    pass


# ----------------------------------------------------------------------------- the module


def test_speedups_built_when_required():
    if os.environ.get("ARROW_OUTPUTS_REQUIRE_SPEEDUPS") != "1":
        pytest.skip("ARROW_OUTPUTS_REQUIRE_SPEEDUPS=1 not set (CI sets it)")
    import arrow_outputs._speedups  # noqa: F401  (an ImportError here is the failure)

    assert _accel.AVAILABLE
    # The C++ reader of a batch's buffers for the decode walk, against this very pyarrow.
    import arrow_outputs._arrowbridge as view

    assert _accel.BRIDGE_UNAVAILABLE == ""
    assert pa.cpp_build_info.version == view.ARROW_VERSION


def test_speedups_same_functions_as_specification():
    for m in BOTH:
        for name in FUNCS:
            assert callable(getattr(m, name)), (m.__name__, name)
    assert set(_pyspeedups.__all__) == set(FUNCS) | set(ASSEMBLY)
    if _speedups is not None:
        assert callable(_speedups.build_array)


@pytest.mark.parametrize("name", FUNCS)
def test_speedups_wrong_argument_count_is_type_error(impl, name):
    with pytest.raises(TypeError):
        getattr(impl, name)()


# ----------------------------------------------------------------------------- flatten


FLATTEN_VALID = [
    [[1, 2], [], [3]],
    [],
    [[]],
    [[], []],
    [[0]] * 5,
    [[2**31 - 1, -(2**31)], [7]],
    [[-1, 0, 1]],
    [list(range(100)), list(range(3))],
]


@pytest.mark.parametrize("itemsize", [4, 8])
@pytest.mark.parametrize("lists", FLATTEN_VALID)
def test_flatten_int_lists_valid(impl, lists, itemsize):
    got = impl.flatten_int_lists(lists, len(lists), itemsize)
    assert type(got) is tuple
    assert all(type(b) is bytes for b in got)
    assert got == ref_flatten(lists, itemsize)


def test_flatten_int_lists_int64_extremes(impl):
    lists = [[2**63 - 1], [-(2**63), 0]]
    values, offsets = impl.flatten_int_lists(lists, 2, 8)
    assert np.frombuffer(values, "<i8").tolist() == [2**63 - 1, -(2**63), 0]
    assert i32(offsets) == [0, 1, 3]


# Ints of one internal digit (|v| < 2**30) are read inline in C, the rest by the C API: both
# sides of that line, signed, and zero.
DIGIT_EDGES = [0, 1, -1, 2**30 - 1, -(2**30 - 1), 2**30, -(2**30), 2**31 - 1, -(2**31)]


@pytest.mark.parametrize("itemsize", [4, 8])
def test_flatten_int_lists_one_digit_edges(impl, itemsize):
    lists = [[v] for v in DIGIT_EDGES] + [DIGIT_EDGES]
    values, offsets = impl.flatten_int_lists(lists, len(lists), itemsize)
    assert np.frombuffer(values, f"<i{itemsize}").tolist() == DIGIT_EDGES * 2
    assert (values, offsets) == ref_flatten(lists, itemsize)
    assert impl.flatten_int_lists([[2**31]], 1, 4) is None  # two digits, still range-checked


def test_flatten_int_lists_decode_step_1024(impl):
    lists = [[i * 31 % 128_256] for i in range(1024)]
    assert impl.flatten_int_lists(lists, 1024, 8) == ref_flatten(lists, 8)
    assert impl.flatten_int_lists(lists, 1024, 4) == ref_flatten(lists, 4)


@pytest.mark.parametrize(
    ("lists", "n", "itemsize"),
    [
        ([[True]], 1, 8),
        ([[1, False]], 1, 4),
        ([[1.0]], 1, 8),
        ([[IntSub(1)]], 1, 8),
        ([[np.int64(1)]], 1, 8),
        ([[None]], 1, 8),
        ([["1"]], 1, 8),
        ([[[1]]], 1, 8),
        (ListSub([[1]]), 1, 8),
        ([ListSub([1])], 1, 8),
        ([(1,)], 1, 8),
        (([1],), 1, 8),
        ([[1], (2,)], 2, 8),
        ([[1], None], 2, 8),
        (None, 0, 8),
        ({0: [1]}, 1, 8),
        ([[2**31]], 1, 4),
        ([[-(2**31) - 1]], 1, 4),
        ([[0], [2**31]], 2, 4),
        ([[2**63]], 1, 8),
        ([[-(2**63) - 1]], 1, 8),
        ([[2**100]], 1, 8),
        ([[-(2**100)]], 1, 4),
        ([[1]], 2, 8),
        ([[1]], 0, 8),
        ([[1]], -1, 8),
        ([], 1, 8),
        ([], -1, 8),
        ([[1]], 1, 2),
        ([[1]], 1, 16),
        ([[1]], 1, 0),
        ([[1]], 1, -8),
        ([], 0, 1),
    ],
)
def test_flatten_int_lists_refuses(impl, lists, n, itemsize):
    assert impl.flatten_int_lists(lists, n, itemsize) is None


def test_flatten_int_lists_more_than_int32_offsets_refused(impl):
    inner = [0] * 2**16
    lists = [inner] * (2**15 + 1)  # 2**31 + 2**16 ids, by reference: no memory needed
    assert impl.flatten_int_lists(lists, len(lists), 8) is None


@pytest.mark.parametrize(
    ("n", "itemsize", "exc"),
    [("1", 8, TypeError), (1.0, 8, TypeError), (None, 8, TypeError), (1, "8", TypeError)],
)
def test_flatten_int_lists_bad_integer_arguments_raise(impl, n, itemsize, exc):
    with pytest.raises(exc):
        impl.flatten_int_lists([[1]], n, itemsize)


@pytest.mark.parametrize("n", [2**63, -(2**63) - 1, 2**100])
def test_flatten_int_lists_huge_n_overflows_alike(n):
    with pytest.raises(OverflowError):
        agree("flatten_int_lists", [[1]], n, 8)


def test_flatten_int_lists_index_objects_accepted(impl):
    assert impl.flatten_int_lists([[1]], np.int64(1), np.int32(8)) == ref_flatten([[1]], 8)
    assert impl.flatten_int_lists([[1]], True, 8) == ref_flatten([[1]], 8)


# ----------------------------------------------------------------------------- utf8


UTF8_VALID = [
    [],
    [""],
    ["", ""],
    ["a", "é", "日本語", "🙂", "\x00", "a\x00b"],
    ["\uffff", "\U0010ffff", "\u0080"],
    [f"chatcmpl-0123456789abcdef-{i}" for i in range(1024)],
]


@pytest.mark.parametrize("strs", UTF8_VALID)
def test_utf8_array_valid(impl, strs):
    got = impl.utf8_array(strs)
    assert type(got) is tuple
    assert all(type(b) is bytes for b in got)
    assert got == ref_utf8(strs)


@pytest.mark.parametrize(
    "strs",
    [
        ["\ud800"],
        ["ok", "a\udfffb"],
        ["\udc80abc"],
        [StrSub("a")],
        [b"a"],
        [None],
        ["a", 1],
        ["a", ["b"]],
        ListSub(["a"]),
        ("a",),
        "abc",
        None,
        {"a": 0},
    ],
)
def test_utf8_array_refuses(impl, strs):
    assert impl.utf8_array(strs) is None


@pytest.mark.parametrize(
    "strs",
    [
        ["a", "b" * 500, "c" * 5000],  # the C buffer, sized from the first id, grows twice
        ["x" * 300, "y"],  # a first id too long to size from
        ["", "z" * 100],  # an empty first id
        ["é" * 10, "日本" * 40],  # the first id's UTF-8 form is longer than its characters
        [f"cmpl-{i:032x}-0" for i in range(1024)] + ["q" * 70],  # one longer id at the end
    ],
)
def test_utf8_array_ids_of_other_lengths(impl, strs):
    assert impl.utf8_array(strs) == ref_utf8(strs)


def test_utf8_array_more_than_int32_offsets_refused(impl):
    s = "x" * 2**20
    assert impl.utf8_array([s] * 2**11) is None  # 2**31 bytes, one str by reference


@pytest.mark.skipif(_speedups is None, reason="arrow_outputs._speedups not built")
def test_utf8_array_c_refuses_too_much_data_before_allocating_it():
    # 2**11 references to one 1 MiB id: 2 GiB of UTF-8 that no int32 offset reaches. The C
    # walk measures what does not fit its first guess before sizing a buffer for it.
    import tracemalloc

    strs = ["x" * 2**20] * 2**11
    tracemalloc.start()
    try:
        assert _speedups.utf8_array(strs) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20


@pytest.mark.skipif(_speedups is None, reason="arrow_outputs._speedups not built")
def test_utf8_array_c_counts_bytes_not_characters():
    # 2**30 + 2**20 characters but 2**31 + 2**21 bytes: only the byte count is over.
    # C only: the pure-Python twin would encode 2 GiB to find out (same rule, by construction).
    s = "é" * 2**20
    assert _speedups.utf8_array([s] * (2**10 + 1)) is None


def test_utf8_array_surrogate_after_valid_items_leaves_no_exception(impl):
    assert impl.utf8_array(["a" * 100, "é", "\ud800"]) is None
    assert impl.utf8_array(["b"]) == ref_utf8(["b"])


# ----------------------------------------------------------------------------- index


def expr(req_ids: Any, index: Any) -> bool:
    """The codec's Python check (exact list and dict only: see _pyspeedups.index_in_order)."""
    return bool(list(index) == req_ids and list(index.values()) == list(range(len(req_ids))))


NAN = float("nan")


class EqAll:
    """Equal to everything, and counts its calls."""

    calls = 0

    def __eq__(self, other: object) -> bool:
        EqAll.calls += 1
        return True

    __hash__ = object.__hash__


class EqNone:
    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = object.__hash__


class Truthy:
    """__eq__ returns a non-bool whose truth is computed."""

    def __init__(self, v: object) -> None:
        self.v = v

    def __eq__(self, other: object) -> Any:
        return np.array([self.v == other])

    __hash__ = object.__hash__


class StrEqAll(str):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = str.__hash__


_nan_obj = float("nan")
_eq_all = EqAll()
ODD_CASES: list[tuple[list[Any], dict[Any, Any]]] = [
    ([], {}),
    (["a"], {"a": 0}),
    (["a", "b"], {"a": 0, "b": 1}),
    (["a", "b"], {"b": 1, "a": 0}),
    (["a", "b"], {"a": 1, "b": 0}),
    (["a", "b"], {"a": 0}),
    (["a"], {"a": 0, "b": 1}),
    (["a"], {}),
    ([], {"a": 0}),
    (["a"], {"b": 0}),
    (["a"], {"a": 0.0}),
    (["a"], {"a": -0.0}),
    (["a"], {"a": True}),
    (["a"], {"a": False}),
    (["a", "b"], {"a": False, "b": True}),
    (["a"], {"a": np.int64(0)}),
    (["a", "b"], {"a": 0, "b": np.float32(1)}),
    (["a"], {"a": 0j}),
    (["a"], {"a": None}),
    (["a"], {"a": "0"}),
    (["a"], {"a": 2**70}),
    (["a"], {"a": -1}),
    (["a"], {"a": IntSub(0)}),
    (["a"], {"a": NAN}),
    ([1, 2], {1: 0, 2: 1}),
    ([1.0], {1: 0}),
    ([True], {1: 0}),
    ([0], {False: 0}),
    ([NAN], {NAN: 0}),
    ([_nan_obj], {_nan_obj: 0}),
    ([float("nan")], {float("nan"): 0}),
    (["a"], {StrSub("a"): 0}),
    ([StrSub("a")], {"a": 0}),
    ([StrEqAll("zz")], {"a": 0}),
    (["zz"], {StrEqAll("a"): 0}),
    ([_eq_all], {"a": 0}),
    (["a"], {_eq_all: 0}),
    ([EqNone()], {"a": 0}),
    (["a"], {"a": _eq_all}),
    (["a"], {"a": EqNone()}),
    (["a"], {"a": Truthy(0)}),
    ([Truthy("a")], {"a": 0}),
    ([b"a"], {b"a": 0}),
    ([("a", 1)], {("a", 1): 0}),
    ([None], {None: 0}),
    (["a", "b", "c"], {"a": 0, "b": 1, "c": 3}),
    ([f"r{i}" for i in range(300)], {f"r{i}": i for i in range(300)}),
    ([f"r{i}" for i in range(300)], {f"r{i}": i for i in range(299)}),
    ([f"r{i}" for i in range(300)], {f"r{i}": float(i) for i in range(300)}),
    ([f"r{i}" for i in range(300)], {f"r{i}": i if i != 299 else 300 for i in range(300)}),
]


@pytest.mark.parametrize("big", [2**30, 2**31, 2**62, -(2**30), 2**64])
def test_index_in_order_values_past_one_digit_are_not_positions(impl, big):
    # A position is read inline in C while it fits one internal digit; a bigger int there
    # (never a position) goes to the full passes, which say False as Python does.
    req_ids = [f"r{i}" for i in range(3)]
    index = {"r0": 0, "r1": big, "r2": 2}
    assert impl.index_in_order(req_ids, index) is False
    assert impl.index_in_order(req_ids, {"r0": 0, "r1": 1, "r2": 2}) is True


def _dict_shapes() -> list[tuple[str, list[Any], dict[Any, Any]]]:
    """Dicts of every internal shape the C path reads in place or declines (CPython 3.11
    reads a combined table's entries directly): str and non-str keys, across resizes, with
    deleted entries (their slots stay empty in the table), re-inserted keys, a split
    instance dict, and keys equal to but not the list's own objects."""
    shapes: list[tuple[str, list[Any], dict[Any, Any]]] = []
    for n in (1, 5, 6, 300, 1025):
        ids = [f"cmpl-{i:x}" for i in range(n)]
        shapes.append((f"str keys {n}", ids, {r: i for i, r in enumerate(ids)}))
        ints = list(range(10**6, 10**6 + n))
        shapes.append((f"int keys {n}", ints, {k: i for i, k in enumerate(ints)}))
        deleted = {r: i for i, r in enumerate([*ids, "gone"])}
        del deleted["gone"]  # the last entry's slot stays, empty: no longer a dense table
        shapes.append((f"deleted last {n}", ids, deleted))
        if n > 1:
            moved = {r: i for i, r in enumerate(ids)}
            moved[ids[0]] = moved.pop(ids[0])  # same items, the first key now last
            shapes.append((f"reinserted {n}", ids, moved))
        copies = ["".join(r) for r in ids]  # equal strs, each a new object
        shapes.append((f"equal keys {n}", copies, {r: i for i, r in enumerate(ids)}))
        shifted = {r: i + 1 for i, r in enumerate(ids)}
        shapes.append((f"wrong positions {n}", ids, shifted))
    obj = type("Obj", (), {})()
    obj.a, obj.b = 0, 1
    shapes.append(("split instance dict", ["a", "b"], vars(obj)))
    return shapes


@pytest.mark.parametrize(
    ("name", "req_ids", "index"), _dict_shapes(), ids=[name for name, _, _ in _dict_shapes()]
)
def test_index_in_order_reads_every_dict_shape_as_python(impl, name, req_ids, index):
    want = expr(req_ids, index)
    assert impl.index_in_order(req_ids, index) is want
    # The same items in order, whatever the table holds besides: only moved keys and
    # shifted positions are refused.
    assert want is (name.split()[0] not in ("reinserted", "wrong"))


@pytest.mark.parametrize(("req_ids", "index"), ODD_CASES)
def test_index_in_order_equals_python_expression(impl, req_ids, index):
    assert impl.index_in_order(req_ids, index) is expr(req_ids, index)


def test_index_in_order_equals_expression_for_random_dicts(impl):
    rng = np.random.default_rng(0)
    keys_pool: list[Any] = ["a", "b", "c", 0, 1, 1.0, True, NAN, None, StrSub("a"), b"a"]
    vals_pool: list[Any] = [0, 1, 2, 0.0, 1.0, True, False, -1, None, np.int64(1), 2**64]
    for _ in range(2000):
        k = int(rng.integers(0, 4))
        keys = [keys_pool[int(i)] for i in rng.integers(0, len(keys_pool), size=k)]
        index = {key: vals_pool[int(rng.integers(0, len(vals_pool)))] for key in keys}
        if rng.random() < 0.5:  # the common shape: positions as values, maybe perturbed
            index = {key: i for i, key in enumerate(index)}
        req_ids = list(index) if rng.random() < 0.6 else keys[: int(rng.integers(0, k + 1))]
        if rng.random() < 0.3 and req_ids:
            req_ids = req_ids[::-1]
        assert impl.index_in_order(req_ids, index) is expr(req_ids, index), (req_ids, index)


@pytest.mark.parametrize(
    ("req_ids", "index"),
    [
        (("a",), {"a": 0}),
        (ListSub(["a"]), {"a": 0}),
        (["a"], type("D", (dict,), {})({"a": 0})),
        (["a"], [("a", 0)]),
        (None, None),
        ("a", {"a": 0}),
    ],
)
def test_index_in_order_false_unless_exact_list_and_dict(impl, req_ids, index):
    assert impl.index_in_order(req_ids, index) is False


class Boom(Exception):
    pass


class Raises:
    def __eq__(self, other: object) -> bool:
        raise Boom("eq")

    __hash__ = object.__hash__


class RaisesInBool:
    def __bool__(self) -> bool:
        raise Boom("bool")


class EqBadBool:
    def __eq__(self, other: object) -> Any:
        return RaisesInBool()

    __hash__ = object.__hash__


@pytest.mark.parametrize(
    ("req_ids", "index"),
    [
        ([Raises()], {"a": 0}),
        (["a"], {Raises(): 0}),
        (["a"], {"a": Raises()}),
        (["a", "b"], {"a": 0, "b": Raises()}),
        (["a"], {"a": EqBadBool()}),
        ([EqBadBool()], {"a": 0}),
    ],
)
def test_index_in_order_eq_exceptions_propagate(impl, req_ids, index):
    with pytest.raises(Boom):
        expr(req_ids, index)
    with pytest.raises(Boom):
        impl.index_in_order(req_ids, index)


@pytest.mark.parametrize(
    ("req_ids", "index"),
    [
        (["x", "b"], {"a": 0, "b": Raises()}),  # keys differ: values never compared
        (["a", "b"], {"a": 5, "b": 1, Raises(): 2}),  # sizes differ: nothing compared
    ],
)
def test_index_in_order_short_circuits_like_python(impl, req_ids, index):
    assert expr(req_ids, index) is False
    assert impl.index_in_order(req_ids, index) is False


def test_index_in_order_keys_before_values(impl):
    # A failing value at position 0 must not decide before a later key's __eq__ has run.
    index = {"a": 5, Raises(): 1}
    with pytest.raises(Boom):
        expr(["a", "b"], index)
    with pytest.raises(Boom):
        impl.index_in_order(["a", "b"], index)


def test_index_in_order_same_eq_calls_as_python(impl):
    def run(f: Callable[[Any, Any], bool]) -> tuple[bool, int]:
        EqAll.calls = 0
        req_ids = [_eq_all, "b", _eq_all]
        index = {"a": 0, "b": _eq_all, "c": 2}
        return f(req_ids, index), EqAll.calls

    assert run(impl.index_in_order) == run(expr)


class Mutator:
    """An __eq__ that mutates the list or the dict under comparison."""

    def __init__(self, target: Any, action: str) -> None:
        self.target, self.action = target, action

    def __eq__(self, other: object) -> bool:
        if self.action == "append":
            self.target.append("z")
        elif self.action == "clear":
            self.target.clear()
        elif self.action == "pop":
            self.target.pop()
        elif self.action == "dict-clear":
            self.target.clear()
        elif self.action == "dict-add":
            self.target["new"] = 99
        return True

    __hash__ = object.__hash__


@pytest.mark.parametrize("action", ["append", "clear", "pop", "dict-clear", "dict-add"])
@pytest.mark.parametrize("where", ["key", "req_id", "value"])
def test_index_in_order_survives_mutation_in_eq(impl, action, where):
    def case() -> tuple[list[Any], dict[Any, Any]]:
        req_ids: list[Any] = ["a", "b", "c"]
        index: dict[Any, Any] = {"a": 0, "b": 1, "c": 2}
        target = index if action.startswith("dict") else req_ids
        m = Mutator(target, action)
        if where == "key":
            index = {"a": 0, m: 1, "c": 2}
            if target is not req_ids:
                m.target = index
        elif where == "req_id":
            req_ids[1] = m
        else:
            index["b"] = m
        return req_ids, index

    r1, i1 = case()
    r2, i2 = case()
    assert impl.index_in_order(r1, i1) is expr(r2, i2)
    assert (len(r1), len(i1)) == (len(r2), len(i2))  # the same mutations happened


# ----------------------------------------------------------------------------- copy_from_address


SRC = np.arange(1, 33, dtype=np.uint8)  # the source bytes: 1 .. 32


def test_copy_from_address_copies_the_bytes_into_the_region(impl):
    dst = np.zeros(48, np.uint8)
    assert impl.copy_from_address(dst, 5, SRC.ctypes.data + 2, 20) is True
    want = np.zeros(48, np.uint8)
    want[5:25] = SRC[2:22]
    assert dst.tolist() == want.tolist()


def test_copy_from_address_writes_any_contiguous_writable_buffer(impl):
    # A 2-D int32 array (offsets are in bytes), and a bytearray.
    grid = np.zeros((2, 4), np.int32)
    assert impl.copy_from_address(grid, 8, SRC.ctypes.data, 8) is True
    assert grid.reshape(-1).view(np.uint8)[8:16].tolist() == SRC[:8].tolist()
    raw = bytearray(4)
    assert impl.copy_from_address(raw, 0, SRC.ctypes.data, 4) is True
    assert raw == bytes(SRC[:4])


def test_copy_from_address_the_whole_buffer_and_empty_copies(impl):
    dst = np.zeros(8, np.uint8)
    assert impl.copy_from_address(dst, 0, SRC.ctypes.data, 8) is True
    assert dst.tolist() == SRC[:8].tolist()
    # Nothing to copy: any place inside, even the end, and no address needed.
    assert impl.copy_from_address(dst, 8, 0, 0) is True
    assert impl.copy_from_address(bytearray(), 0, 0, 0) is True


@pytest.mark.parametrize(
    ("dst", "offset", "nbytes"),
    [
        (bytes(16), 0, 4),  # read-only
        (np.zeros(16, np.uint8)[::2], 0, 4),  # not contiguous
        ([0] * 16, 0, 4),  # no buffer protocol
        (np.zeros(16, np.uint8), 13, 4),  # past the end
        (np.zeros(16, np.uint8), 17, 0),  # starts past the end
        (np.zeros(16, np.uint8), -1, 4),
        (np.zeros(16, np.uint8), 0, -1),
        (np.zeros(16, np.uint8), 2**62, 2**62),  # offset + nbytes would overflow
    ],
)
def test_copy_from_address_refuses_and_writes_nothing(impl, dst, offset, nbytes):
    before = None if isinstance(dst, list) else memoryview(dst).tobytes()
    assert impl.copy_from_address(dst, offset, SRC.ctypes.data, nbytes) is False
    if before is not None:
        assert memoryview(dst).tobytes() == before


def test_copy_from_address_null_source_refused(impl):
    dst = np.zeros(8, np.uint8)
    assert impl.copy_from_address(dst, 0, 0, 4) is False
    assert not dst.any()


@pytest.mark.parametrize(
    ("offset", "address", "nbytes", "exc"),
    [
        ("0", 0, 0, TypeError),
        (0, 1.5, 0, TypeError),
        (0, 0, None, TypeError),
        (2**63, 0, 0, OverflowError),
        (0, -1, 0, OverflowError),
        (0, 2**64, 0, OverflowError),
        (0, 0, -(2**63) - 1, OverflowError),
    ],
)
def test_copy_from_address_bad_integer_arguments_raise_alike(offset, address, nbytes, exc):
    with pytest.raises(exc):
        agree("copy_from_address", bytearray(8), offset, address, nbytes)


def test_copy_from_address_index_objects_accepted(impl):
    dst = np.zeros(8, np.uint8)
    got = impl.copy_from_address(dst, np.int64(2), np.uint64(SRC.ctypes.data), np.int32(3))
    assert got is True
    assert dst.tolist() == [0, 0, 1, 2, 3, 0, 0, 0]


# ----------------------------------------------------------------------------- str_list


def string_buffers(arr: pa.Array) -> tuple[Any, Any]:
    _, offs, data = arr.buffers()
    return offs, data if data is not None else b""


@pytest.mark.parametrize("strs", UTF8_VALID)
@pytest.mark.parametrize("as_", ["pyarrow", "bytes", "numpy", "bytearray", "memoryview"])
def test_str_list_valid(impl, strs, as_):
    arr = pa.array(strs, pa.string())
    offs, data = string_buffers(arr)
    if as_ == "bytes":
        offs, data = offs.to_pybytes(), bytes(data)
    elif as_ == "numpy":
        offs = np.frombuffer(offs, np.int32)
        data = np.frombuffer(data, np.uint8)
    elif as_ == "bytearray":
        offs, data = bytearray(offs), bytearray(data)
    elif as_ == "memoryview":
        offs, data = memoryview(offs), memoryview(data)
    got = impl.str_list(offs, data, arr.offset, len(arr))
    assert got == strs
    assert type(got) is list
    assert all(type(s) is str for s in got)


@pytest.mark.parametrize(("start", "stop"), [(0, 0), (0, 1), (1, 3), (3, 7), (6, 7), (7, 7)])
def test_str_list_sliced(impl, start, stop):
    arr = pa.array(["a", "bb", "", "é", "日本", "x" * 40, "🙂"], pa.string())[start:stop]
    offs, data = string_buffers(arr)
    assert arr.offset == start
    assert impl.str_list(offs, data, arr.offset, len(arr)) == arr.to_pylist()


def test_str_list_large_batch_of_req_ids(impl):
    strs = [f"chatcmpl-0123456789abcdef-{i}" for i in range(5000)]
    arr = pa.array(strs, pa.string())[17:4000]
    offs, data = string_buffers(arr)
    assert impl.str_list(offs, data, arr.offset, len(arr)) == strs[17:4000]


def offsets_bytes(*values: int) -> bytes:
    return np.array(values, "<i4").tobytes()


@pytest.mark.parametrize(
    ("offs", "data", "offset", "n"),
    [
        (offsets_bytes(0, 1), b"a", 0, 2),  # offsets buffer too short for n
        (offsets_bytes(0, 1), b"a", 1, 1),  # ... for the offset
        (offsets_bytes(0, 1, 2), b"ab", 2, 1),
        (offsets_bytes(0, 1)[:7], b"a", 0, 1),  # not a whole second entry
        (b"", b"", 0, 1),
        (offsets_bytes(0, 1), b"a", -1, 1),
        (offsets_bytes(0, 1), b"a", 0, -1),
        (offsets_bytes(0, 2), b"a", 0, 1),  # past the data
        (offsets_bytes(-1, 1), b"a", 0, 1),  # negative
        (offsets_bytes(1, 0), b"a", 0, 1),  # decreasing
        (offsets_bytes(0, 2, 1, 3), b"abc", 0, 3),
        (offsets_bytes(0, 1), b"\xff", 0, 1),  # invalid UTF-8
        (offsets_bytes(0, 1), "é".encode(), 0, 1),  # a character cut in two
        (offsets_bytes(0, 3), b"\xed\xa0\x80", 0, 1),  # an encoded surrogate
        (offsets_bytes(0, 2), b"\xc0\x80", 0, 1),  # overlong NUL
        (offsets_bytes(0, 1, 2), b"a\xff", 0, 2),  # bad in the last string only
        (offsets_bytes(0, 1), b"a", 2**62, 2**62),  # no overflow in the bounds
        (offsets_bytes(0, 1), b"a", 0, 2**63 - 1),
        (offsets_bytes(0, 1), b"a", 2**63 - 1, 1),
        (np.arange(8, dtype=np.int32)[::2], b"abcdefgh", 0, 3),  # not contiguous
        (offsets_bytes(0, 1), np.frombuffer(b"abcd", np.uint8)[::2], 0, 1),
        ([0, 1], b"a", 0, 1),  # no buffer protocol
        (offsets_bytes(0, 1), "a", 0, 1),
        (None, None, 0, 0),  # checked before n == 0
        (offsets_bytes(0, 1), None, 0, 0),
    ],
)
def test_str_list_refuses(impl, offs, data, offset, n):
    assert impl.str_list(offs, data, offset, n) is None


def test_str_list_zero_length_reads_nothing(impl):
    assert impl.str_list(b"", b"", 0, 0) == []
    assert impl.str_list(b"", b"", 5, 0) == []
    assert impl.str_list(offsets_bytes(9, 1), b"", 0, 0) == []


def test_str_list_reads_only_its_slice(impl):
    # Entries outside [offset, offset + n] may be anything: they belong to other slices.
    offs = offsets_bytes(-5, 0, 1, 3, 99)
    assert impl.str_list(offs, b"abc", 1, 2) == ["a", "bc"]


def test_str_list_buffer_formats_are_raw_bytes(impl):
    # Buffers are their bytes, whatever their format: int64 offsets are read as int32 pairs.
    offs = np.array([0, 1], dtype="<i8")  # int32 view: 0, 0, 1, 0
    assert impl.str_list(offs, b"a", 0, 2) == ["", "a"]
    assert impl.str_list(offs, b"a", 0, 3) is None  # 1 then 0: decreasing
    assert impl.str_list(np.zeros((2, 2), np.int32), b"", 0, 3) == ["", "", ""]
    assert impl.str_list(np.zeros((0, 2), np.int32), b"", 0, 0) == []


@pytest.mark.parametrize(("offset", "n", "exc"), [("0", 1, TypeError), (0, 1.5, TypeError)])
def test_str_list_bad_integer_arguments_raise(impl, offset, n, exc):
    with pytest.raises(exc):
        impl.str_list(offsets_bytes(0, 1), b"a", offset, n)


def test_str_list_exporter_errors_propagate_alike():
    dates = np.array(["2020-01-01"], "M8[D]")  # numpy refuses to export datetimes: ValueError
    with pytest.raises(ValueError, match="raised alike"):
        agree("str_list", dates, b"", 0, 1)


# ----------------------------------------------------------------------------- split


SPLIT_VALID = [
    [[1, 2], [], [3]],
    [[]],
    [[0]] * 7,
    [[2**31 - 1, -(2**31)], [-1, 0, 1]],
    [list(range(50)), [], [], list(range(7))],
]


@pytest.mark.parametrize("itemsize", [4, 8])
@pytest.mark.parametrize("lists", SPLIT_VALID)
@pytest.mark.parametrize("as_", ["numpy", "pyarrow", "bytes"])
def test_split_int_lists_valid(impl, lists, itemsize, as_):
    arr = pa.array(lists, pa.list_(pa.int32() if itemsize == 4 else pa.int64()))
    values = arr.values.buffers()[1]
    offsets: Any = np.asarray(arr.offsets)
    if as_ == "numpy":
        values = np.asarray(arr.values)
    elif as_ == "bytes":
        values, offsets = values.to_pybytes(), offsets.tobytes()
    got = impl.split_int_lists(values, offsets, itemsize, len(arr))
    assert got == lists
    assert all(type(x) is list for x in got)
    assert all(type(v) is int for x in got for v in x)


@pytest.mark.parametrize(("start", "stop"), [(0, 0), (1, 3), (2, 5), (4, 5), (5, 5)])
def test_split_int_lists_sliced(impl, start, stop):
    arr = pa.array([[1], [2, 3], [], [4, 5, 6], [7]], pa.list_(pa.int64()))[start:stop]
    assert arr.offset == start
    got = impl.split_int_lists(arr.values.buffers()[1], np.asarray(arr.offsets), 8, len(arr))
    assert got == arr.to_pylist()


def test_split_int_lists_int64_extremes(impl):
    values = np.array([2**63 - 1, -(2**63), 0], np.int64)
    assert impl.split_int_lists(values, offsets_bytes(0, 2, 3), 8, 2) == [
        [2**63 - 1, -(2**63)],
        [0],
    ]


def test_split_int_lists_uniform_matches_reshape(impl):
    values = np.arange(4096, dtype=np.int64) * 7919 - 10**9
    offsets = np.arange(0, 4097, 4, dtype=np.int32)
    assert impl.split_int_lists(values, offsets, 8, 1024) == values.reshape(1024, -1).tolist()


@pytest.mark.parametrize(
    ("values", "offs", "itemsize", "n"),
    [
        (np.arange(3, dtype=np.int64), offsets_bytes(0, 4), 8, 1),  # past the values
        (np.arange(3, dtype=np.int64), offsets_bytes(0, 3), 4, 2),  # too few offsets
        (np.arange(3, dtype=np.int64), offsets_bytes(0, 3)[:7], 8, 1),
        (np.arange(3, dtype=np.int64), b"", 8, 1),
        (np.arange(3, dtype=np.int64), offsets_bytes(-1, 1), 8, 1),  # negative
        (np.arange(3, dtype=np.int64), offsets_bytes(2, 1), 8, 1),  # decreasing
        (np.arange(3, dtype=np.int64), offsets_bytes(0, 2, 1, 3), 8, 3),
        (np.arange(3, dtype=np.int64).tobytes()[:23], offsets_bytes(0, 3), 8, 1),
        (np.arange(3, dtype=np.int32), offsets_bytes(0, 3), 8, 1),  # 12 bytes: 1 int64
        (np.arange(3, dtype=np.int64), offsets_bytes(0, 1), 2, 1),  # itemsize
        (np.arange(3, dtype=np.int64), offsets_bytes(0, 1), 16, 1),
        (np.arange(3, dtype=np.int64), offsets_bytes(0, 1), 0, 1),
        (np.arange(3, dtype=np.int64), offsets_bytes(0, 1), 8, -1),
        (np.arange(3, dtype=np.int64), offsets_bytes(0, 1), 8, 2**63 - 1),
        (np.arange(6, dtype=np.int64)[::2], offsets_bytes(0, 1), 8, 1),  # not contiguous
        (np.arange(3, dtype=np.int64), np.arange(4, dtype=np.int32)[::2], 8, 1),
        ([1, 2, 3], offsets_bytes(0, 1), 8, 1),  # no buffer protocol
        (np.arange(3, dtype=np.int64), [0, 1], 8, 1),
        (None, offsets_bytes(0), 8, 0),  # checked before n == 0
    ],
)
def test_split_int_lists_refuses(impl, values, offs, itemsize, n):
    assert impl.split_int_lists(values, offs, itemsize, n) is None


def test_split_int_lists_zero_length_reads_nothing(impl):
    assert impl.split_int_lists(b"", b"", 8, 0) == []
    assert impl.split_int_lists(b"", offsets_bytes(5), 4, 0) == []


def test_split_int_lists_values_length_is_floored(impl):
    # 20 bytes hold 2 int64 values; the offsets may reach 2 but not 3.
    values = np.arange(3, dtype=np.int64).tobytes()[:20]
    assert impl.split_int_lists(values, offsets_bytes(0, 2), 8, 1) == [[0, 1]]
    assert impl.split_int_lists(values, offsets_bytes(0, 3), 8, 1) is None


def test_split_int_lists_int32_values(impl):
    values = np.array([-1, 2**31 - 1, -(2**31)], "<i4")
    assert impl.split_int_lists(values, offsets_bytes(1, 3), 4, 1) == [[2**31 - 1, -(2**31)]]


@pytest.mark.skipif(_speedups is None, reason="arrow_outputs._speedups not built")
def test_c_decode_index_positions_across_table_growth():
    """The whole-batch walk maps request ids to positions from a table of ints it grows on
    demand (shared between steps): every size, before and after a growth, and a step past
    the table's largest size, gets exactly its own positions."""
    for n in (3, 300, 1030, 40, 70_000):
        ids = [f"r{i}" for i in range(n)]
        out = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled_token_ids=[])
        with codec_on("c"):
            back = from_record_batch(to_record_batch(out, step=0))
        assert back.req_ids == ids
        assert back.req_id_to_index == out.req_id_to_index
        assert list(back.req_id_to_index.values()) == list(range(n))


@pytest.mark.skipif(_speedups is None, reason="arrow_outputs._speedups not built")
def test_c_int_rows_are_left_to_reference_counting():
    """The C walks' rows of ints leave the cycle collector (they can be in no cycle): a
    process that decodes 1024-request steps with the collector on is spared the collections
    they would set off. Their values are the specification's; the outer list,
    which a caller may fill with anything, stays tracked. The whole-batch walk's request
    ids (exact strs) leave it too, whether decoded afresh or reused from the last step."""
    values = np.arange(6, dtype=np.int64)
    rows = _speedups.split_int_lists(values, offsets_bytes(0, 2, 2, 6), 8, 3)
    assert rows == _pyspeedups.split_int_lists(values, offsets_bytes(0, 2, 2, 6), 8, 3)
    assert [gc.is_tracked(r) for r in rows] == [False, False, False]
    assert gc.is_tracked(rows)
    # The same rows from the whole-batch walk that from_record_batch takes.
    out = ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, sampled_token_ids=[[7, 8], [9]])
    with codec_on("c"):
        back = from_record_batch(to_record_batch(out, step=0))
    assert back.sampled_token_ids == [[7, 8], [9]]
    assert not any(map(gc.is_tracked, back.sampled_token_ids))
    assert gc.is_tracked(back.sampled_token_ids)
    assert back.req_ids == ["a", "b"]
    assert not gc.is_tracked(back.req_ids)
    # A step of 32 requests or more is kept for the next decode; the next one reuses its
    # strs (the very same objects), and its list of them is untracked too.
    many = [f"req-{i}" for i in range(40)]
    big = ModelRunnerOutput(many, {r: i for i, r in enumerate(many)}, sampled_token_ids=[])
    with codec_on("c"):
        first = from_record_batch(to_record_batch(big, step=1))
        again = from_record_batch(to_record_batch(big, step=2))
    assert first.req_ids == again.req_ids == many
    assert all(a is b for a, b in zip(first.req_ids, again.req_ids))
    assert not gc.is_tracked(first.req_ids)
    assert not gc.is_tracked(again.req_ids)
    assert first.req_ids is not again.req_ids
    # A row holds ints only until a caller changes it; each row is a list of its own.
    back.sampled_token_ids[0].append(10)
    assert back.sampled_token_ids == [[7, 8, 10], [9]]


# ----------------------------------------------------------------------------- properties


int_values = st.one_of(
    st.integers(-(2**31), 2**31 - 1),
    st.integers(-(2**65), 2**65),
    st.sampled_from([2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 2**63 - 1, -(2**63), 0, -1]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(int_values, max_size=6), max_size=12), st.sampled_from([4, 8]))
def test_flatten_int_lists_property(lists, itemsize):
    got = agree("flatten_int_lists", lists, len(lists), itemsize)
    lo, hi = I32 if itemsize == 4 else I64
    in_range = all(lo <= v <= hi for x in lists for v in x)
    assert (got is not None) == in_range
    if got is not None:
        assert got == ref_flatten(lists, itemsize)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.one_of(st.integers(-5, 5), st.booleans(), st.floats(), st.none()), max_size=4),
        max_size=6,
    )
)
def test_flatten_int_lists_property_mixed_types(lists):
    got = agree("flatten_int_lists", lists, len(lists), 8)
    assert (got is not None) == all(type(v) is int for x in lists for v in x)


def has_surrogate(strs: list[str]) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for s in strs for c in s)


texts = st.text(st.characters(exclude_categories=()), max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(texts, max_size=12))
def test_utf8_array_property(strs):
    got = agree("utf8_array", strs)
    assert (got is None) == has_surrogate(strs)
    if got is not None:
        assert got == ref_utf8(strs)
        offsets, data = got
        assert agree("str_list", offsets, data, 0, len(strs)) == strs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=10), max_size=15), st.data())
def test_str_list_property_slices(strs, data):
    start = data.draw(st.integers(0, len(strs)))
    stop = data.draw(st.integers(start, len(strs)))
    arr = pa.array(strs, pa.string())[start:stop]
    offs, buf = string_buffers(arr)
    assert agree("str_list", offs, buf, arr.offset, len(arr)) == strs[start:stop]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(-3, 12), min_size=0, max_size=8),
    st.binary(max_size=12),
    st.integers(-1, 8),
    st.integers(-1, 8),
)
def test_str_list_property_arbitrary_buffers(offsets, data, offset, n):
    offs = np.array(offsets, "<i4").tobytes()
    got = agree("str_list", offs, data, offset, n)
    # The reference: the rules of the specification, written out the long way.
    expected: list[str] | None
    if offset < 0 or n < 0:
        expected = None
    elif n == 0:
        expected = []
    elif offset + n + 1 > len(offsets):
        expected = None
    else:
        window = offsets[offset : offset + n + 1]
        if window[0] < 0 or window[-1] > len(data) or window != sorted(window):
            expected = None
        else:
            try:
                expected = [data[a:b].decode("utf-8") for a, b in itertools.pairwise(window)]
            except UnicodeDecodeError:
                expected = None
    assert got == expected


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12), st.data())
def test_str_list_property_cuts_inside_characters(text, data):
    # Valid UTF-8 cut at arbitrary byte positions: a cut inside a character must refuse.
    raw = text.encode("utf-8")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), min_size=2, max_size=8)))
    got = agree("str_list", np.array(cuts, "<i4"), raw, 0, len(cuts) - 1)
    try:
        expected = [raw[a:b].decode("utf-8") for a, b in itertools.pairwise(cuts)]
    except UnicodeDecodeError:
        expected = None
    assert got == expected


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5), max_size=10),
    st.sampled_from([4, 8]),
    st.data(),
)
def test_split_int_lists_property(lists, itemsize, data):
    if itemsize == 4:
        lists = [[v % 2**32 - 2**31 for v in x] for x in lists]
    t = pa.int32() if itemsize == 4 else pa.int64()
    start = data.draw(st.integers(0, len(lists)))
    stop = data.draw(st.integers(start, len(lists)))
    arr = pa.array(lists, pa.list_(t))[start:stop]
    values = arr.values.buffers()[1] if len(arr.values) else b""
    got = agree("split_int_lists", values, np.asarray(arr.offsets), itemsize, len(arr))
    assert got == lists[start:stop]


# ----------------------------------------------------------------------------- robustness


def test_speedups_random_buffers_never_crash():
    """A few thousand random buffers and offsets: both paths agree and nothing crashes.

    The offsets mix plausible ones (non-negative, increasing) with garbage, so both the
    accepting paths and every refusal are reached.
    """
    rng = np.random.default_rng(12345)
    started = time.perf_counter()
    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
    for case in range(5000):
        k = int(rng.integers(0, 10))
        if rng.random() < 0.6:
            offs = np.cumsum(rng.integers(0, 3, size=k)).astype("<i4")
        else:
            offs = rng.integers(-(2**31), 2**31, size=k, dtype=np.int64).astype("<i4")
        raw = offs.tobytes()
        if rng.random() < 0.1:
            raw = raw[: int(rng.integers(0, len(raw) + 1))]  # a ragged tail
        nbytes = int(rng.integers(0, 100))
        if rng.random() < 0.5:
            data = bytes(rng.integers(0, 256, size=nbytes, dtype=np.uint8))
        else:
            data = bytes(rng.integers(0x20, 0x7F, size=nbytes, dtype=np.uint8))
        if k and rng.random() < 0.7:  # a window inside the offsets (the usual case)
            offset = int(rng.integers(0, k))
            n = int(rng.integers(0, k - offset)) if rng.random() < 0.2 else k - offset - 1
        else:
            offset, n = (int(x) for x in rng.integers(-2, 12, size=2))
        itemsize = int(rng.choice([4, 8, 8, 3]))
        as_numpy = rng.random() < 0.3
        buf_o: Any = np.frombuffer(raw, np.uint8) if as_numpy else raw
        buf_d: Any = pa.py_buffer(data) if rng.random() < 0.3 else data
        got = agree("str_list", buf_o, buf_d, offset, n)
        outcomes["str_list", "None" if got is None else "[]" if got == [] else "items"] += 1
        sliced = buf_o[max(offset, 0) * 4 :]  # split_int_lists takes its offsets sliced
        got = agree("split_int_lists", buf_d, sliced, itemsize, n)
        outcomes["split", "None" if got is None else "[]" if got == [] else "items"] += 1
        assert case < 100 or time.perf_counter() - started < 30
    # Every outcome is reached often: the case mix tests the accepting paths too.
    assert min(outcomes.values()) > 250, outcomes


def test_speedups_release_buffers_on_every_path(impl):
    # A bytearray cannot be resized while a buffer of it is held: resizing after each call
    # proves the call released what it took, on success, refusal and error paths alike.
    cases: list[tuple[str, tuple[Any, ...]]] = []
    ok_offs = offsets_bytes(0, 1, 3)
    for offs, data, offset, n in [
        (ok_offs, b"abc", 0, 2),  # success
        (ok_offs, b"ab", 0, 2),  # past the data
        (ok_offs, b"\xff\xff\xff", 0, 2),  # invalid UTF-8
        (ok_offs, b"abc", 0, 0),  # empty
        (ok_offs, b"abc", -1, 1),
        (ok_offs, b"abc", 0, 9),
        (ok_offs, np.arange(4)[::2], 0, 1),  # second buffer refused
    ]:
        cases.append(("str_list", (bytearray(offs), data, offset, n)))
        if isinstance(data, bytes):
            cases.append(("str_list", (offs, bytearray(data), offset, n)))
    split_cases: list[tuple[bytes, Any, int, int]] = [
        (np.arange(3, dtype="<i8").tobytes(), offsets_bytes(0, 3), 8, 1),
        (np.arange(3, dtype="<i8").tobytes(), offsets_bytes(0, 4), 8, 1),
        (np.arange(3, dtype="<i8").tobytes(), offsets_bytes(0, 3), 5, 1),
        (np.arange(3, dtype="<i8").tobytes(), offsets_bytes(0, 3), 8, 0),
        (np.arange(3, dtype="<i8").tobytes(), [0, 1], 8, 1),
    ]
    for vals, offs, itemsize, n in split_cases:
        cases.append(("split_int_lists", (bytearray(vals), offs, itemsize, n)))
        if not isinstance(offs, list):
            cases.append(("split_int_lists", (vals, bytearray(offs), itemsize, n)))
    cases.append(("offsets_ok", (bytearray(16), 0)))  # refused after its buffer was read
    for name, args in cases:
        getattr(impl, name)(*args)
        for a in args:
            if isinstance(a, bytearray):
                a.extend(b"0123")  # BufferError if still exported
    held = bytearray(offsets_bytes(0, 1))
    with pytest.raises(TypeError):
        impl.str_list(held, b"a", "0", 1)  # the integer arguments are read first
    held.extend(b"0")


def test_speedups_no_leaks(impl):
    inputs: list[tuple[str, tuple[Any, ...]]] = [
        ("flatten_int_lists", ([[1, 2], [3]], 2, 8)),
        ("flatten_int_lists", ([[1, 2], [3.0]], 2, 8)),
        ("flatten_int_lists", ([[1, 2], [2**40]], 2, 4)),
        ("utf8_array", (["a", "é"],)),
        ("utf8_array", (["a", "\ud800"],)),
        ("index_in_order", (["a", "b"], {"a": 0, "b": 1})),
        ("index_in_order", (["a", "b"], {"a": 0, "b": 1.0})),
        ("str_list", (offsets_bytes(0, 1, 3), b"abc", 0, 2)),
        ("str_list", (offsets_bytes(0, 1, 3), b"a\xff\xff", 0, 2)),
        ("split_int_lists", (np.arange(3), offsets_bytes(0, 1, 3), 8, 2)),
        ("split_int_lists", (np.arange(3), offsets_bytes(0, 1, 4), 8, 2)),
        ("offsets_ok", (np.array([0, 1, 3]), 3)),
        ("offsets_ok", (np.array([0, 3, 1], np.int32), 1)),
        ("offsets_ok", (bytearray(8), 0)),
    ]
    for name, args in inputs:
        fn = getattr(impl, name)
        objs = [a for a in args if not isinstance(a, int)]  # small ints are shared
        refs = [sys.getrefcount(a) for a in objs]
        for _ in range(200):
            fn(*args)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(3000):
                fn(*args)
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 10_000, (name, args, grown)
        assert [sys.getrefcount(a) for a in objs] == refs, name


# ----------------------------------------------------------------------------- the selector


@pytest.fixture
def restore_path():
    was_c = _accel.accelerated()
    yield
    _accel.set_pure_python(not was_c)


def test_accel_set_pure_python_switches_every_function(restore_path):
    _accel.set_pure_python(True)
    assert _accel.accelerated() is False
    for name in FUNCS:
        assert getattr(_accel, name) is getattr(_pyspeedups, name)
    if _accel.AVAILABLE:
        _accel.set_pure_python(False)
        assert _accel.accelerated() is True
        for name in FUNCS:
            assert getattr(_accel, name) is getattr(_speedups, name)


def test_accel_available_matches_the_module():
    assert _accel.AVAILABLE is (_speedups is not None)


def test_accel_compiled_path_unavailable_raises(restore_path, monkeypatch):
    monkeypatch.setattr(_accel, "_compiled", None)
    with pytest.raises(UnsupportedValueError, match=r"set_pure_python\(False\): expected"):
        _accel.set_pure_python(False)
    _accel.set_pure_python(True)
    assert not _accel.accelerated()


@pytest.mark.parametrize(("value", "pure"), [("1", True), ("0", False), ("", False)])
def test_accel_environment_variable_picks_the_path(value, pure):
    code = "from arrow_outputs import _accel; print(_accel.AVAILABLE, _accel.accelerated())"
    env = {**os.environ, "ARROW_OUTPUTS_PURE_PYTHON": value}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    available = _speedups is not None
    assert out.stdout.split() == [str(available), str(available and not pure)]


def test_accel_default_is_compiled_when_available():
    env = {k: v for k, v in os.environ.items() if k != "ARROW_OUTPUTS_PURE_PYTHON"}
    code = "from arrow_outputs import _accel; print(_accel.accelerated())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == str(_speedups is not None)


# ----------------------------------------------------------------------------- mask_rows


def _mask_case(seed: int, rows: int = 12, width: int = 4, vocab: int = 37):
    rng = np.random.default_rng(seed)
    keep = rng.random((rows, vocab)) < rng.random((rows, 1)) * 0.5
    lens = keep.sum(axis=1).astype(np.int32)
    tok = np.zeros((rows, width), np.int32)
    for r in range(rows):
        ids = np.flatnonzero(keep[r])[:width]
        tok[r, : len(ids)] = ids
    packed = np.packbits(keep, axis=1, bitorder="little")
    expected = np.concatenate([np.flatnonzero(keep[r]) for r in range(rows)] + [[]]).astype(
        np.int32
    )
    return tok, width, packed, packed.shape[1], lens, vocab, expected


@pytest.mark.parametrize("seed", range(20))
def test_mask_rows_supports(impl, seed):
    tok, width, packed, row_bytes, lens, vocab, expected = _mask_case(seed)
    out = np.empty(int(lens.sum()), np.int32)
    assert impl.mask_rows(tok, width, packed, row_bytes, lens, vocab, out) is True
    assert out.tolist() == expected.tolist()


@pytest.mark.parametrize(
    "damage",
    [
        "short_tok",
        "short_packed",
        "negative_len",
        "count_off",
        "out_size",
        "readonly_out",
        "row_bytes_small",
        "odd_lens",
    ],
)
def test_mask_rows_refuses(damage):
    tok, width, packed, row_bytes, lens, vocab, _ = _mask_case(3)
    lens = lens.copy()
    out = np.empty(int(lens.sum()), np.int32)
    args = [tok, width, packed, row_bytes, lens, vocab, out]
    wide = int(np.argmax(lens > width))
    if damage == "short_tok":
        args[0] = tok.reshape(-1)[:-1].copy()
    elif damage == "short_packed":
        args[2] = packed.reshape(-1)[:-1].copy()
    elif damage == "negative_len":
        lens[0] = -1
    elif damage == "count_off":
        lens[wide] += 1
        args[6] = np.empty(int(lens.sum()), np.int32)
    elif damage == "out_size":
        args[6] = np.empty(int(lens.sum()) + 1, np.int32)
    elif damage == "readonly_out":
        out.flags.writeable = False
    elif damage == "row_bytes_small":
        args[3] = row_bytes - 1
        args[2] = packed.reshape(-1).copy()
    elif damage == "odd_lens":
        args[4] = lens.view(np.uint8)[:-1].copy()
    assert agree("mask_rows", *args) is False


@pytest.mark.parametrize("seed", range(200))
def test_mask_rows_random_buffers_never_crash(seed):
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(0, 6))
    width = int(rng.integers(0, 5))
    vocab = int(rng.integers(0, 40))
    row_bytes = int(rng.integers(0, 7))
    tok = rng.integers(-5, 50, int(rng.integers(0, 30))).astype(np.int32)
    packed = rng.integers(0, 256, int(rng.integers(0, 30))).astype(np.uint8)
    lens = rng.integers(-1, 10, rows).astype(np.int32)
    out = np.empty(int(rng.integers(0, 40)), np.int32)
    c_out = out.copy()
    got = [
        m.mask_rows(tok, width, packed, row_bytes, lens, vocab, o)
        for m, o in zip(BOTH, (out, c_out))
    ]
    assert all(g == got[0] for g in got)
    if got[0]:
        assert out.tolist() == c_out.tolist()


# ----------------------------------------------------------------------------- sampled_rows


def ref_sampled(padded: np.ndarray, counts: list[int]) -> tuple[list[int], list[int]]:
    """vLLM's trim (``del row[count:]``) of each row, flattened, and its offsets."""
    rows = [row[:c] for row, c in zip(padded.tolist(), counts)]
    return list(itertools.chain.from_iterable(rows)), [0, *itertools.accumulate(map(len, rows))]


@pytest.mark.parametrize(
    ("width", "counts"),
    [
        (1, [1, 1, 1]),  # a decode step
        (3, [1, 1]),  # a decode step with spare slots
        (3, [3, 3]),  # every slot
        (3, [0, 0]),  # nothing sampled
        (2, [5, 2, 9]),  # past the row keeps the row: uniform
        (4, [2, 0, 4, 1]),  # speculative decoding
        (4, [0, 4, 5]),
        (0, [0, 3]),  # no slots at all
    ],
)
def test_sampled_rows_trims_as_vllm(impl, width, counts):
    padded = np.arange(len(counts) * width, dtype=np.int64).reshape(len(counts), width) - 3
    values, offsets, k = impl.sampled_rows(padded, np.array(counts, np.int32))
    want_values, want_offsets = ref_sampled(padded, counts)
    assert np.frombuffer(values, "<i8").tolist() == want_values
    kept = [min(c, width) for c in counts]
    if len(set(kept)) == 1:
        assert (offsets, k) == (None, kept[0])
    else:
        assert (i32(offsets), k) == (want_offsets, -1)


@pytest.mark.parametrize(
    "damage",
    [
        "int32_ids",
        "uint64_ids",
        "int64_counts",
        "uint32_counts",
        "1d_ids",
        "3d_ids",
        "2d_counts",
        "strided_ids",
        "rows_mismatch",
        "no_rows",
        "negative_count",
        "list_ids",
        "list_counts",
        "float_counts",
    ],
)
def test_sampled_rows_refuses(damage):
    padded = np.arange(6, dtype=np.int64).reshape(3, 2)
    counts = np.array([1, 2, 1], np.int32)
    args: list[Any] = [padded, counts]
    if damage == "int32_ids":
        args[0] = padded.astype(np.int32)
    elif damage == "uint64_ids":
        args[0] = padded.astype(np.uint64)
    elif damage == "int64_counts":
        args[1] = counts.astype(np.int64)
    elif damage == "uint32_counts":
        args[1] = counts.astype(np.uint32)
    elif damage == "1d_ids":
        args[0] = padded.reshape(-1)
    elif damage == "3d_ids":
        args[0] = padded.reshape(3, 2, 1)
    elif damage == "2d_counts":
        args[1] = counts.reshape(3, 1)
    elif damage == "strided_ids":
        args[0] = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]
    elif damage == "rows_mismatch":
        args[1] = counts[:2]
    elif damage == "no_rows":
        args = [padded[:0], counts[:0]]
    elif damage == "negative_count":
        args[1] = np.array([1, -1, 1], np.int32)
    elif damage == "list_ids":
        args[0] = padded.tolist()
    elif damage == "list_counts":
        args[1] = counts.tolist()
    elif damage == "float_counts":
        args[1] = counts.astype(np.float32)
    assert agree("sampled_rows", *args) is None


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(0, 5),
    st.lists(st.integers(-2, 8), min_size=1, max_size=6),
)
def test_sampled_rows_implementations_agree(rows, width, raw_counts):
    counts = (raw_counts * rows)[:rows]
    padded = np.arange(rows * width, dtype=np.int64).reshape(rows, width) * -7
    got = agree("sampled_rows", padded, np.array(counts, np.int32))
    if min(counts) < 0:
        assert got is None
    else:
        values, offsets, k = got
        want_values, want_offsets = ref_sampled(padded, counts)
        assert np.frombuffer(values, "<i8").tolist() == want_values
        uniform = [k * i for i in range(rows + 1)]
        assert want_offsets == (uniform if offsets is None else i32(offsets))


# ----------------------------------------------------------------------------- int32_head


@pytest.mark.parametrize("n", [0, 1, 3, 4])
def test_int32_head_copies_the_first_items(impl, n):
    values = np.array([7, -1, 2**31 - 1, -(2**31)], np.int32)
    got = impl.int32_head(values, n)
    assert type(got) is bytearray
    assert i32(bytes(got)) == values[:n].tolist()
    got[: 4 * n] = b"\xff" * (4 * n)  # a copy: writing it leaves the source as it was
    assert values.tolist() == [7, -1, 2**31 - 1, -(2**31)]


@pytest.mark.parametrize(
    ("values", "n"),
    [
        (np.array([1, 2], np.int32), 3),  # fewer items than asked for
        (np.array([1, 2], np.int64), 1),
        (np.array([1, 2], np.uint32), 1),
        (np.array([1.0, 2.0], np.float32), 1),
        (np.array([[1, 2]], np.int32), 1),
        (np.arange(4, dtype=np.int32)[::2], 1),  # strided
        ([1, 2], 1),
        (np.array([1, 2], np.int32), -1),
        (np.array([1, 2], np.int32), True),
        (np.array([1, 2], np.int32), 1.0),
        (np.array([1, 2], np.int32), IntSub(1)),
    ],
)
def test_int32_head_refuses(values, n):
    assert agree("int32_head", values, n) is None


# ----------------------------------------------------------------------------- offsets_ok


def ref_offsets_ok(values: np.ndarray, last: int) -> bool:
    """The numpy reading of check_offsets' rules (1-D, at least one item, 0 .. last, never
    decreasing), for arrays of the kinds offsets_ok reads."""
    a = np.asarray(values)
    return bool(a.ndim == 1 and len(a) and a[0] == 0 and a[-1] == last and (a[1:] >= a[:-1]).all())


@pytest.mark.parametrize("dtype", [np.int64, np.int32, "<i8", "=i4", np.longlong])
@pytest.mark.parametrize(
    ("values", "last"),
    [([0], 0), ([0, 0, 0], 0), ([0, 2, 2, 5], 5), ([0, 1, 2**31 - 1], 2**31 - 1)],
)
def test_offsets_ok_accepts_valid_offsets(impl, values, last, dtype):
    assert impl.offsets_ok(np.array(values, dtype), last) is True


def test_offsets_ok_int64_extremes(impl):
    assert impl.offsets_ok(np.array([0, 2**63 - 1], np.int64), 2**63 - 1) is True
    assert impl.offsets_ok(np.array([0, 2**62, 2**63 - 1], np.int64), 2**63 - 1) is True


@pytest.mark.parametrize(
    ("values", "last"),
    [
        (np.array([0, 3, 2, 5]), 5),  # decreases
        (np.array([0, 2, 5, 4]), 4),  # decreases at the end, which is `last`
        (np.array([1, 2, 5]), 5),  # does not start at 0
        (np.array([-1, 0, 5]), 5),
        (np.array([0, 2, 5]), 4),  # ends elsewhere
        (np.array([0, 2, 5]), 6),
        (np.array([0, 2, 5], np.int32), 4),
        (np.array([0, 5, 2], np.int32), 2),
        (np.array([], np.int64), 0),  # no offsets at all
        (np.array([], np.int32), 0),
        (np.array([[0, 1]]), 1),  # 2-D
        (np.arange(6)[::2], 4),  # strided
        (np.array([0, 1], np.uint64), 1),  # unsigned
        (np.array([0, 1], np.uint32), 1),
        (np.array([0, 1], np.int16), 1),  # other widths
        (np.array([0, 1], np.int8), 1),
        (np.array([0.0, 1.0]), 1),  # floats
        (np.array([0, 1], ">i8"), 1),  # non-native byte order
        (np.array([0, 1]).tobytes(), 1),  # raw bytes (format B)
        ([0, 1], 1),  # not a buffer
        (None, 0),
        (np.array([0, 1]), True),  # last: exact ints only
        (np.array([0, 1]), 1.0),
        (np.array([0, 1]), IntSub(1)),
        (np.array([0, 1]), None),
        (np.array([0, 1]), 2**63),  # past int64: never an offset
        (np.array([0, 1]), -(2**63) - 1),
    ],
)
def test_offsets_ok_refuses(values, last):
    assert agree("offsets_ok", values, last) is False


def test_offsets_ok_reads_last_before_values():
    # A released memoryview raises ValueError when its buffer is asked for: an exporter's
    # error propagates, but a last that cannot be an offset is refused before that.
    gone = memoryview(np.array([0, 1]))
    gone.release()
    with pytest.raises(ValueError, match="alike"):
        agree("offsets_ok", gone, 1)
    assert agree("offsets_ok", gone, 2**63) is False
    assert agree("offsets_ok", gone, "1") is False


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.integers(-3, 6), min_size=0, max_size=8),
    last=st.integers(-2, 30),
    sort=st.booleans(),
    dtype=st.sampled_from([np.int64, np.int32]),
)
def test_offsets_ok_property(values, last, sort, dtype):
    if sort:  # mostly valid offsets: non-negative steps from 0
        values = [0, *itertools.accumulate(abs(v) for v in values)]
    arr = np.array(values, dtype)
    got = agree("offsets_ok", arr, last)
    assert got is ref_offsets_ok(arr, last)
    if sort:
        assert agree("offsets_ok", arr, values[-1]) is True


# ------------------------------------------------------------------ message_custom_metadata


def _message_flatbuffer(custom: dict[bytes, bytes] | None) -> bytes:
    """The flatbuffer of a record-batch message pyarrow wrote with ``custom``."""
    batch = pa.record_batch([pa.array([1, 2])], names=["x"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch, custom_metadata=custom)
    reader = pa.BufferReader(sink.getvalue())
    pa.ipc.read_message(reader)  # the schema message
    return pa.ipc.read_message(reader).metadata.to_pybytes()


CUSTOMS = [
    None,
    {b"arrow_outputs.step": b'{"step":1,"rows":2}'},
    {b"": b"", b"k": b"v" * 3000, b"\x00\xff": b"\x80"},
    {f"key{i}".encode(): bytes([i]) * i for i in range(40)},
]


@pytest.mark.parametrize("custom", CUSTOMS)
def test_message_custom_metadata_reads_what_pyarrow_wrote(impl, custom):
    meta = _message_flatbuffer(custom)
    want = list((custom or {}).items())
    assert impl.message_custom_metadata(meta) == want
    assert impl.message_custom_metadata(pa.py_buffer(meta)) == want  # any buffer
    assert impl.message_custom_metadata(np.frombuffer(meta, np.uint8)) == want


@pytest.mark.parametrize(
    "meta",
    [
        b"",
        b"\x00",
        b"\xff\xff\xff\x7f\x00\x00\x00\x00",  # a table past the end
        b"\x04\x00\x00\x00\x08\x00\x00\x00",  # a vtable before the start
        "not a buffer",
        None,
        np.zeros(16, np.uint8)[::2],  # not C-contiguous
    ],
)
def test_message_custom_metadata_refuses(meta):
    assert agree("message_custom_metadata", meta) is None


def test_message_custom_metadata_every_truncation_agrees():
    meta = _message_flatbuffer(CUSTOMS[2])
    for cut in range(len(meta)):
        got = agree("message_custom_metadata", meta[:cut])
        assert got is None or all(type(k) is bytes and type(v) is bytes for k, v in got)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(range(1, len(CUSTOMS))),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
)
def test_message_custom_metadata_mutations_agree(which, edits):
    """Bytes of a real message with a few changed: both give the same pairs, or both None;
    nothing read outside the bytes (each key and value is a run of them: a changed offset may
    point two entries at the same string, so their lengths need not add up to less)."""
    meta = bytearray(_message_flatbuffer(CUSTOMS[which]))
    for at, value in edits:
        meta[at % len(meta)] = value
    got = agree("message_custom_metadata", bytes(meta))
    if got is not None:
        for k, v in got:
            assert k in meta
            assert v in meta
