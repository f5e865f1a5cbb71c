"""arrow_outputs.analysis against straightforward Python references.

Each reference walks ``table.to_pylist()`` row by row, the obvious way; the vectorised
functions must give the same rows. Inputs are hand-made steps (every layout case vLLM
produces: decoding, speculative decoding with rejected rows, pooling steps, absent logprobs,
requests that sampled nothing) and hypothesis-drawn runs.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrow_outputs as ao
from arrow_outputs import analysis as an
from arrow_outputs.errors import FieldTypeError, OffsetsError, SchemaMismatchError
from arrow_outputs.writer import OutputWriter

SCHEMA = ao.output_schema()

# ----------------------------------------------------------------------------- builders


def _index(req_ids: list[str]) -> dict[str, int]:
    return {r: i for i, r in enumerate(req_ids)}


def _logprobs(ids: list[list[int]], lps: list[list[float]], ranks: list[int], cu: Any = None):
    return ao.LogprobsLists(
        np.array(ids, dtype=np.int64).reshape(len(ids), -1),
        np.array(lps, dtype=np.float32).reshape(len(lps), -1),
        np.array(ranks, dtype=np.int64),
        cu,
    )


def _masks(sizes: list[int], cu: Any = None, *, seed: int = 0) -> ao.SamplingMaskLists:
    rng = np.random.default_rng(seed)
    ids = [np.sort(rng.choice(100, size=n, replace=False)) for n in sizes]
    flat = np.concatenate(ids).astype(np.int32) if ids else np.empty(0, np.int32)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return ao.SamplingMaskLists(flat, offsets, cu)


def _table(outputs: list[Any], steps: list[int] | None = None) -> pa.Table:
    steps = list(range(len(outputs))) if steps is None else steps
    batches = [ao.to_record_batch(o, step=s, schema=SCHEMA) for o, s in zip(outputs, steps)]
    return pa.Table.from_batches(batches, schema=SCHEMA)


def _hand_made_outputs() -> list[ao.ModelRunnerOutput]:
    """Four steps with the layouts of vLLM 0.33."""
    decode = ao.ModelRunnerOutput(
        ["a", "b"],
        _index(["a", "b"]),
        [[5], [6]],
        logprobs=_logprobs(
            [[5, 5, 1], [6, 2, 6]], [[-0.5, -0.5, -1.5], [-2.0, -0.1, -2.0]], [1, 2]
        ),
        sampling_masks=_masks([3, 4]),
    )
    # Speculative decoding, model runner V2: one logprob row per verified position; "a"
    # verified 3 drafts and accepted 1 (2 tokens; its 2 rejected rows carry token id 0),
    # "b" accepted its only draft, "c" joined with a chunked prefill and sampled nothing.
    spec = ao.ModelRunnerOutput(
        ["a", "b", "c"],
        _index(["a", "b", "c"]),
        [[7, 8], [9, 3], []],
        logprobs=_logprobs(
            [[7, 7, 1], [8, 1, 8], [0, 2, 3], [0, 4, 5], [9, 9, 2], [3, 3, 4], [11, 11, 1]],
            [
                [-0.2, -0.2, -2.0],
                [-1.0, -0.4, -1.0],
                [-3.0, -0.3, -0.9],
                [-4.0, -0.6, -0.8],
                [-0.1, -0.1, -3.0],
                [-0.7, -0.7, -0.8],
                [-0.3, -0.3, -1.6],
            ],
            [1, 2, 5, 6, 1, 1, 1],
            [0, 4, 6, 7],
        ),
        sampling_masks=_masks([2, 3, 1, 5, 2, 2, 4], [0, 4, 6, 7], seed=1),
    )
    # No logprobs asked for this step; no masks either.
    plain = ao.ModelRunnerOutput(["a", "c"], _index(["a", "c"]), [[4], [12]])
    # A pooling step: requests exist, nothing sampled.
    pooling = ao.ModelRunnerOutput(["p"], _index(["p"]), [], pooler_output=[np.ones(4, np.float32)])
    return [decode, spec, plain, pooling]


def _hand_made_run() -> pa.Table:
    return _table(_hand_made_outputs())


# ----------------------------------------------------------------------------- references


def ref_token_logprobs(table: pa.Table) -> list[dict[str, Any]]:
    out, seen = [], {}
    for row in table.to_pylist():
        positions = row["logprobs"]
        for j, token in enumerate(row["sampled_token_ids"] or []):
            logprob = rank = None
            if positions is not None and j < len(positions):
                pos = positions[j]
                if pos["token_ids"][0] == token:
                    logprob, rank = pos["logprobs"][0], pos["rank"]
                elif token in pos["token_ids"]:
                    logprob = pos["logprobs"][pos["token_ids"].index(token)]
            out.append(
                {
                    "step": row["step"],
                    "req_id": row["req_id"],
                    "position": seen.get(row["req_id"], 0),
                    "step_position": j,
                    "token_id": token,
                    "logprob": logprob,
                    "rank": rank,
                }
            )
            seen[row["req_id"]] = seen.get(row["req_id"], 0) + 1
    return out


def ref_per_request(table: pa.Table) -> list[dict[str, Any]]:
    rows = table.to_pylist()
    order = list(dict.fromkeys(r["req_id"] for r in rows))
    tokens = ref_token_logprobs(table)
    out = []
    for req in order:
        mine = [r for r in rows if r["req_id"] == req]
        steps = [r["step"] for r in mine if r["step"] is not None]
        lps = [t["logprob"] for t in tokens if t["req_id"] == req and t["logprob"] is not None]
        total = sum(lps) if lps else None
        mean = total / len(lps) if lps else None
        out.append(
            {
                "req_id": req,
                "steps": len(mine),
                "first_step": min(steps) if steps else None,
                "last_step": max(steps) if steps else None,
                "tokens": sum(1 for t in tokens if t["req_id"] == req),
                "scored_tokens": len(lps),
                "sequence_logprob": total,
                "mean_logprob": mean,
                "perplexity": math.exp(-mean) if mean is not None else None,
            }
        )
    return out


def ref_topk_entropy(table: pa.Table) -> list[dict[str, Any]]:
    out = []
    for row in table.to_pylist():
        n_tokens = len(row["sampled_token_ids"] or [])
        for j, pos in enumerate(row["logprobs"] or []):
            top = pos["logprobs"][1:]
            p = [math.exp(x) for x in top]
            mass = sum(p)
            entropy = None
            if top and mass > 0 and math.isfinite(mass):
                entropy = -sum(x / mass * math.log(x / mass) for x in p if x > 0)
            out.append(
                {
                    "step": row["step"],
                    "req_id": row["req_id"],
                    "step_position": j,
                    "token_id": pos["token_ids"][0],
                    "sampled": j < n_tokens,
                    "k": len(top),
                    "topk_mass": mass,
                    "entropy": entropy,
                }
            )
    return out


def ref_acceptance_lengths(table: pa.Table) -> list[dict[str, Any]]:
    out = []
    for row in table.to_pylist():
        n = len(row["sampled_token_ids"] or [])
        if n == 0:
            continue
        cell = row.get("logprobs")
        if cell is None:
            cell = row.get("sampling_mask")
        out.append(
            {
                "step": row["step"],
                "req_id": row["req_id"],
                "tokens": n,
                "accepted_drafts": n - 1,
                "draft_tokens": len(cell) - 1 if cell else None,
            }
        )
    return out


def ref_mask_sizes(table: pa.Table) -> list[dict[str, Any]]:
    out = []
    for row in table.to_pylist():
        for j, ids in enumerate(row["sampling_mask"] or []):
            out.append(
                {"step": row["step"], "req_id": row["req_id"], "step_position": j, "size": len(ids)}
            )
    return out


def ref_mask_sizes_per_step(table: pa.Table) -> list[dict[str, Any]]:
    by_step: dict[Any, list[int]] = {}
    for r in ref_mask_sizes(table):
        by_step.setdefault(r["step"], []).append(r["size"])
    return [
        {
            "step": s,
            "positions": len(v),
            "kept": sum(v),
            "mean_size": sum(v) / len(v),
            "min_size": min(v),
            "max_size": max(v),
        }
        for s, v in sorted(by_step.items())
    ]


def _assert_rows(got: pa.Table, expected: list[dict[str, Any]]) -> None:
    rows = got.to_pylist()
    assert len(rows) == len(expected)
    for i, (g, e) in enumerate(zip(rows, expected)):
        assert g.keys() == e.keys(), i
        for key, value in e.items():
            if isinstance(value, float) and g[key] is not None:
                assert g[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (i, key)
            else:
                assert g[key] == value, (i, key, g[key], value)


# ----------------------------------------------------------------------------- hand-made


def test_token_logprobs_hand_made_layouts():
    table = _hand_made_run()
    got = an.token_logprobs(table)
    _assert_rows(got, ref_token_logprobs(table))
    assert got.schema == pa.schema(
        [
            ("step", pa.int64()),
            ("req_id", pa.string()),
            ("position", pa.int64()),
            ("step_position", pa.int64()),
            ("token_id", pa.int64()),
            ("logprob", pa.float32()),
            ("rank", pa.int64()),
        ]
    )
    # The speculative step's rejected rows (token id 0) are no tokens: 2 + 2 tokens there.
    rows = got.to_pylist()
    assert [(r["req_id"], r["token_id"], r["position"]) for r in rows] == [
        ("a", 5, 0), ("b", 6, 0), ("a", 7, 1), ("a", 8, 2), ("b", 9, 1), ("b", 3, 2),
        ("a", 4, 3), ("c", 12, 0),
    ]  # fmt: skip
    assert [r["logprob"] for r in rows][:6] == pytest.approx([-0.5, -2.0, -0.2, -1.0, -0.1, -0.7])
    assert [r["rank"] for r in rows] == [1, 2, 1, 2, 1, 1, None, None]
    # Step 2 had no logprobs: its tokens are there, unscored.
    assert rows[6]["logprob"] is None
    assert rows[7]["logprob"] is None


def test_token_logprobs_searches_row_when_first_entry_differs():
    # A producer whose first entry is not the sampled token: the id is looked up in the row.
    out = ao.ModelRunnerOutput(
        ["a", "b"],
        _index(["a", "b"]),
        [[5], [6]],
        logprobs=_logprobs(
            [[9, 3, 5, 5], [9, 1, 2, 3]], [[-1, -2, -3, -4], [-1, -2, -3, -4]], [1, 1]
        ),
    )
    rows = an.token_logprobs(ao.to_record_batch(out, step=0)).to_pylist()
    assert rows[0]["logprob"] == -3.0
    assert rows[0]["rank"] is None
    assert rows[1]["logprob"] is None
    assert rows[1]["rank"] is None


def test_per_request_hand_made():
    table = _hand_made_run()
    got = an.per_request(table)
    _assert_rows(got, ref_per_request(table))
    by_req = {r["req_id"]: r for r in got.to_pylist()}
    assert by_req["a"]["tokens"] == 4
    assert by_req["a"]["scored_tokens"] == 3
    assert by_req["a"]["sequence_logprob"] == pytest.approx(-0.5 - 0.2 - 1.0)
    assert by_req["a"]["perplexity"] == pytest.approx(math.exp(1.7 / 3))
    # The pooling request: a row, no tokens, no logprob figures.
    assert by_req["p"] == {
        "req_id": "p", "steps": 1, "first_step": 3, "last_step": 3, "tokens": 0,
        "scored_tokens": 0, "sequence_logprob": None, "mean_logprob": None, "perplexity": None,
    }  # fmt: skip
    assert by_req["c"]["scored_tokens"] == 0
    assert by_req["c"]["perplexity"] is None


def test_topk_entropy_hand_made():
    table = _hand_made_run()
    got = an.topk_entropy(table)
    _assert_rows(got, ref_topk_entropy(table))
    rows = got.to_pylist()
    assert len(rows) == 2 + 7  # positions, rejected ones included
    assert [r["sampled"] for r in rows[2:6]] == [True, True, False, False]
    assert [r["sampled"] for r in rows[6:]] == [True, True, False]  # "c" sampled nothing


@pytest.mark.parametrize("k", [1, 2, 5, 20])
def test_topk_entropy_uniform_is_log_k(k):
    lp = np.full((1, k + 1), np.log(0.01), np.float32)
    out = ao.ModelRunnerOutput(
        ["a"], {"a": 0}, [[0]], logprobs=_logprobs([list(range(k + 1))], lp, [1])
    )
    row = an.topk_entropy(ao.to_record_batch(out, step=0)).to_pylist()[0]
    assert row["entropy"] == pytest.approx(math.log(k), abs=1e-9)
    assert row["topk_mass"] == pytest.approx(0.01 * k, rel=1e-6)


def test_topk_entropy_tiny_probabilities_and_neg_inf():
    # exp(-1000) underflows to 0 in float64: the entropy is computed after shifting by each
    # position's largest logprob, so it is still that of the renormalised distribution.
    rows = [
        [-1000.0, -1000.0, -1000.0 - math.log(3)],  # top-2 with probabilities 3/4, 1/4
        [-0.5, -0.5, -math.inf],  # one token holds all the mass
        [-0.5, -math.inf, -math.inf],  # no mass at all: no entropy
    ]
    out = ao.ModelRunnerOutput(
        ["a", "b", "c"], _index(["a", "b", "c"]), [[0], [0], [0]],
        logprobs=_logprobs([[0, 0, 1]] * 3, rows, [1, 1, 1]),
    )  # fmt: skip
    got = an.topk_entropy(ao.to_record_batch(out, step=0)).to_pylist()
    q = np.array([0.75, 0.25])
    assert got[0]["entropy"] == pytest.approx(float(-(q * np.log(q)).sum()), rel=1e-5)
    assert got[0]["topk_mass"] == 0.0  # the mass itself does underflow
    assert got[1]["entropy"] == 0.0
    assert got[1]["topk_mass"] == pytest.approx(math.exp(-0.5))
    assert got[2]["entropy"] is None
    assert got[2]["topk_mass"] == 0.0


def test_perplexity_past_float64_is_inf():
    out = ao.ModelRunnerOutput(
        ["a"], {"a": 0}, [[3]], logprobs=_logprobs([[3, 3]], [[-1000.0, -1000.0]], [1])
    )
    batch = ao.to_record_batch(out, step=0)
    assert an.per_request(batch).column("perplexity").to_pylist() == [math.inf]
    assert an.summary(batch)["perplexity"] == math.inf


def test_topk_entropy_no_topk_entries():
    # max_num_logprobs == 0: each row is only the sampled token.
    out = ao.ModelRunnerOutput(["a"], {"a": 0}, [[3]], logprobs=_logprobs([[3]], [[-0.2]], [1]))
    row = an.topk_entropy(ao.to_record_batch(out, step=0)).to_pylist()[0]
    assert row["k"] == 0
    assert row["entropy"] is None
    assert row["topk_mass"] == 0.0


def test_acceptance_lengths_hand_made():
    table = _hand_made_run()
    got = an.acceptance_lengths(table)
    _assert_rows(got, ref_acceptance_lengths(table))
    spec = got.filter(pc.equal(got.column("step"), 1)).to_pylist()
    assert [(r["req_id"], r["tokens"], r["accepted_drafts"], r["draft_tokens"]) for r in spec] == [
        ("a", 2, 1, 3),
        ("b", 2, 1, 1),
    ]
    # Step 2 has neither logprobs nor masks: the drafts are unknown.
    assert got.filter(pc.equal(got.column("step"), 2)).column("draft_tokens").null_count == 2


def test_acceptance_lengths_uses_masks_without_logprobs():
    out = ao.ModelRunnerOutput(
        ["a", "b"], _index(["a", "b"]), [[1, 2], [3]],
        sampling_masks=_masks([1, 2, 3, 4], [0, 3, 4]),
    )  # fmt: skip
    got = an.acceptance_lengths(ao.to_record_batch(out, step=0))
    assert got.column("draft_tokens").to_pylist() == [2, 0]
    # Without the columns that tell the drafts, the tokens are still counted.
    only = ao.to_record_batch(out, step=0).select(["step", "req_id", "sampled_token_ids"])
    assert an.acceptance_lengths(only).column("draft_tokens").to_pylist() == [None, None]


def test_mask_sizes_hand_made():
    table = _hand_made_run()
    _assert_rows(an.mask_sizes(table), ref_mask_sizes(table))
    per_step = an.mask_sizes(table, by="step")
    _assert_rows(per_step, ref_mask_sizes_per_step(table))
    assert per_step.column("step").to_pylist() == [0, 1]  # steps 2 and 3 had no masks
    assert per_step.column("kept").to_pylist() == [7, 19]


def test_summary_hand_made():
    table = _hand_made_run()
    s = an.summary(table)
    tokens = ref_token_logprobs(table)
    lps = [t["logprob"] for t in tokens if t["logprob"] is not None]
    ppl = sorted(r["perplexity"] for r in ref_per_request(table) if r["perplexity"] is not None)
    ent = [
        r["entropy"] for r in ref_topk_entropy(table) if r["sampled"] and r["entropy"] is not None
    ]
    assert s == {
        "steps": 4,
        "rows": 8,
        "requests": 4,
        "tokens": 8,
        "scored_tokens": 6,
        "mean_logprob": pytest.approx(sum(lps) / 6),
        "perplexity": pytest.approx(math.exp(-sum(lps) / 6)),
        "median_request_perplexity": pytest.approx((ppl[0] + ppl[1]) / 2),
        "mean_topk_entropy": pytest.approx(sum(ent) / len(ent)),
        "speculative_rows": 2,
        "mean_acceptance_length": 2.0,
        "acceptance_rate": pytest.approx(2 / 4),
        "mask_positions": 9,
        "mean_mask_size": pytest.approx(26 / 9),
    }
    json.dumps(s)  # plain Python values: ready for the CLI's --json


def test_summary_without_logprobs_or_masks():
    table = _hand_made_run().select(["step", "req_id", "sampled_token_ids"])
    s = an.summary(table)
    assert s["tokens"] == 8
    assert s["requests"] == 4
    for key in ("scored_tokens", "mean_logprob", "perplexity", "mean_topk_entropy"):
        assert s[key] is None
    assert s["mask_positions"] is None
    assert s["speculative_rows"] == 0
    assert s["acceptance_rate"] is None
    assert s["mean_acceptance_length"] is None


def test_functions_on_empty_inputs():
    empty = _table([ao.ModelRunnerOutput([], {})])
    assert an.token_logprobs(empty).num_rows == 0
    assert an.per_request(empty).num_rows == 0
    assert an.topk_entropy(empty).num_rows == 0
    assert an.acceptance_lengths(empty).num_rows == 0
    assert an.mask_sizes(empty, by="step").num_rows == 0
    s = an.summary(SCHEMA.empty_table())
    assert s["rows"] == 0
    assert s["tokens"] == 0
    assert s["mean_logprob"] is None


def test_steps_without_step_numbers():
    out = ao.ModelRunnerOutput(
        ["a"], {"a": 0}, [[1]], logprobs=_logprobs([[1, 2]], [[-1, -2]], [1])
    )
    batch = ao.to_record_batch(out)  # step=None: the step column is all null
    table = pa.Table.from_batches([batch, batch], schema=SCHEMA)
    _assert_rows(an.per_request(table), ref_per_request(table))
    assert an.per_request(table).column("first_step").to_pylist() == [None]
    assert an.token_logprobs(table).column("position").to_pylist() == [0, 1]
    assert an.summary(table)["steps"] == 0


# ----------------------------------------------------------------------------- hypothesis


@st.composite
def runs(draw: Any) -> pa.Table:
    """A run of 1-5 steps: random requests, tokens, verified positions, widths, masks."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    outputs = []
    for _ in range(draw(st.integers(1, 5))):
        req_ids = draw(st.lists(st.sampled_from("abcdef"), max_size=4, unique=True))
        kind = draw(st.sampled_from(["decode", "spec", "spec", "pooling"]))
        if kind == "pooling" and req_ids:
            outputs.append(
                ao.ModelRunnerOutput(
                    req_ids,
                    _index(req_ids),
                    [],
                    pooler_output=[np.zeros(2, np.float32)] * len(req_ids),
                )
            )
            continue
        if kind == "spec":
            positions = [int(rng.integers(0, 4)) for _ in req_ids]
            tokens = [int(rng.integers(0, 4)) for _ in req_ids]  # may exceed the positions
            cu = np.concatenate([[0], np.cumsum(positions)]).astype(int).tolist()
        else:
            positions = [1] * len(req_ids)
            tokens = [int(rng.integers(0, 2)) for _ in req_ids]
            cu = None
        sampled = [rng.integers(0, 8, size=n).tolist() for n in tokens]
        total = sum(positions)
        width = draw(st.integers(1, 4))
        ids = rng.integers(0, 8, size=(total, width))
        values = rng.uniform(-12, 0, size=(total, width)).astype(np.float32)
        values[:, 1:][rng.random((total, width - 1)) < 0.15] = -np.inf
        starts = np.concatenate([[0], np.cumsum(positions)[:-1]]).astype(int)
        for i, toks in enumerate(sampled):
            for j, t in enumerate(toks[: positions[i]]):
                if rng.random() < 0.85:  # vLLM's layout; otherwise the row is searched
                    ids[starts[i] + j, 0] = t
        logprobs = None
        if draw(st.booleans()) or kind == "spec":
            logprobs = ao.LogprobsLists(ids, values, rng.integers(1, 50, size=total), cu)
        masks = None
        if draw(st.booleans()):
            masks = _masks(rng.integers(0, 6, size=total).tolist(), cu, seed=int(rng.integers(99)))
        outputs.append(
            ao.ModelRunnerOutput(
                req_ids, _index(req_ids), sampled, logprobs=logprobs, sampling_masks=masks
            )
        )
    table = _table(outputs)
    if draw(st.booleans()) and table.num_rows > 1:  # slices and filters must read right
        start = draw(st.integers(0, table.num_rows - 1))
        table = table.slice(start, draw(st.integers(0, table.num_rows - start)))
    return table


