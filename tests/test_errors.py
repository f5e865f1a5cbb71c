"""The error contract: every bad input raises a specific ``ArrowOutputsError`` subclass.

Each case names the exact class, the field path (``.field``) and fragments of what was
expected (``.expected``) and what came (``.got``); the message is always
``"FIELD: expected X, got Y"``. A case whose behaviour breaks the contract
can be marked ``bug="..."``: it then runs as ``xfail(strict=True)`` until fixed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

import arrow_outputs as ao
from arrow_outputs import (
    ArrowOutputsError,
    ColumnTypes,
    ConsistencyError,
    DTypeError,
    FieldTypeError,
    FormatVersionError,
    KVConnectorOutput,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
    OffsetsError,
    SamplingMaskLists,
    SchemaMismatchError,
    ShapeError,
    UnsupportedValueError,
)

# Every test here runs on the C accelerator and on the pure-Python path.
pytestmark = pytest.mark.usefixtures("codec_path")

# ----------------------------------------------------------------------------- builders


def _out(**kw: Any) -> ModelRunnerOutput:
    """Two requests, ``a`` with one sampled token and ``b`` with two."""
    fields: dict[str, Any] = {
        "req_ids": ["a", "b"],
        "req_id_to_index": {"a": 0, "b": 1},
        "sampled_token_ids": [[1], [2, 3]],
    }
    fields.update(kw)
    return ModelRunnerOutput(**fields)


def _lists(
    ids: Any = np.int64,
    lps: Any = np.float32,
    ranks: Any = np.int64,
    *,
    ids_shape: tuple[int, ...] = (3, 2),
    lps_shape: tuple[int, ...] = (3, 2),
    num_ranks: int = 3,
    cu: Any = (0, 1, 3),
) -> LogprobsLists:
    """numpy logprobs: 3 positions of width 2, split 1 + 2 over two requests."""
    return LogprobsLists(
        np.arange(np.prod(ids_shape)).astype(ids).reshape(ids_shape),
        np.full(lps_shape, -1.0, dtype=lps),
        np.ones(num_ranks, dtype=ranks),
        list(cu) if isinstance(cu, tuple) else cu,
    )


def _tensors(
    ids: torch.dtype = torch.int64,
    lps: torch.dtype = torch.float32,
    ranks: torch.dtype = torch.int64,
    *,
    device: str = "cpu",
    cu: list[int] | None = None,
) -> LogprobsTensors:
    """torch logprobs: 3 positions of width 2."""
    return LogprobsTensors(
        torch.zeros((3, 2), dtype=ids, device=device),
        torch.zeros((3, 2), dtype=lps, device=device),
        torch.ones(3, dtype=ranks, device=device),
        cu,
    )


def _masks(
    token_ids: Any = np.int32,
    offsets: Any = np.int64,
    *,
    tv: tuple[int, ...] = (4, 5, 6),
    ov: tuple[int, ...] | None = (0, 1, 3),
    cu: Any = None,
) -> SamplingMaskLists:
    """CSR masks: 2 positions ([4] and [5, 6]) by default."""
    return SamplingMaskLists(
        np.array(tv, dtype=token_ids),
        None if ov is None else np.array(ov, dtype=offsets),
        cu,
    )


def _batch() -> pa.RecordBatch:
    """A valid batch with sampled ids, logprobs and sampling masks."""
    return ao.to_record_batch(_out(logprobs=_lists(), sampling_masks=_masks(cu=[0, 1, 2])), step=0)


def _with_version(version: bytes) -> pa.RecordBatch:
    b = _batch()
    meta = dict(b.schema.metadata)
    meta[b"arrow_outputs.version"] = version
    return b.replace_schema_metadata(meta)


def _with_column(name: str, arr: pa.Array) -> pa.RecordBatch:
    """The batch with one column replaced (its field retyped), schema metadata kept."""
    b = _batch()
    i = b.schema.get_field_index(name)
    cols = b.columns
    cols[i] = arr
    schema = b.schema.set(i, pa.field(name, arr.type)).with_metadata(b.schema.metadata)
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def _without_column(name: str) -> pa.RecordBatch:
    b = _batch()
    keep = [i for i, field in enumerate(b.schema) if field.name != name]
    schema = pa.schema([b.schema.field(i) for i in keep], metadata=b.schema.metadata)
    return pa.RecordBatch.from_arrays([b.column(i) for i in keep], schema=schema)


def _corrupt_offsets(name: str, offsets: list[int]) -> pa.RecordBatch:
    """The batch with a list column's offsets made non-monotonic.

    The first and last offsets stay in bounds, so the cheap ``validate()`` passes and only
    ``validate(full=True)`` notices.
    """
    b = _batch()
    i = b.schema.get_field_index(name)
    col = b.column(i)
    bad = pa.Array.from_buffers(
        col.type,
        len(col),
        [None, pa.py_buffer(np.array(offsets, dtype=np.int32))],
        children=[col.values],
    )
    cols = b.columns
    cols[i] = bad
    out = pa.RecordBatch.from_arrays(cols, schema=b.schema)
    out.validate()  # cheap validation passes: the corruption is only visible in full
    with pytest.raises(pa.ArrowInvalid):
        out.validate(full=True)
    return out


def _corrupt_list(arr: pa.Array, offsets: list[int]) -> pa.Array:
    """``arr`` (a list array) with its outer offsets replaced."""
    return pa.Array.from_buffers(
        arr.type,
        len(offsets) - 1,
        [None, pa.py_buffer(np.array(offsets, dtype=np.int32))],
        children=[arr.values],
    )


def _corrupt_inner_masks() -> pa.Array:
    """A masks array whose inner (CSR, int64) offsets decrease."""
    arr = ao.sampling_masks_to_arrow(_masks(cu=[0, 1, 2]))
    inner = arr.values
    bad_inner = pa.Array.from_buffers(
        inner.type,
        len(inner),
        [None, pa.py_buffer(np.array([0, 3, 1], dtype=np.int64))],
        children=[inner.values],
    )
    return pa.Array.from_buffers(arr.type, len(arr), [None, arr.buffers()[1]], children=[bad_inner])


def _meta(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor that is not on the host (stands in for a CUDA tensor on a CPU machine)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def _pooler_schema() -> pa.Schema:
    """A run whose first step fixed the pooler rows at shape (4,)."""
    return ao.infer_schema(_out(pooler_output=[torch.zeros(4), torch.ones(4)]))


# ----------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    call: Callable[[], Any]
    exc: type[ArrowOutputsError]
    field: str
    expected: str
    got: str | tuple[str, ...]


def case(
    case_id: str,
    call: Callable[[], Any],
    exc: type[ArrowOutputsError],
    field: str,
    expected: str,
    got: str | tuple[str, ...],
    *,
    bug: str | None = None,
) -> Any:
    marks = () if bug is None else (pytest.mark.xfail(strict=True, reason=f"bug: {bug}"),)
    return pytest.param(Case(call, exc, field, expected, got), id=case_id, marks=marks)


def _check(c: Case) -> ArrowOutputsError:
    with pytest.raises(c.exc) as info:
        c.call()
    err = info.value
    assert type(err) is c.exc
    assert isinstance(err, ArrowOutputsError)
    assert err.field == c.field
    assert str(err) == f"{err.field}: expected {err.expected}, got {err.got}"
    assert c.expected in err.expected
    for fragment in (c.got,) if isinstance(c.got, str) else c.got:
        assert fragment in err.got, (fragment, err.got)
    return err


TO_RECORD_BATCH = [
    # not a ModelRunnerOutput at all
    case(
        "int-as-output",
        lambda: ao.to_record_batch(3),
        FieldTypeError,
        "output",
        "ModelRunnerOutput",
        "int 3",
    ),
    case(
        "str-as-logprobs",
        lambda: ao.to_record_batch(_out(logprobs="lp")),
        FieldTypeError,
        "logprobs",
        "LogprobsLists or LogprobsTensors",
        "str 'lp'",
    ),
    case(
        "str-as-sampling-masks",
        lambda: ao.to_record_batch(_out(sampling_masks="m")),
        FieldTypeError,
        "sampling_masks",
        "SamplingMaskLists",
        "str 'm'",
    ),
    case(
        "list-as-aux-output",
        lambda: ao.to_record_batch(_out(aux_output_connector_output=[1])),
        FieldTypeError,
        "aux_output_connector_output",
        "mapping of request id",
        "list [1]",
    ),
    case(
        "float-step",
        lambda: ao.to_record_batch(_out(), step=1.0),
        FieldTypeError,
        "step",
        "an int (or numpy integer) or None",
        "float 1.0",
    ),
    # req_ids / req_id_to_index
    case(
        "req-id-to-index-missing-key",
        lambda: ao.to_record_batch(_out(req_id_to_index={"a": 0})),
        ConsistencyError,
        "req_id_to_index",
        "2 entries",
        "1 entries",
    ),
    case(
        "req-id-to-index-wrong-key",
        lambda: ao.to_record_batch(_out(req_id_to_index={"a": 0, "c": 1})),
        ConsistencyError,
        "req_id_to_index['b']",
        "1 (its position in req_ids)",
        "None",
    ),
    case(
        "req-id-to-index-wrong-index",
        lambda: ao.to_record_batch(_out(req_id_to_index={"a": 0, "b": 2})),
        ConsistencyError,
        "req_id_to_index['b']",
        "1 (its position",
        "2",
    ),
    case(
        "req-id-to-index-extra-key",
        lambda: ao.to_record_batch(_out(req_id_to_index={"a": 0, "b": 1, "c": 2})),
        ConsistencyError,
        "req_id_to_index",
        "2 entries",
        "3 entries",
    ),
    case(
        "req-ids-duplicate-with-extra-index-key",
        lambda: ao.to_record_batch(_out(req_ids=["a", "a"], req_id_to_index={"a": 0, "b": 1})),
        ConsistencyError,
        "req_ids",
        "unique request ids",
        "'a' twice",
    ),
    case(
        "req-ids-duplicate",
        # the dict vLLM would build for these ids: {rid: i for i, rid in enumerate(req_ids)}
        lambda: ao.to_record_batch(_out(req_ids=["a", "a"], req_id_to_index={"a": 1})),
        ConsistencyError,
        "req_ids",
        "unique request ids",
        "'a' twice",
    ),
    case(
        "req-ids-non-str",
        lambda: ao.to_record_batch(_out(req_ids=["a", 7], req_id_to_index={"a": 0, 7: 1})),
        FieldTypeError,
        "req_ids[1]",
        "a str",
        "int 7",
    ),
    case(
        "req-ids-tuple",
        lambda: ao.to_record_batch(_out(req_ids=("a", "b"))),
        FieldTypeError,
        "req_ids",
        "a list of str",
        "tuple",
    ),
    # sampled_token_ids
    case(
        "sampled-wrong-length",
        lambda: ao.to_record_batch(_out(sampled_token_ids=[[1]])),
        ShapeError,
        "sampled_token_ids",
        "2 lists (one per request)",
        "1",
    ),
    case(
        "sampled-float",
        lambda: ao.to_record_batch(_out(sampled_token_ids=[[1], [2.5]])),
        FieldTypeError,
        "sampled_token_ids[1]",
        "a list of int",
        "[2.5]",
    ),
    case(
        "sampled-bool",
        lambda: ao.to_record_batch(_out(sampled_token_ids=[[True], [2]])),
        FieldTypeError,
        "sampled_token_ids[0]",
        "a list of int",
        "[True]",
    ),
    case(
        "sampled-non-list-element",
        lambda: ao.to_record_batch(_out(sampled_token_ids=[[1], 5])),
        FieldTypeError,
        "sampled_token_ids[1]",
        "a list of int",
        "int 5",
    ),
    case(
        "sampled-tuple-element",
        lambda: ao.to_record_batch(_out(sampled_token_ids=[[1], (2, 3)])),
        FieldTypeError,
        "sampled_token_ids[1]",
        "a list of int",
        "tuple (2, 3)",
    ),
    case(
        "sampled-tensor",
        lambda: ao.to_record_batch(_out(sampled_token_ids=torch.zeros((2, 1), dtype=torch.int64))),
        FieldTypeError,
        "sampled_token_ids",
        "a list of lists of int",
        "torch int64 tensor",
    ),
    case(
        "sampled-above-int32-schema",
        lambda: ao.to_record_batch(
            _out(sampled_token_ids=[[1], [2**31]]),
            schema=ao.output_schema(ColumnTypes(sampled_token_ids="int32")),
        ),
        UnsupportedValueError,
        "sampled_token_ids",
        "within int32",
        str(2**31),
    ),
    case(
        "sampled-below-int32-schema",
        lambda: ao.to_record_batch(
            _out(sampled_token_ids=[[-(2**31) - 1], [2]]),
            schema=ao.output_schema(ColumnTypes(sampled_token_ids="int32")),
        ),
        UnsupportedValueError,
        "sampled_token_ids",
        "within int32",
        str(-(2**31) - 1),
    ),
    # logprobs against the step and the run
    case(
        "logprobs-cu-wrong-request-count",
        lambda: ao.to_record_batch(_out(logprobs=_lists(cu=[0, 3]))),
        ShapeError,
        "logprobs.cu_num_generated_tokens",
        "3 offsets (one per request, plus one)",
        "2 offsets",
    ),
    case(
        "logprobs-no-cu-wrong-position-count",
        lambda: ao.to_record_batch(_out(logprobs=_lists(cu=None))),
        ShapeError,
        "logprobs.cu_num_generated_tokens",
        "2 positions",
        "3 positions",
    ),
    case(
        "logprobs-int32-ids-under-int64-schema",
        lambda: ao.to_record_batch(_out(logprobs=_lists(ids=np.int32)), schema=ao.output_schema()),
        SchemaMismatchError,
        "logprobs.logprob_token_ids",
        "int64 (the run's schema",
        "int32",
    ),
    case(
        "logprobs-int64-ids-under-int32-schema",
        lambda: ao.to_record_batch(
            _out(logprobs=_lists()),
            schema=ao.output_schema(ColumnTypes(logprob_token_ids="int32")),
        ),
        SchemaMismatchError,
        "logprobs.logprob_token_ids",
        "int32 (the run's schema",
        "int64",
    ),
    case(
        "logprobs-int32-ranks-under-int64-schema",
        lambda: ao.to_record_batch(
            _out(logprobs=_lists(ranks=np.int32)), schema=ao.output_schema()
        ),
        SchemaMismatchError,
        "logprobs.sampled_token_ranks",
        "int64 (the run's schema",
        "int32",
    ),
    case(
        "logprobs-device-tensor",
        lambda: ao.to_record_batch(
            _out(
                logprobs=LogprobsTensors(
                    _meta((3, 2), torch.int64), _meta((3, 2)), _meta((3,), torch.int64), [0, 1, 3]
                )
            )
        ),
        UnsupportedValueError,
        "logprobs.logprob_token_ids",
        "a host (CPU) tensor",
        "a tensor on meta",
    ),
    # num_nans_in_logits
    case(
        "num-nans-float",
        lambda: ao.to_record_batch(_out(num_nans_in_logits={"a": 1.0})),
        FieldTypeError,
        "num_nans_in_logits['a']",
        "an int",
        "float 1.0",
    ),
    case(
        "num-nans-unknown-key",
        lambda: ao.to_record_batch(_out(num_nans_in_logits={"z": 1})),
        ConsistencyError,
        "num_nans_in_logits",
        "request ids of this step",
        "'z'",
    ),
    case(
        "num-nans-above-int32",
        lambda: ao.to_record_batch(_out(num_nans_in_logits={"a": 2**40})),
        UnsupportedValueError,
        "num_nans_in_logits",
        "within int32",
        str(2**40),
    ),
    # prompt logprobs
    case(
        "prompt-logprobs-unknown-key",
        lambda: ao.to_record_batch(_out(prompt_logprobs_dict={"z": None})),
        ConsistencyError,
        "prompt_logprobs_dict",
        "request ids of this step",
        "'z'",
    ),
    case(
        "prompt-logprobs-lists-first-row",
        lambda: ao.to_record_batch(_out(prompt_logprobs_dict={"a": _lists(cu=None)})),
        FieldTypeError,
        "prompt_logprobs_dict['a']",
        "LogprobsTensors",
        "LogprobsLists",
    ),
    case(
        "prompt-logprobs-lists-second-row",
        lambda: ao.to_record_batch(_out(prompt_logprobs_dict={"b": _lists(cu=None)})),
        FieldTypeError,
        "prompt_logprobs_dict['b']",
        "LogprobsTensors",
        "LogprobsLists",
    ),
    case(
        "prompt-token-id-logprobs-none",
        lambda: ao.to_record_batch(_out(prompt_token_id_logprobs_dict={"a": None})),
        FieldTypeError,
        "prompt_token_id_logprobs_dict['a']",
        "a tensor",
        "None",
    ),
    # pooler_output
    case(
        "pooler-tensor-not-list",
        lambda: ao.to_record_batch(_out(pooler_output=torch.zeros((2, 4)))),
        FieldTypeError,
        "pooler_output",
        "a list of tensors",
        "torch float32 tensor of shape (2, 4)",
    ),
    case(
        "pooler-wrong-length",
        lambda: ao.to_record_batch(_out(pooler_output=[torch.zeros(4)])),
        ShapeError,
        "pooler_output",
        "2 rows (one per request)",
        "1",
    ),
    case(
        "pooler-mixed-dtypes",
        lambda: ao.to_record_batch(
            _out(pooler_output=[torch.zeros(4), torch.zeros(4, dtype=torch.float16)])
        ),
        DTypeError,
        "pooler_output[1]",
        "float32",
        "float16",
    ),
    case(
        "pooler-mixed-kinds",
        lambda: ao.to_record_batch(
            _out(pooler_output=[torch.zeros(4), np.zeros(4, dtype=np.float32)])
        ),
        FieldTypeError,
        "pooler_output",
        "rows of one kind",
        "a mix",
    ),
    case(
        "pooler-row-shape-differs-from-run",
        lambda: ao.to_record_batch(
            _out(pooler_output=[torch.zeros(4), torch.zeros(5)]), schema=_pooler_schema()
        ),
        ShapeError,
        "pooler_output[1]",
        "shape (4,) (the run's fixed shape)",
        "shape (5,)",
    ),
    case(
        "pooler-row-rank-differs-from-run",
        lambda: ao.to_record_batch(
            _out(pooler_output=[torch.zeros((2, 2)), torch.zeros(4)]), schema=_pooler_schema()
        ),
        ShapeError,
        "pooler_output[0]",
        "a 1-D tensor",
        "shape (2, 2)",
    ),
    case(
        "pooler-str-row",
        lambda: ao.to_record_batch(_out(pooler_output=["x", None]), schema=ao.output_schema()),
        FieldTypeError,
        "pooler_output[0]",
        "a torch tensor, a numpy array or None",
        "str 'x'",
    ),
    case(
        "pooler-device-tensor",
        lambda: ao.to_record_batch(_out(pooler_output=[_meta((4,)), _meta((4,))])),
        UnsupportedValueError,
        "pooler_output[0]",
        "a host (CPU) tensor",
        "a tensor on meta",
    ),
    # sampling masks against the step
    case(
        "masks-wrong-request-count",
        lambda: ao.to_record_batch(_out(sampling_masks=_masks(cu=[0, 2]))),
        ShapeError,
        "sampling_masks",
        "masks for 2 requests",
        "masks for 1",
    ),
    # options
    case(
        "opaque-error",
        lambda: ao.to_record_batch(
            _out(kv_connector_output=KVConnectorOutput(kv_connector_stats=object())),
            opaque="error",
        ),
        UnsupportedValueError,
        "kv_connector_output.kv_connector_stats",
        "plain data",
        "builtins.object",
    ),
    case(
        "opaque-unknown-value",
        lambda: ao.to_record_batch(_out(), opaque="pickle"),
        FieldTypeError,
        "opaque",
        "'drop' or 'error'",
        "'pickle'",
    ),
    case(
        "metadata-with-schema",
        lambda: ao.to_record_batch(_out(), schema=ao.output_schema(), metadata={"m": 1}),
        ConsistencyError,
        "metadata",
        "None when a schema is given",
        "a dict",
    ),
]


@pytest.mark.parametrize("c", TO_RECORD_BATCH)
def test_to_record_batch_bad_input(c: Case) -> None:
    _check(c)


LOGPROBS_TO_ARROW = [
    case(
        "str",
        lambda: ao.logprobs_to_arrow("lp"),
        FieldTypeError,
        "logprobs",
        "LogprobsLists or LogprobsTensors",
        "str 'lp'",
    ),
    case(
        "ids-list-not-array",
        lambda: ao.logprobs_to_arrow(_lists()._replace(logprob_token_ids=[[1, 2]] * 3)),
        FieldTypeError,
        "logprobs.logprob_token_ids",
        "a numpy array or a torch tensor",
        "list",
    ),
    case(
        "lists-int16-ids",
        lambda: ao.logprobs_to_arrow(_lists(ids=np.int16)),
        DTypeError,
        "logprobs.logprob_token_ids",
        "int32 or int64",
        "int16",
    ),
    case(
        "lists-float64-logprobs",
        lambda: ao.logprobs_to_arrow(_lists(lps=np.float64)),
        DTypeError,
        "logprobs.logprobs",
        "float32",
        "float64",
    ),
    case(
        "lists-float32-ranks",
        lambda: ao.logprobs_to_arrow(_lists(ranks=np.float32)),
        DTypeError,
        "logprobs.sampled_token_ranks",
        "int32 or int64",
        "float32",
    ),
    case(
        "tensors-int16-ids",
        lambda: ao.logprobs_to_arrow(_tensors(ids=torch.int16)),
        DTypeError,
        "logprobs.logprob_token_ids",
        "int32 or int64",
        "int16",
    ),
    case(
        "tensors-float64-logprobs",
        lambda: ao.logprobs_to_arrow(_tensors(lps=torch.float64)),
        DTypeError,
        "logprobs.logprobs",
        "float32",
        "float64",
    ),
    case(
        "tensors-bfloat16-logprobs",
        lambda: ao.logprobs_to_arrow(_tensors(lps=torch.bfloat16)),
        DTypeError,
        "logprobs.logprobs",
        "float32",
        "bfloat16",
    ),
    case(
        "tensors-float32-ranks",
        lambda: ao.logprobs_to_arrow(_tensors(ranks=torch.float32)),
        DTypeError,
        "logprobs.selected_token_ranks",
        "int32 or int64",
        "float32",
    ),
    case(
        "tensors-device",
        lambda: ao.logprobs_to_arrow(_tensors(device="meta")),
        UnsupportedValueError,
        "logprobs.logprob_token_ids",
        "a host (CPU) tensor",
        "a tensor on meta",
    ),
    case(
        "1d-ids",
        lambda: ao.logprobs_to_arrow(_lists(ids_shape=(3,))),
        ShapeError,
        "logprobs.logprob_token_ids",
        "a 2-D array",
        "shape (3,)",
    ),
    case(
        "logprobs-shape-differs-from-ids",
        lambda: ao.logprobs_to_arrow(_lists(lps_shape=(3, 3))),
        ShapeError,
        "logprobs.logprobs",
        "shape (3, 2)",
        "shape (3, 3)",
    ),
    case(
        "ranks-length-differs",
        lambda: ao.logprobs_to_arrow(_lists(num_ranks=2)),
        ShapeError,
        "logprobs.sampled_token_ranks",
        "3 ranks (one per position)",
        "2",
    ),
    case(
        "cu-not-starting-at-0",
        lambda: ao.logprobs_to_arrow(_lists(cu=[1, 1, 3])),
        OffsetsError,
        "logprobs.cu_num_generated_tokens",
        "starting at 0",
        "starting at 1",
    ),
    case(
        "cu-decreasing",
        lambda: ao.logprobs_to_arrow(_lists(cu=[0, 2, 1, 3])),
        OffsetsError,
        "logprobs.cu_num_generated_tokens",
        "non-decreasing",
        "2 followed by 1",
    ),
    case(
        "cu-wrong-end",
        lambda: ao.logprobs_to_arrow(_lists(cu=[0, 1, 2])),
        OffsetsError,
        "logprobs.cu_num_generated_tokens",
        "ending at 3",
        "ending at 2",
    ),
    case(
        "cu-numpy-not-list",
        lambda: ao.logprobs_to_arrow(_lists(cu=np.array([0, 1, 3]))),
        FieldTypeError,
        "logprobs.cu_num_generated_tokens",
        "a list of ints",
        "numpy int64 array",
    ),
    case(
        "cu-str-not-list",
        lambda: ao.logprobs_to_arrow(_lists(cu="013")),
        FieldTypeError,
        "logprobs.cu_num_generated_tokens",
        "a list of ints",
        "str '013'",
    ),
    case(
        "cu-non-int-entry",
        lambda: ao.logprobs_to_arrow(_lists(cu=[0, "x", 3])),
        FieldTypeError,
        "logprobs.cu_num_generated_tokens",
        "a list of ints",
        "'x'",
    ),
    case(
        "cu-float-entry",
        lambda: ao.logprobs_to_arrow(_lists(cu=[0, 1.5, 3])),
        FieldTypeError,
        "logprobs.cu_num_generated_tokens",
        "a list of ints",
        "1.5",
    ),
]


@pytest.mark.parametrize("c", LOGPROBS_TO_ARROW)
def test_logprobs_to_arrow_bad_input(c: Case) -> None:
    _check(c)


LOGPROBS_FROM_ARROW = [
    case(
        "int-array",
        lambda: ao.logprobs_from_arrow(pa.array([1, 2])),
        SchemaMismatchError,
        "logprobs",
        "list<item: struct<token_ids",
        "int64",
    ),
    case(
        "list-of-int",
        lambda: ao.logprobs_from_arrow(pa.array([[1]])),
        SchemaMismatchError,
        "logprobs",
        "list<item: struct<token_ids",
        "list<item: int64>",
    ),
    case(
        "float64-logprobs",
        lambda: ao.logprobs_from_arrow(
            pa.array([[{"token_ids": [1], "logprobs": [-1.0], "rank": 1}]])
        ),
        SchemaMismatchError,
        "logprobs",
        "logprobs: list<item: float>",
        "logprobs: list<item: double>",
    ),
    case(
        "null-rows",
        lambda: ao.logprobs_from_arrow(pa.nulls(2, ao.logprobs.logprobs_type())),
        SchemaMismatchError,
        "logprobs",
        "no null entries",
        "2 nulls",
    ),
    case(
        "no-cu-but-several-positions",
        lambda: ao.logprobs_from_arrow(
            ao.logprobs_to_arrow(_lists()), cu_num_generated_tokens=False
        ),
        OffsetsError,
        "logprobs",
        "one position per request",
        "offsets [0, 1",
    ),
    case(
        "decreasing-offsets",
        lambda: ao.logprobs_from_arrow(_corrupt_list(ao.logprobs_to_arrow(_lists()), [0, 3, 1])),
        OffsetsError,
        "logprobs",
        "non-decreasing offsets",
        ("3", "1"),
    ),
]


@pytest.mark.parametrize("c", LOGPROBS_FROM_ARROW)
def test_logprobs_from_arrow_bad_input(c: Case) -> None:
    _check(c)


SAMPLING_MASKS_TO_ARROW = [
    case(
        "str",
        lambda: ao.sampling_masks_to_arrow("m"),
        FieldTypeError,
        "sampling_masks",
        "a SamplingMaskLists",
        "str 'm'",
    ),
    case(
        "int64-token-ids",
        lambda: ao.sampling_masks_to_arrow(_masks(token_ids=np.int64)),
        DTypeError,
        "sampling_masks.token_ids",
        "int32",
        "int64",
    ),
    case(
        "2d-token-ids",
        lambda: ao.sampling_masks_to_arrow(
            SamplingMaskLists(np.zeros((2, 2), np.int32), np.array([0, 4], np.int64))
        ),
        ShapeError,
        "sampling_masks.token_ids",
        "a 1-D array",
        "shape (2, 2)",
    ),
    case(
        "int32-offsets",
        lambda: ao.sampling_masks_to_arrow(_masks(offsets=np.int32)),
        DTypeError,
        "sampling_masks.offsets",
        "int64",
        "int32",
    ),
    case(
        "offsets-not-ending-at-len-token-ids",
        lambda: ao.sampling_masks_to_arrow(_masks(ov=(0, 1, 2))),
        OffsetsError,
        "sampling_masks.offsets",
        "ending at 3 (the number of token_ids)",
        "ending at 2",
    ),
    case(
        "offsets-not-starting-at-0",
        lambda: ao.sampling_masks_to_arrow(_masks(ov=(1, 2, 3))),
        OffsetsError,
        "sampling_masks.offsets",
        "starting at 0",
        "starting at 1",
    ),
    case(
        "offsets-non-monotonic",
        lambda: ao.sampling_masks_to_arrow(_masks(ov=(0, 2, 1, 3))),
        OffsetsError,
        "sampling_masks.offsets",
        "non-decreasing",
        "2 followed by 1",
    ),
    case(
        "cu-inconsistent-with-positions",
        lambda: ao.sampling_masks_to_arrow(_masks(cu=[0, 1, 3])),
        OffsetsError,
        "sampling_masks.cu_num_generated_tokens",
        "ending at 2 (the number of mask positions)",
        "ending at 3",
    ),
    case(
        "cu-not-list",
        lambda: ao.sampling_masks_to_arrow(_masks(cu=np.array([0, 1, 2]))),
        FieldTypeError,
        "sampling_masks.cu_num_generated_tokens",
        "a list of ints",
        "numpy int64 array",
    ),
]


@pytest.mark.parametrize("c", SAMPLING_MASKS_TO_ARROW)
def test_sampling_masks_to_arrow_bad_input(c: Case) -> None:
    _check(c)


SAMPLING_MASKS_FROM_ARROW = [
    case(
        "wrong-type",
        lambda: ao.sampling_masks_from_arrow(pa.array([[1]])),
        SchemaMismatchError,
        "sampling_masks",
        "large_list<item: int32>",
        "list<item: int64>",
    ),
    case(
        "null-rows",
        lambda: ao.sampling_masks_from_arrow(pa.array([None, [[1]]], ao.masks.SAMPLING_MASK_TYPE)),
        SchemaMismatchError,
        "sampling_masks",
        "no null entries",
        "1 nulls",
    ),
    case(
        "no-offsets-but-several-positions",
        lambda: ao.sampling_masks_from_arrow(ao.sampling_masks_to_arrow(_masks()), offsets=False),
        ShapeError,
        "sampling_masks.offsets",
        "one position",
        "2",
    ),
    case(
        "decreasing-csr-offsets",
        lambda: ao.sampling_masks_from_arrow(_corrupt_inner_masks()),
        OffsetsError,
        "sampling_masks.offsets",
        "non-decreasing",
        ("3", "1"),
    ),
]


@pytest.mark.parametrize("c", SAMPLING_MASKS_FROM_ARROW)
def test_sampling_masks_from_arrow_bad_input(c: Case) -> None:
    _check(c)


FROM_RECORD_BATCH = [
    case(
        "not-a-batch",
        lambda: ao.from_record_batch({"a": [1]}),
        FieldTypeError,
        "batch",
        "a pyarrow.RecordBatch",
        "dict",
    ),
    case(
        "plain-batch-without-metadata",
        lambda: ao.from_record_batch(pa.record_batch([pa.array([1, 2])], names=["x"])),
        SchemaMismatchError,
        "schema.metadata[arrow_outputs.format]",
        "'arrow_outputs.model_runner_output'",
        "no such key",
    ),
    case(
        "other-format-name",
        lambda: ao.from_record_batch(
            pa.record_batch([pa.array([1])], names=["x"]).replace_schema_metadata(
                {"arrow_outputs.format": "other"}
            )
        ),
        SchemaMismatchError,
        "schema.metadata[arrow_outputs.format]",
        "'arrow_outputs.model_runner_output'",
        "'other'",
    ),
    case(
        "newer-major-version",
        lambda: ao.from_record_batch(_with_version(b"2.0")),
        FormatVersionError,
        "schema.metadata[arrow_outputs.version]",
        "upgrade arrow_outputs",
        "2.0",
    ),
    case(
        "unparseable-version",
        lambda: ao.from_record_batch(_with_version(b"one")),
        FormatVersionError,
        "schema.metadata[arrow_outputs.version]",
        "MAJOR.MINOR",
        "'one'",
    ),
    case(
        "column-removed",
        lambda: ao.from_record_batch(_without_column("pooler_output")),
        SchemaMismatchError,
        "schema",
        "'pooler_output'",
        "'num_nans_in_logits'",
    ),
    case(
        "column-retyped-int64-nans",
        lambda: ao.from_record_batch(_with_column("num_nans_in_logits", pa.nulls(2, pa.int64()))),
        SchemaMismatchError,
        "num_nans_in_logits",
        "int32",
        "int64",
    ),
    case(
        "column-retyped-int16-sampled",
        lambda: ao.from_record_batch(
            _with_column("sampled_token_ids", pa.array([[1], [2, 3]], pa.list_(pa.int16())))
        ),
        SchemaMismatchError,
        "sampled_token_ids",
        "int32 or int64",
        "int16",
    ),
    case(
        "column-retyped-masks",
        lambda: ao.from_record_batch(
            _with_column(
                "sampling_mask", pa.array([[[4]], [[5, 6]]], pa.list_(pa.list_(pa.int32())))
            )
        ),
        SchemaMismatchError,
        "sampling_mask",
        "large_list",
        "list<item: list<item: int32>>",
    ),
    case(
        "corrupted-sampled-offsets",
        lambda: ao.from_record_batch(_corrupt_offsets("sampled_token_ids", [0, 3, 1])),
        SchemaMismatchError,
        "batch",
        "a valid Arrow record batch",
        "non-monotonic offset",
    ),
    case(
        "corrupted-logprobs-offsets",
        lambda: ao.from_record_batch(_corrupt_offsets("logprobs", [0, 3, 1])),
        SchemaMismatchError,
        "batch",
        "a valid Arrow record batch",
        "non-monotonic offset",
    ),
    case(
        "corrupted-masks-offsets",
        lambda: ao.from_record_batch(_corrupt_offsets("sampling_mask", [0, 2, 1])),
        SchemaMismatchError,
        "batch",
        "a valid Arrow record batch",
        "non-monotonic offset",
    ),
    case(
        "step-metadata-not-json",
        lambda: ao.from_record_batch(_batch(), custom_metadata={b"arrow_outputs.step": b"{"}),
        ao.StepMetadataError,
        "custom_metadata[arrow_outputs.step]",
        "JSON",
        "Expecting property name",
    ),
    case(
        "step-metadata-not-object",
        lambda: ao.from_record_batch(_batch(), custom_metadata={b"arrow_outputs.step": b"[1]"}),
        ao.StepMetadataError,
        "custom_metadata[arrow_outputs.step]",
        "a JSON object",
        "list",
    ),
]


@pytest.mark.parametrize("c", FROM_RECORD_BATCH)
def test_from_record_batch_bad_input(c: Case) -> None:
    _check(c)


SCHEMA = [
    case(
        "column-types-int16-logprob-ids",
        lambda: ColumnTypes(logprob_token_ids="int16"),
        FieldTypeError,
        "ColumnTypes.logprob_token_ids",
        "'int32' or 'int64'",
        "'int16'",
    ),
    case(
        "column-types-float-sampled-ids",
        lambda: ColumnTypes(sampled_token_ids="float32"),
        FieldTypeError,
        "ColumnTypes.sampled_token_ids",
        "'int32' or 'int64'",
        "'float32'",
    ),
    case(
        "output-schema-metadata-object",
        lambda: ao.output_schema(metadata={"model": object()}),
        FieldTypeError,
        "metadata",
        "JSON-serialisable",
        "not JSON serializable",
    ),
    case(
        "output-schema-metadata-nan",
        lambda: ao.output_schema(metadata={"temperature": float("nan")}),
        FieldTypeError,
        "metadata",
        "JSON-serialisable",
        "float",
    ),
    case(
        "output-schema-metadata-not-dict",
        lambda: ao.output_schema(metadata=[("model", "tiny")]),
        FieldTypeError,
        "metadata",
        "a dict",
        "[('model', 'tiny')]",
    ),
    case(
        "to-record-batch-schema-of-another-format",
        lambda: ao.to_record_batch(_out(), schema=pa.schema([("x", pa.int64())])),
        SchemaMismatchError,
        "schema.metadata[arrow_outputs.format]",
        "'arrow_outputs.model_runner_output'",
        "no such key",
    ),
]


@pytest.mark.parametrize("c", SCHEMA)
def test_output_schema_bad_input(c: Case) -> None:
    _check(c)


_CU_TENSOR = torch.tensor([0, 1, 3])

DATA_MODEL = [
    case(
        "logprobs-tensors-filter-with-cu",
        lambda: _tensors(cu=[0, 1, 3]).filter(torch.tensor([True, False, True])),
        ConsistencyError,
        "cu_num_generated_tokens",
        "None (filter works on one position per request)",
        "[0, 1, 3]",
    ),
    case(
        "logprobs-tensors-filter-with-cu-tensor",
        lambda: (
            _tensors()
            ._replace(cu_num_generated_tokens_tensor=_CU_TENSOR)
            .filter(torch.tensor([True, False, True]))
        ),
        ConsistencyError,
        "cu_num_generated_tokens_tensor",
        "None (filter works",
        "shape (3,)",
    ),
    case(
        "logprobs-tensors-cat-empty",
        lambda: LogprobsTensors.cat([]),
        ShapeError,
        "tensors",
        "at least one LogprobsTensors",
        "an empty sequence",
    ),
    case(
        "logprobs-tensors-cat-cu-missing",
        lambda: LogprobsTensors.cat([_tensors(), _tensors(cu=[0, 3])]),
        ConsistencyError,
        "cu_num_generated_tokens",
        "a list of request boundaries",
        "tensors[1].cu_num_generated_tokens is [0, 3]",
    ),
    case(
        "logprobs-tensors-cat-cu-tensor",
        lambda: LogprobsTensors.cat(
            [_tensors(), _tensors()._replace(cu_num_generated_tokens_tensor=_CU_TENSOR)],
            cu_num_generated_tokens=[0, 6],
        ),
        ConsistencyError,
        "tensors[1].cu_num_generated_tokens_tensor",
        "None when concatenating",
        "shape (3,)",
    ),
    case(
        "sampling-mask-lists-slice-request-without-offsets",
        lambda: _masks(ov=None).slice_request(0, 1),
        ConsistencyError,
        "offsets",
        "CSR offsets",
        "None",
    ),
]


@pytest.mark.parametrize("c", DATA_MODEL)
def test_data_model_bad_input(c: Case) -> None:
    _check(c)


# ----------------------------------------------------------------------------- beyond the table


def test_error_message_format_and_attributes() -> None:
    err = OffsetsError("logprobs.cu_num_generated_tokens", "3 offsets ending at 3", "ending at 2")
    assert (
        str(err)
        == "logprobs.cu_num_generated_tokens: expected 3 offsets ending at 3, got ending at 2"
    )
    assert (err.field, err.expected, err.got) == (
        "logprobs.cu_num_generated_tokens",
        "3 offsets ending at 3",
        "ending at 2",
    )


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (FieldTypeError, TypeError),
        (DTypeError, TypeError),
        (ShapeError, ValueError),
        (OffsetsError, ValueError),
        (ConsistencyError, ValueError),
        (UnsupportedValueError, ValueError),
        (SchemaMismatchError, ValueError),
        (FormatVersionError, ValueError),
    ],
)
def test_error_hierarchy_subclasses_base_and_builtin(cls: type, builtin: type) -> None:
    # Callers that catch TypeError / ValueError (as they would for numpy) still catch these.
    assert issubclass(cls, ArrowOutputsError)
    assert issubclass(cls, builtin)
    assert cls is not ArrowOutputsError


@pytest.mark.parametrize(
    "column", ["sampled_token_ids", "logprobs", "sampling_mask"], ids=lambda c: c
)
def test_from_record_batch_corrupted_offsets_chains_arrow_cause(column: str) -> None:
    offsets = [0, 2, 1] if column == "sampling_mask" else [0, 3, 1]
    batch = _corrupt_offsets(column, offsets)
    with pytest.raises(ArrowOutputsError) as info:
        ao.from_record_batch(batch)
    assert isinstance(info.value, SchemaMismatchError)
    # Wraps pyarrow's own verdict rather than parsing it, and keeps it as the cause.
    assert isinstance(info.value.__cause__, pa.ArrowInvalid)
    assert f"column {batch.schema.get_field_index(column)}" in info.value.got


@pytest.mark.parametrize(
    ("call", "cause"),
    [
        pytest.param(
            lambda: ao.output_schema(metadata={"model": object()}), TypeError, id="metadata-object"
        ),
        pytest.param(
            lambda: ao.output_schema(metadata={"t": float("inf")}), ValueError, id="metadata-inf"
        ),
        pytest.param(
            lambda: ao.to_record_batch(_out(num_nans_in_logits={"a": 2**40})),
            pa.ArrowInvalid,
            id="num-nans-overflow",
        ),
        pytest.param(
            lambda: ao.from_record_batch(_batch(), custom_metadata={"arrow_outputs.step": "{"}),
            ValueError,
            id="step-json",
        ),
    ],
)
def test_errors_chain_wrapped_library_exception(call: Callable[[], Any], cause: type) -> None:
    with pytest.raises(ArrowOutputsError) as info:
        call()
    assert isinstance(info.value.__cause__, cause)


def test_from_record_batch_newer_minor_version_is_read() -> None:
    # Only a newer MAJOR is refused: a newer MINOR adds optional things a reader may ignore.
    out = ao.from_record_batch(_with_version(b"1.7"))
    assert out.sampled_token_ids == [[1], [2, 3]]
    with pytest.raises(FormatVersionError, match="upgrade"):
        ao.from_record_batch(_with_version(b"2.0"))


# ----------------------------------------------------------------------------- nothing half-written


def _snapshot(x: Any) -> Any:
    """A deep, comparable picture of ``x``: values, dtypes, shapes and writeable flags."""
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.shape, x.flags.writeable, x.tobytes())
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), tuple(x.shape), str(x.device), x.clone().numpy().tobytes())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (
            type(x).__name__,
            tuple((f.name, _snapshot(getattr(x, f.name))) for f in dataclasses.fields(x)),
        )
    if isinstance(x, tuple):  # NamedTuples included
        return (type(x).__name__, tuple(_snapshot(v) for v in x))
    if isinstance(x, list):
        return ("list", [_snapshot(v) for v in x])
    if isinstance(x, dict):
        return ("dict", [(k, _snapshot(v)) for k, v in x.items()])
    if isinstance(x, (set, frozenset)):
        return (type(x).__name__, sorted(map(repr, x)))
    return ("value", type(x).__name__, x)


def _identities(out: ModelRunnerOutput) -> list[int]:
    """ids of every field object and of the arrays inside the NamedTuples."""
    ids = []
    for f in dataclasses.fields(out):
        v = getattr(out, f.name)
        ids.append(id(v))
        if isinstance(v, tuple):
            ids.extend(id(part) for part in v)
    return ids


def _full_step(**late: Any) -> ModelRunnerOutput:
    """A step with every early field set; ``late`` supplies the broken late field."""
    fields: dict[str, Any] = {
        "logprobs": _lists(),
        "prompt_logprobs_dict": {
            "a": LogprobsTensors(
                torch.arange(6).reshape(3, 2), torch.zeros((3, 2)), torch.ones(3, dtype=torch.int64)
            )
        },
        "prompt_token_id_logprobs_dict": {"b": torch.ones((2, 3))},
        "pooler_output": [torch.zeros(4), torch.ones(4)],
        "num_nans_in_logits": {"a": 0, "b": 2},
        "sampling_masks": _masks(cu=[0, 1, 2]),
        "kv_connector_output": KVConnectorOutput(finished_sending={"a"}),
    }
    fields.update(late)
    return _out(**fields)


@pytest.mark.parametrize(
    ("late", "opaque", "exc"),
    [
        pytest.param(
            {"sampling_masks": _masks(token_ids=np.int64, cu=[0, 1, 2])},
            "drop",
            DTypeError,
            id="bad-sampling-masks",
        ),
        pytest.param(
            {"sampling_masks": _masks(ov=(0, 2, 1, 3), cu=[0, 1, 3])},
            "drop",
            OffsetsError,
            id="non-monotonic-mask-offsets",
        ),
        pytest.param(
            {"kv_connector_output": KVConnectorOutput(kv_cache_events=object())},
            "error",
            UnsupportedValueError,
            id="opaque-connector-object",
        ),
    ],
)
def test_to_record_batch_failure_leaves_input_unchanged(
    late: dict[str, Any], opaque: str, exc: type[ArrowOutputsError]
) -> None:
    out = _full_step(**late)
    before = _snapshot(out)
    same_objects = _identities(out)
    reference = copy.deepcopy(out)
    with pytest.raises(exc):
        ao.to_record_batch(out, step=5, opaque=opaque)
    assert _snapshot(out) == before
    assert _identities(out) == same_objects
    # The failure left no state behind: the fixed step converts as a fresh copy would.
    fixed = {k: getattr(_full_step(), k) for k in late}
    for name, value in fixed.items():
        setattr(out, name, value)
        setattr(reference, name, copy.deepcopy(value))
    got = ao.to_record_batch(out, step=5)
    want = ao.to_record_batch(reference, step=5)
    assert got.equals(want, check_metadata=True)


def test_to_record_batch_failure_with_run_schema_leaves_schema_usable() -> None:
    schema = ao.infer_schema(_full_step())
    before = schema.serialize().to_pybytes()
    with pytest.raises(DTypeError):
        ao.to_record_batch(
            _full_step(sampling_masks=_masks(token_ids=np.int64, cu=[0, 1, 2])),
            step=1,
            schema=schema,
        )
    assert schema.serialize().to_pybytes() == before
    batch = ao.to_record_batch(_full_step(), step=2, schema=schema)
    assert batch.schema.remove_metadata().equals(schema.remove_metadata())


def test_offset_order_check_compares_neighbours_without_wrapping() -> None:
    # np.diff of int64 extremes wraps to a negative step: the check compares neighbours, so a
    # rising pair passes and the first falling pair is the one named.
    from arrow_outputs._checks import check_monotonic

    check_monotonic(np.array([-(2**63), 2**63 - 1]), "x")
    with pytest.raises(OffsetsError, match=r"got 9223372036854775807 followed by 0 at index 1"):
        check_monotonic(np.array([-(2**63), 2**63 - 1, 0]), "x")
