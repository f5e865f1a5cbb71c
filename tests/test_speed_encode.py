"""The encode's fast paths for what vLLM hands over every step: host ``LogprobsLists`` and
``SamplingMaskLists`` of numpy arrays as nodes for the C assembly without their full checks
(``logprobs._host_lists_node``, ``masks._host_masks_node``), absent fields that skip their
encoders (``batch._ENCODERS``), and the whole everyday step's columns without the column
loop (``batch._everyday``).

A fast path must give exactly what the full path gives (the same node over the same buffers,
the very same layout object, so the step JSON tail is reused), and give up (None) on anything
else before refusing it, so that the full path raises its precise error. Each test compares
the two, with the fast path switched off for the second.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from conftest import codec_on, decode_step
from test_batch import CASES

import arrow_outputs as ao
from arrow_outputs import _accel, batch, logprobs, masks
from arrow_outputs.errors import ArrowOutputsError
from arrow_outputs.outputs import LogprobsLists, ModelRunnerOutput, SamplingMaskLists

pytestmark = pytest.mark.skipif(not _accel.AVAILABLE, reason="the C accelerator is not built")


@pytest.fixture(autouse=True)
def _c_path():
    with codec_on("c"):
        yield


def _plain(node: Any) -> Any:
    """A node with each buffer as its bytes (the ``copies_nothing`` tests hold the source
    arrays' buffers to be the arrays themselves)."""
    if node is None:
        return None
    length, nulls, buffers, children = node
    held = tuple(
        None if b is None else b.tobytes() if isinstance(b, np.ndarray) else bytes(b)
        for b in buffers
    )
    return (length, nulls, held, tuple(_plain(c) for c in children))


def _outcome(call: Any) -> Any:
    try:
        node, layout = call()
    except ArrowOutputsError as e:
        return ("raised", type(e), str(e))
    return ("ok", _plain(node), id(layout))


def _lists(n: int = 3, width: int = 21, dt: Any = np.int64, cu: Any = None, **kw: Any) -> Any:
    rng = np.random.default_rng(n * 100 + width)
    pos = n if cu is None else cu[-1]
    fields = {
        "logprob_token_ids": rng.integers(0, 128_000, (pos, width)).astype(dt),
        "logprobs": rng.random((pos, width), dtype=np.float32),
        "sampled_token_ranks": rng.integers(1, 50, pos).astype(dt),
        "cu_num_generated_tokens": cu,
    }
    fields.update(kw)
    return LogprobsLists(**fields)


def _encode_lp(x: Any, id_type: str, rank_type: str, rows: int | None) -> Any:
    return logprobs.encode_logprobs(
        x, "logprobs", id_type=id_type, rank_type=rank_type, num_rows=rows, as_node=True
    )


def _full_lp(monkeypatch: Any, *args: Any) -> Any:
    with monkeypatch.context() as m:
        m.setattr(logprobs, "_host_lists_node", lambda *a: None)
        return _outcome(lambda: _encode_lp(*args))


@pytest.mark.parametrize(
    ("x", "types", "rows"),
    [
        (_lists(), ("int64", "int64"), 3),
        (_lists(1, 1), ("int64", "int64"), 1),
        (_lists(5, 21, np.int32), ("int32", "int32"), 5),
        (_lists(0), ("int64", "int64"), 0),
        (_lists(cu=[0, 2, 2, 5]), ("int64", "int64"), 3),  # spec decode: 0-2 tokens a row
        (_lists(cu=[0, 2, 2, 5]), ("int64", "int64"), None),
        (_lists(cu=(0, 2, 2, 5)), ("int64", "int64"), 3),  # a tuple: the full path's
    ],
)
def test_host_lists_node_is_the_full_paths_node(monkeypatch, x, types, rows) -> None:
    fast = _outcome(lambda: _encode_lp(x, *types, rows))
    assert fast[0] == "ok"
    assert fast == _full_lp(monkeypatch, x, *types, rows)  # same buffers, same layout object
    # Called twice (the second from what the first proved): the same again.
    assert _outcome(lambda: _encode_lp(x, *types, rows)) == fast


def _strided(a: np.ndarray) -> np.ndarray:
    wide = np.repeat(a, 2, axis=-1)
    return wide[..., ::2]  # the same values and shape, not C-contiguous


class _SubArray(np.ndarray):
    pass


GOOD = _lists()
I64 = ("int64", "int64")


def _good(**fields: Any) -> Any:
    return GOOD._replace(**fields)


@pytest.mark.parametrize(
    ("x", "types", "rows"),
    [
        (_lists(dt=np.int32), ("int64", "int64"), 3),  # not the run's types
        (_lists(), ("int32", "int64"), 3),
        (_lists(), ("int64", "int32"), 3),
        (_lists(), ("int64", "int64"), 4),  # rows disagree
        (_lists(cu=[0, 2, 2, 5]), ("int64", "int64"), 4),
        (_lists(cu=[0, 3, 2, 5]), ("int64", "int64"), 3),  # offsets decrease
        (_lists(cu=[0, 2, 2, 5])._replace(cu_num_generated_tokens=[0, 2, 2, 4]), I64, 3),
        (_lists(cu=[0, 2, 2, 5])._replace(cu_num_generated_tokens=[0, 2, True, 5]), I64, 3),
        (_good(cu_num_generated_tokens=np.array([0, 1, 2, 3])), I64, 3),
        (_good(logprob_token_ids=_strided(GOOD.logprob_token_ids)), I64, 3),
        (_good(logprobs=_strided(GOOD.logprobs)), I64, 3),
        (_good(sampled_token_ranks=GOOD.sampled_token_ranks[::-1]), I64, 3),
        (_good(logprobs=GOOD.logprobs.astype(np.float64)), I64, 3),
        (_good(logprobs=GOOD.logprobs[:, :20]), I64, 3),
        (_good(sampled_token_ranks=GOOD.sampled_token_ranks[:2]), I64, 3),
        (_good(logprob_token_ids=GOOD.logprob_token_ids.astype(">i8")), I64, 3),
        (_good(logprob_token_ids=GOOD.logprob_token_ids.view(_SubArray)), I64, 3),
        (_good(logprob_token_ids=GOOD.logprob_token_ids.tolist()), I64, 3),
        (_good(logprob_token_ids=GOOD.logprob_token_ids[0]), I64, 3),
        (_good(sampled_token_ranks=None), I64, 3),
        (None, I64, 3),
    ],
)
def test_host_lists_node_gives_up_on_everything_else(monkeypatch, x, types, rows) -> None:
    _encode_lp(GOOD, "int64", "int64", 3)  # what it proved of GOOD's shape must not carry over
    assert logprobs._host_lists_node(x, *types, rows) is None
    assert _outcome(lambda: _encode_lp(x, *types, rows)) == _full_lp(monkeypatch, x, *types, rows)


def test_host_lists_node_copies_nothing() -> None:
    x = _lists(4)
    node, _ = _encode_lp(x, "int64", "int64", 4)
    struct = node[3][0]
    ids, lps, ranks = struct[3][0][3][0][2][1], struct[3][1][3][0][2][1], struct[3][2][2][1]
    assert ids is x.logprob_token_ids
    assert lps is x.logprobs
    assert ranks is x.sampled_token_ranks


# ----------------------------------------------------------------------------- masks


def _masks(offsets: Any = "csr", cu: Any = None, ids: Any = None) -> SamplingMaskLists:
    token_ids = np.array([3, 9, 4, 5, 7], np.int32) if ids is None else ids
    if isinstance(offsets, str):
        offsets = np.array([0, 2, 2, 5], np.int64) if cu is not None else np.array([0, 2, 5])
    return SamplingMaskLists(token_ids, offsets, cu)


def _encode_masks(m: Any, rows: int | None) -> Any:
    return masks.encode_sampling_masks(m, "sampling_masks", num_rows=rows, as_node=True)


def _full_masks(monkeypatch: Any, m: Any, rows: int | None) -> Any:
    with monkeypatch.context() as p:
        p.setattr(masks, "_host_masks_node", lambda *a: None)
        return _outcome(lambda: _encode_masks(m, rows))


@pytest.mark.parametrize(
    ("m", "rows"),
    [
        (_masks(), 2),
        (_masks(cu=[0, 1, 3]), 2),
        (_masks(offsets=None), 1),
        (_masks(offsets=None, cu=[0, 1]), 1),
        (_masks(cu=[0, 1, 3]), None),
        (_masks(ids=np.zeros(0, np.int32), offsets=np.zeros(1, np.int64)), 0),
    ],
)
def test_host_masks_node_is_the_full_paths_node(monkeypatch, m, rows) -> None:
    fast = _outcome(lambda: _encode_masks(m, rows))
    assert fast[0] == "ok"
    assert fast == _full_masks(monkeypatch, m, rows)


@pytest.mark.parametrize(
    ("m", "rows"),
    [
        (_masks(), 3),  # rows disagree
        (_masks(cu=[0, 1, 3]), 3),
        (_masks(offsets=np.array([0, 3, 2], np.int64)), 2),  # decreasing CSR offsets
        (_masks(offsets=np.array([0, 2, 4], np.int64)), 2),  # ends short of the ids
        (_masks(offsets=np.array([0, 2, 5], np.int32)), 2),  # int32 offsets: refused
        (_masks(offsets=np.array([0, 2, 5], ">i8")), 2),
        (_masks(offsets=np.array([0, 0, 2, 2, 5, 5], np.int64)[::2]), 2),
        (_masks(offsets=[0, 2, 5]), 2),
        (_masks(cu=[0, 2, 1]), 2),
        (_masks(cu=np.array([0, 1, 3])), 2),
        (_masks(ids=np.array([3, 9, 4, 5, 7], np.int64)), 2),
        (_masks(ids=np.array([3, 9, 4, 5, 7], ">i4")), 2),
        (_masks(ids=np.array([3, 3, 9, 9, 4, 4, 5, 5, 7, 7], np.int32)[::2]), 2),
        (_masks(ids=np.array([[3, 9, 4, 5, 7]], np.int32)), 2),
        (_masks(ids=[3, 9, 4, 5, 7]), 2),
        (_masks(ids=np.array([3, 9, 4, 5, 7], np.int32).view(_SubArray)), 2),
        ("not masks", 2),
    ],
)
def test_host_masks_node_gives_up_on_everything_else(monkeypatch, m, rows) -> None:
    assert masks._host_masks_node(m, rows) is None
    assert _outcome(lambda: _encode_masks(m, rows)) == _full_masks(monkeypatch, m, rows)


def test_host_masks_node_copies_nothing() -> None:
    m = _masks(cu=[0, 1, 3])
    node, _ = _encode_masks(m, 2)
    inner = node[3][0]
    assert inner[2][1] is m.offsets
    assert inner[3][0][2][1] is m.token_ids


# ----------------------------------------------------------------------------- absent fields


@dataclasses.dataclass
class _Output:
    """A ModelRunnerOutput look-alike whose fields may hold anything."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: Any = None
    prompt_logprobs_dict: Any = dataclasses.field(default_factory=dict)
    prompt_token_id_logprobs_dict: Any = dataclasses.field(default_factory=dict)
    pooler_output: Any = None
    num_nans_in_logits: Any = None
    sampling_masks: Any = None
    aux_output_connector_output: Any = None


class _DictSub(dict):
    pass


class _Falsy:
    def __bool__(self) -> bool:
        return False


def _result(output: Any) -> Any:
    try:
        b = ao.to_record_batch(output, step=1)
    except ArrowOutputsError as e:
        return ("raised", type(e), str(e))
    return ("ok", b.to_pylist(), ao.step_metadata(b))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt_logprobs_dict", _DictSub()),  # empty: absent, through its encoder
        ("prompt_logprobs_dict", []),  # falsy, not a dict: refused by the encoder
        ("prompt_logprobs_dict", None),
        ("prompt_token_id_logprobs_dict", _Falsy()),
        ("prompt_token_id_logprobs_dict", {}),
        ("pooler_output", []),  # not None: the encoder says what is wrong
        ("pooler_output", _Falsy()),
        ("num_nans_in_logits", {}),  # an empty dict is not None: no NaN counts, but a column
        ("num_nans_in_logits", 0),
        ("sampling_masks", False),
        ("aux_output_connector_output", {}),
        ("aux_output_connector_output", None),
    ],
)
def test_absent_fields_skip_only_what_their_encoder_would_make_nulls(
    monkeypatch, field: str, value: Any
) -> None:
    out = _Output(["a"], {"a": 0}, [[5]], **{field: value})
    got = _result(out)
    with monkeypatch.context() as m:
        # Every field through its encoder: what encode_step did before the skips.
        m.setattr(batch, "_everyday", lambda *a: None)
        m.setattr(
            batch,
            "_ENCODERS",
            tuple((*e[:3], batch._NEVER_ABSENT, e[4]) for e in batch._ENCODERS),
        )
        assert _result(out) == got


def test_absent_fields_of_an_older_vllm_object_take_their_defaults() -> None:
    @dataclasses.dataclass
    class Older:  # an older vLLM's output: no sampling_masks, no aux output, no prompt dicts
        req_ids: list[str]
        req_id_to_index: dict[str, int]
        sampled_token_ids: list[list[int]]
        logprobs: Any = None
        pooler_output: Any = None

    got = ao.from_record_batch(ao.to_record_batch(Older(["a"], {"a": 0}, [[5]]), step=0))
    assert got == ModelRunnerOutput(["a"], {"a": 0}, [[5]])


# ----------------------------------------------------------------------------- everyday step


def _batch_or_error(out: Any) -> Any:
    try:
        b = ao.to_record_batch(out, step=7)
    except ArrowOutputsError as e:
        return ("raised", type(e), str(e))
    return ("ok", b.schema.metadata, b.to_pylist())


def _everyday_step() -> ModelRunnerOutput:
    return decode_step(3, 4)  # logprobs with cu lists, NaN counts for one request, masks


def _plain_decode_step() -> ModelRunnerOutput:
    out = decode_step(3, 4)
    out.num_nans_in_logits = None
    return out


def _older_object() -> Any:
    out = _plain_decode_step()
    return _Output(
        out.req_ids, out.req_id_to_index, out.sampled_token_ids, out.logprobs,
        sampling_masks=out.sampling_masks,
    )  # fmt: skip


def _pooling_step() -> ModelRunnerOutput:
    out = _plain_decode_step()
    out.sampled_token_ids = []
    return out


def _bad_mask_step() -> ModelRunnerOutput:
    out = _plain_decode_step()
    out.sampling_masks = out.sampling_masks._replace(offsets=out.sampling_masks.offsets[::-1])
    return out


def _bad_logprobs_step() -> ModelRunnerOutput:
    out = _plain_decode_step()
    assert out.logprobs is not None
    out.logprobs = out.logprobs._replace(cu_num_generated_tokens=[0, 1])
    return out


def _bad_sampled_step() -> ModelRunnerOutput:
    out = _plain_decode_step()
    out.sampled_token_ids[1] = [True]
    return out


EVERYDAY = [
    _plain_decode_step,
    _everyday_step,
    _older_object,
    _pooling_step,
    _bad_mask_step,
    _bad_logprobs_step,
    _bad_sampled_step,
    *CASES,
]


@pytest.mark.parametrize("make", EVERYDAY, ids=lambda f: f.__name__.lstrip("_"))
def test_everyday_columns_are_the_column_loops(monkeypatch, make) -> None:
    out = make()
    got = _batch_or_error(out)
    with monkeypatch.context() as m:
        m.setattr(batch, "_everyday", lambda *a: None)
        assert _batch_or_error(out) == got


@pytest.mark.parametrize(
    ("make", "taken"),
    [(_plain_decode_step, True), (_older_object, True), (_everyday_step, False)],
    ids=["decode-step", "older-object", "nan-counts"],
)
def test_everyday_columns_take_vllms_everyday_step(monkeypatch, make, taken: bool) -> None:
    calls: list[Any] = []
    real = batch._everyday

    def spy(*args: Any) -> Any:
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(batch, "_everyday", spy)
    ao.to_record_batch(make(), step=1)
    assert len(calls) == 1
    assert (calls[0] is not None) == taken