_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(runs())
def test_token_logprobs_matches_reference(table):
    _assert_rows(an.token_logprobs(table), ref_token_logprobs(table))


@_SETTINGS
@given(runs())
def test_per_request_matches_reference(table):
    _assert_rows(an.per_request(table), ref_per_request(table))


@_SETTINGS
@given(runs())
def test_topk_entropy_matches_reference(table):
    _assert_rows(an.topk_entropy(table), ref_topk_entropy(table))


@_SETTINGS
@given(runs())
def test_acceptance_lengths_matches_reference(table):
    _assert_rows(an.acceptance_lengths(table), ref_acceptance_lengths(table))


@_SETTINGS
@given(runs())
def test_mask_sizes_matches_reference(table):
    _assert_rows(an.mask_sizes(table), ref_mask_sizes(table))
    _assert_rows(an.mask_sizes(table, by="step"), ref_mask_sizes_per_step(table))


@_SETTINGS
@given(runs())
def test_results_do_not_depend_on_chunking(table):
    # One chunk, one per step, or batches worked on one by one instead of merged first
    # (_GROUP_BYTES = 1): the same rows.
    fns = (
        an.token_logprobs,
        an.per_request,
        an.topk_entropy,
        an.acceptance_lengths,
        an.mask_sizes,
    )
    expected = [fn(table) for fn in fns]
    whole = table.combine_chunks()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(an, "_GROUP_BYTES", 1)
        for fn, result in zip(fns, expected):
            assert fn(whole).equals(result)
            assert fn(table).equals(result)


# ----------------------------------------------------------------------------- inputs


def test_inputs_of_every_kind(tmp_path):
    table = _hand_made_run()
    expected = an.summary(table)
    assert an.summary(table.to_batches()) == expected
    assert (
        an.summary(pa.RecordBatchReader.from_batches(table.schema, table.to_batches())) == expected
    )

    class Stream:  # only the Arrow PyCapsule stream protocol
        def __arrow_c_stream__(self, requested_schema=None):
            return table.__arrow_c_stream__(requested_schema)

    assert an.summary(Stream()) == expected
    one = table.to_batches()[1]
    assert an.summary(one) == an.summary(pa.Table.from_batches([one]))
    # Batches straight from to_record_batch: the table does not take the first one's step JSON.
    batches = [
        ao.to_record_batch(out, step=i, schema=SCHEMA) for i, out in enumerate(_hand_made_outputs())
    ]
    from_list = an.as_table(batches)
    assert ao.schema.KEY_STEP not in from_list.schema.metadata
    assert ao.schema.KEY_STEP in batches[0].schema.metadata
    assert an.summary(batches) == expected
    # A run file's bytes, as a pyarrow Buffer or Python bytes.
    sink = pa.BufferOutputStream()
    with OutputWriter(sink) as writer:
        for step, out in enumerate(_hand_made_outputs()):
            writer.write(out, step=step)
    assert an.summary(sink.getvalue()) == expected
    assert an.summary(sink.getvalue().to_pybytes()) == expected


def test_batches_of_different_schemas_raise():
    # Inferred one by one, the decode step's schema and the pooling step's differ.
    batches = [ao.to_record_batch(out, step=i) for i, out in enumerate(_hand_made_outputs())]
    with pytest.raises(SchemaMismatchError) as e:
        an.as_table(batches)
    assert e.value.field == "data[3]"
    assert e.value.got.startswith("a batch whose schema differs from batch 0's: pooler_output: ")


def test_hostile_file_bytes_raise():
    with pytest.raises(ao.CorruptFileError):
        an.summary(b"ARROW1\x00\x00not a run at all")


def test_as_table_is_zero_copy_for_batches():
    batch = _hand_made_run().to_batches()[1]
    table = an.as_table(batch)
    values = batch.column("logprobs").buffers()
    assert [b.address if b else None for b in table.column("logprobs").chunk(0).buffers()] == [
        b.address if b else None for b in values
    ]


def test_run_file_path(tmp_path):
    path = tmp_path / "run.arrow"
    table = _hand_made_run()
    with OutputWriter(str(path), format="file") as writer:
        for step, out in enumerate(_hand_made_outputs()):
            writer.write(out, step=step)
    assert an.summary(path) == an.summary(table)
    assert an.summary(str(path)) == an.summary(table)
    assert an.summary(ao.open_run(path)) == an.summary(table)  # by __arrow_c_stream__
    _assert_rows(an.token_logprobs(path), ref_token_logprobs(table))


def test_polars_frame_input():
    pl = pytest.importorskip("polars")
    table = _hand_made_run()
    frame = pl.from_arrow(table)  # Polars hands back large_string / large_list columns
    assert an.summary(frame) == an.summary(table)
    _assert_rows(an.token_logprobs(frame), ref_token_logprobs(table))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "data", [42, "not-a-file-but-a-str-is-a-path", [1, 2], []], ids=["int", "path", "ints", "empty"]
)
def test_bad_inputs_raise(data, tmp_path):
    if isinstance(data, str):
        data = str(tmp_path / data)
    with pytest.raises(ao.ArrowOutputsError):
        an.summary(data)


def test_missing_column_raises():
    table = _hand_made_run().drop_columns(["logprobs"])
    with pytest.raises(SchemaMismatchError) as e:
        an.token_logprobs(table)
    assert str(e.value).startswith("logprobs: expected a list<struct<token_ids")
    assert str(e.value).endswith("got no such column")


@pytest.mark.parametrize(
    ("column", "replacement", "fn"),
    [
        ("sampled_token_ids", pa.array([["x"]] * 8), an.token_logprobs),
        ("req_id", pa.array(range(8)), an.per_request),
        ("step", pa.array(["0"] * 8), an.acceptance_lengths),
        ("sampling_mask", pa.array([[1.0]] * 8), an.mask_sizes),
        (
            "logprobs",
            pa.array([[{"token_ids": [1], "logprobs": [1], "rank": 1}]] * 8),
            an.topk_entropy,
        ),
    ],
)
def test_wrong_column_type_raises(column, replacement, fn):
    table = _hand_made_run()
    table = table.set_column(table.schema.get_field_index(column), column, replacement)
    with pytest.raises(SchemaMismatchError) as e:
        fn(table)
    assert e.value.field == column
    assert e.value.got == str(replacement.type)


def _logprobs_table(cells: list[Any], lp_type: pa.DataType | None = None) -> pa.Table:
    lp_type = lp_type or pa.float32()
    struct = pa.struct(
        [("token_ids", pa.list_(pa.int64())), ("logprobs", pa.list_(lp_type)), ("rank", pa.int64())]
    )
    n = len(cells)
    return pa.table(
        {
            "step": pa.array([0] * n, pa.int64()),
            "req_id": pa.array([f"r{i}" for i in range(n)]),
            "sampled_token_ids": pa.array([[1]] * n, pa.list_(pa.int64())),
            "logprobs": pa.array(cells, pa.list_(struct)),
        }
    )


@pytest.mark.parametrize(
    ("cells", "error", "field"),
    [
        ([[None]], SchemaMismatchError, "logprobs"),
        (
            [[{"token_ids": None, "logprobs": [0.0], "rank": 1}]],
            SchemaMismatchError,
            "logprobs.token_ids",
        ),
        (
            [[{"token_ids": [1, None], "logprobs": [0.0, 0.0], "rank": 1}]],
            SchemaMismatchError,
            "logprobs.token_ids",
        ),
        (
            [[{"token_ids": [1], "logprobs": [None], "rank": 1}]],
            SchemaMismatchError,
            "logprobs.logprobs",
        ),
        (
            [[{"token_ids": [1], "logprobs": [0.0], "rank": None}]],
            SchemaMismatchError,
            "logprobs.rank",
        ),
        ([[{"token_ids": [1, 2], "logprobs": [0.0], "rank": 1}]], OffsetsError, "logprobs[0]"),
        ([[{"token_ids": [], "logprobs": [], "rank": 1}]], OffsetsError, "logprobs[0].token_ids"),
    ],
    ids=["null-position", "null-ids", "null-id", "null-logprob", "null-rank", "ragged", "empty"],
)
def test_hostile_logprobs_cells_raise(cells, error, field):
    table = _logprobs_table(cells)
    for fn in (an.token_logprobs, an.topk_entropy):
        with pytest.raises(error) as e:
            fn(table)
        assert e.value.field == field


def test_null_logprobs_cell_is_absent_not_an_error():
    ok = {"token_ids": [1, 1], "logprobs": [-0.5, -0.5], "rank": 1}
    table = _logprobs_table([[ok], None])
    assert an.token_logprobs(table).column("logprob").to_pylist() == [-0.5, None]
    # float64 logprobs (a table built by hand, not by the writer) read the same.
    table64 = _logprobs_table([[ok], None], pa.float64())
    assert an.token_logprobs(table64).column("logprob").to_pylist() == [-0.5, None]


def test_null_ids_and_bad_arguments_raise():
    table = _hand_made_run()
    nulls = table.set_column(1, "req_id", pa.array(["a", None] * 4))
    with pytest.raises(SchemaMismatchError, match="req_id: expected no null request ids"):
        an.per_request(nulls)
    sampled = table.set_column(
        3, "sampled_token_ids", pa.array([[1, None]] * 8, pa.list_(pa.int64()))
    )
    with pytest.raises(SchemaMismatchError, match="sampled_token_ids: expected no null token"):
        an.acceptance_lengths(sampled)
    with pytest.raises(FieldTypeError, match="by: expected 'position' or 'step', got 'request'"):
        an.mask_sizes(table, by="request")  # type: ignore[arg-type]


def test_reference_helpers_catch_a_wrong_result():
    # The comparison itself must fail on a wrong value, or every test above proves nothing.
    table = _hand_made_run()
    wrong = an.token_logprobs(table)
    wrong = wrong.set_column(5, "logprob", pc.add(wrong.column("logprob"), 0.5))
    with pytest.raises(AssertionError):
        _assert_rows(wrong, ref_token_logprobs(table))


def _null_row_spanning_values(values: pa.Array, offsets: list[int], valid: list[bool]) -> pa.Array:
    """A list array whose null rows still span values (legal Arrow: they carry no meaning)."""
    bitmap = pa.array(valid, pa.bool_()).buffers()[1]
    return pa.ListArray.from_buffers(
        pa.list_(values.type),
        len(valid),
        [bitmap, pa.array(offsets, pa.int32()).buffers()[1]],
        children=[values],
    )


def test_null_rows_that_span_values_are_skipped():
    sampled = _null_row_spanning_values(
        pa.array([5, 6, 7, 8], pa.int64()), [0, 1, 3, 4], [True, False, True]
    )
    table = _logprobs_table([[{"token_ids": [5, 5], "logprobs": [-0.5, -0.5], "rank": 1}]] * 3)
    table = table.set_column(2, "sampled_token_ids", sampled)
    assert table.column("sampled_token_ids").to_pylist() == [[5], None, [8]]
    _assert_rows(an.token_logprobs(table), ref_token_logprobs(table))
    _assert_rows(an.acceptance_lengths(table), ref_acceptance_lengths(table))
    masks = _null_row_spanning_values(
        pa.array([[1], [2, 3], [4, 5, 6]], pa.large_list(pa.int32())),
        [0, 1, 2, 3],
        [True, False, True],
    )
    with_masks = table.append_column("sampling_mask", masks)
    _assert_rows(an.mask_sizes(with_masks), ref_mask_sizes(with_masks))
    assert an.mask_sizes(with_masks).column("size").to_pylist() == [1, 3]


def test_invalid_offsets_raise_before_any_read():
    # Offsets that go backwards pass pyarrow's cheap structural check, not the full one.
    values = pa.array([5, 6, 7, 8], pa.int64())
    offsets = pa.array([0, 3, 1, 4], pa.int32()).buffers()[1]
    sampled = pa.ListArray.from_buffers(pa.list_(pa.int64()), 3, [None, offsets], children=[values])
    table = _logprobs_table([None, None, None]).set_column(2, "sampled_token_ids", sampled)
    for fn in (an.token_logprobs, an.acceptance_lengths, an.summary):
        with pytest.raises(OffsetsError) as e:
            fn(table)
        assert e.value.field == "sampled_token_ids"
