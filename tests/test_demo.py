"""The embedded demo engine: its sampler against straightforward references, its model's KV
cache, and whole runs whose files hold what vLLM 0.33's MRv2 would have produced."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

import arrow_outputs as ao
from arrow_outputs.demo import DemoConfig, main, make_requests
from arrow_outputs.demo.engine import run_demo
from arrow_outputs.demo.model import Batch, KVCache, ModelConfig, TinyDecoder
from arrow_outputs.demo.sampler import (
    compute_logprobs,
    count_nans,
    process_logits,
    rejection_sample,
    sample,
    target_probs,
)
from arrow_outputs.progress import Progress
from arrow_outputs.reader import open_run

# A run small enough for a unit test that still has every feature: chunked prefill (prompts
# longer than the token budget), speculative decoding, pooling and NaN-injected requests.
TINY = DemoConfig(
    num_requests=14,
    max_steps=200,
    seed=0,
    vocab_size=2048,
    d_model=32,
    num_layers=2,
    num_heads=2,
    max_num_seqs=6,
    max_num_batched_tokens=48,
    prompt_len=(4, 60),
    output_len=(4, 14),
    arrival_steps=8,
    pooling_fraction=0.2,
    nan_fraction=0.25,
)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    # As run_demo does: tiny ops on shared cores are slower with a thread pool.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- references


def ref_top_k_top_p(row: np.ndarray, k: int, p: float) -> set[int]:
    """vLLM's apply_top_k_top_p for one row, as a loop: k-th value threshold (ties kept),
    then drop ascending tokens while the cumulative probability (theirs included) <= 1 - p,
    never the largest."""
    kept = set(range(len(row)))
    if 0 < k < len(row):
        kth = sorted(row.tolist(), reverse=True)[k - 1]
        kept = {i for i in kept if row[i] >= kth}
    if p < 1.0:
        ids = sorted(kept, key=lambda i: row[i])  # ascending
        m = max(row[i] for i in ids)
        weights = [math.exp(float(row[i]) - m) for i in ids]
        total = sum(weights)
        running = 0.0
        for pos, (i, w) in enumerate(zip(ids, weights)):
            running += w / total
            if running <= 1.0 - p and pos != len(ids) - 1:
                kept.discard(i)
    return kept


def _rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn((rows, vocab), generator=torch.Generator().manual_seed(seed)) * 3


# ----------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("seed", [0, 1])
def test_process_logits_kept_sets_are_vllms(seed: int) -> None:
    vocab = 300
    logits = _rows(8, vocab, seed)
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.0, 2.0, 1.0, 0.5])
    top_k = torch.tensor([0, 5, 40, 0, 20, 0, 300, 1])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 0.95, 0.5, 0.3])
    out = process_logits(logits, temperature, top_k, top_p)
    for r in range(len(logits)):
        t = float(temperature[r]) or 1.0
        scaled = (logits[r] / t).numpy().astype(np.float64)
        want = ref_top_k_top_p(scaled, int(top_k[r]), float(top_p[r]))
        got = set(torch.isfinite(out[r]).nonzero()[:, 0].tolist())
        assert got == want, r
        kept = sorted(want)
        assert torch.allclose(out[r, kept], logits[r, kept] / t)


def test_process_logits_top_p_over_a_large_vocabulary_sorts_only_what_it_needs() -> None:
    # Supports from a handful of ids (the 1024-prefix decides) to most of the vocabulary
    # (a wider prefix, then a full sort): the kept sets are vLLM's in every case.
    vocab = 12_000
    logits = _rows(5, vocab, 3)
    temperature = torch.tensor([0.5, 1.0, 1.6, 3.0, 8.0])
    top_p = torch.tensor([0.8, 0.95, 0.98, 0.99, 0.999])
    out = process_logits(logits, temperature, torch.zeros(5, dtype=torch.int64), top_p)
    sizes = []
    for r in range(5):
        scaled = (logits[r] / temperature[r]).numpy().astype(np.float64)
        want = ref_top_k_top_p(scaled, 0, float(top_p[r]))
        assert set(torch.isfinite(out[r]).nonzero()[:, 0].tolist()) == want, r
        sizes.append(len(want))
    assert sizes[0] < 1024 < sizes[2]
    assert sizes[-1] > 8192


def test_process_logits_keeps_ties_at_the_kth_value() -> None:
    logits = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0]])
    out = process_logits(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, True, True, False]


def test_target_probs_are_one_hot_for_greedy_rows() -> None:
    processed = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    probs = target_probs(processed, torch.tensor([True, False]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    assert torch.allclose(probs[1], processed[1].softmax(-1))


def test_compute_logprobs_ranks_and_top_ids_match_a_reference() -> None:
    logits = _rows(6, 50, 7)
    logits[2, [3, 9]] = logits[2].max() + 1  # a tie for first place
    tokens = torch.tensor([0, 5, 9, 49, 12, 30])
    ids, vals, ranks = compute_logprobs(logits, tokens, 4)
    ref = logits.double().log_softmax(-1)
    for r in range(len(logits)):
        row = ref[r].tolist()
        chosen = row[int(tokens[r])]
        # vLLM's batched_count_greater_than: the count of logprobs >= the chosen one.
        assert int(ranks[r]) == sum(x >= chosen for x in row)
        assert int(ids[r, 0]) == int(tokens[r])
        top = sorted(range(50), key=lambda i: -row[i])[:4]
        assert sorted(ids[r, 1:].tolist()) == sorted(top)
        assert np.allclose(vals[r].numpy(), [row[i] for i in ids[r].tolist()], atol=1e-5)
    assert int(ranks[2]) == 2  # the tie: both share the larger rank
    assert ids.dtype == torch.int64
    assert vals.dtype == torch.float32
    assert ranks.dtype == torch.int64


def test_count_nans_per_row() -> None:
    x = torch.zeros(3, 10)
    x[0, [1, 2]] = float("nan")
    x[2, 9] = float("nan")
    assert count_nans(x).tolist() == [2, 0, 1]
    assert count_nans(x).dtype == torch.int32


def test_sample_follows_the_distribution_and_skips_zero_probability() -> None:
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0]).repeat(40_000, 1)
    tokens = sample(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=5).double() / len(tokens)
    assert freq[1] == 0
    assert freq[4] == 0
    assert torch.allclose(freq, probs[0].double(), atol=0.01)


def test_rejection_sample_accepted_prefix_matches_a_reference() -> None:
    n, k, vocab = 64, 3, 12
    g = torch.Generator().manual_seed(5)
    target = torch.rand((n, k + 1, vocab), generator=g).softmax(-1)
    draft = torch.rand((n, k, vocab), generator=g).softmax(-1)
    num_draft = torch.randint(0, k + 1, (n,), generator=g)
    draft_ids = torch.stack([sample(draft[:, j], g) for j in range(k)], 1)
    out, num = rejection_sample(
        target, draft, draft_ids, num_draft, torch.Generator().manual_seed(9)
    )
    u = torch.rand((n, k), generator=torch.Generator().manual_seed(9))  # the same draws
    for r in range(n):
        accepted = 0
        for j in range(int(num_draft[r])):
            d = int(draft_ids[r, j])
            if float(u[r, j]) < min(1.0, float(target[r, j, d] / draft[r, j, d])):
                accepted += 1
            else:
                break
        assert int(num[r]) == accepted + 1
        assert out[r, :accepted].tolist() == draft_ids[r, :accepted].tolist()
        last = int(out[r, accepted])
        if accepted < int(num_draft[r]):  # recovered from the residual max(p - q, 0)
            assert float(target[r, accepted, last]) > float(draft[r, accepted, last])
        assert out[r, accepted + 1 :].tolist() == [-1] * (k - accepted)
    assert (num > 1).any()
    assert (num < num_draft + 1).any()


def test_rejection_sample_keeps_the_target_distribution() -> None:
    # Whatever the drafter proposes, the first token follows the target distribution.
    n, vocab = 60_000, 4
    p = torch.tensor([0.1, 0.4, 0.3, 0.2])
    q = torch.tensor([0.4, 0.1, 0.1, 0.4])
    g = torch.Generator().manual_seed(1)
    drafts = sample(q.repeat(n, 1), g)[:, None]
    out, num = rejection_sample(
        p.repeat(n, 2, 1), q.repeat(n, 1, 1), drafts, torch.ones(n, dtype=torch.int64), g
    )
    freq = torch.bincount(out[:, 0], minlength=vocab).double() / n
    assert torch.allclose(freq, p.double(), atol=0.01)
    accept_rate = float((num == 2).double().mean())
    assert abs(accept_rate - float(torch.minimum(p, q).sum())) < 0.01


def test_rejection_sample_with_a_greedy_target_accepts_the_argmax_only() -> None:
    target = torch.zeros(2, 3, 5)
    target[:, :, 2] = 1.0  # argmax 2 everywhere
    draft = torch.full((2, 2, 5), 0.2)
    draft_ids = torch.tensor([[2, 2], [2, 4]])
    out, num = rejection_sample(target, draft, draft_ids, torch.tensor([2, 2]))
    assert out.tolist() == [[2, 2, 2], [2, 2, -1]]
    assert num.tolist() == [3, 2]


# ----------------------------------------------------------------------------- model


def test_model_kv_cache_gives_the_same_states_in_chunks_and_batches() -> None:
    cfg = ModelConfig(vocab_size=500, d_model=32, num_heads=2, num_layers=2, max_model_len=32)
    model = TinyDecoder(cfg)
    toks = torch.randint(0, 500, (10,), generator=torch.Generator().manual_seed(0))
    whole = model(
        Batch(toks, torch.arange(10), torch.tensor([1]), torch.tensor([10])),
        KVCache(cfg, 3, torch.device("cpu")),
    )
    cache = KVCache(cfg, 3, torch.device("cpu"))
    other = torch.randint(0, 500, (6,), generator=torch.Generator().manual_seed(1))
    parts = [model(Batch(toks[:4], torch.arange(4), torch.tensor([2]), torch.tensor([4])), cache)]
    mixed = Batch(
        torch.cat([other, toks[4:7]]),
        torch.cat([torch.arange(6), torch.arange(4, 7)]),
        torch.tensor([0, 2]),
        torch.tensor([6, 3]),
    )
    parts.append(model(mixed, cache)[6:])
    for i in range(7, 10):
        parts.append(
            model(
                Batch(toks[i : i + 1], torch.tensor([i]), torch.tensor([2]), torch.tensor([1])),
                cache,
            )
        )
    assert torch.allclose(torch.cat(parts), whole, atol=1e-5)


def test_model_weights_are_seeded() -> None:
    cfg = ModelConfig(vocab_size=100, d_model=16, num_heads=2, num_layers=1, max_model_len=8)
    a, b = TinyDecoder(cfg), TinyDecoder(cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = TinyDecoder(ModelConfig(**{**cfg.__dict__, "seed": 1}))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


# ----------------------------------------------------------------------------- whole runs


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("demo") / "run.arrow"
    summary = run_demo(
        path,
        num_requests=TINY.num_requests,
        max_steps=TINY.max_steps,
        seed=TINY.seed,
        progress=False,
        config=TINY,
    )
    return path, summary


def _specs() -> dict[str, Any]:
    return {s.req_id: s for s in make_requests(TINY)}


def test_demo_workload_has_every_kind_of_request() -> None:
    specs = list(_specs().values())
    assert any(s.kind == "pool" for s in specs)
    assert any(s.inject_nans for s in specs)
    assert any(s.params.prompt_logprobs is not None for s in specs)
    assert any(len(s.prompt) > TINY.max_num_batched_tokens for s in specs)  # chunked prefill
    assert len({s.arrival for s in specs}) > 3  # requests arrive over time


def test_demo_run_file_is_complete_and_decodes(tiny_run: tuple[Path, Any]) -> None:
    path, summary = tiny_run
    run = open_run(path)
    assert run.complete
    assert summary.complete
    outputs = list(run.outputs())
    assert len(outputs) == summary.steps == len(run)
    assert all(isinstance(o, ao.ModelRunnerOutput) for o in outputs)
    meta = ao.run_metadata(run.schema)
    assert meta["producer"] == "arrow-outputs demo"
    assert meta["config"]["vocab_size"] == TINY.vocab_size
    assert summary.requests == TINY.num_requests  # every request ran


def test_demo_generation_requests_get_exactly_their_tokens(tiny_run: tuple[Path, Any]) -> None:
    path, summary = tiny_run
    specs = _specs()
    tokens: dict[str, list[int]] = {}
    for out in open_run(path).outputs():
        for req_id, ids in zip(out.req_ids, out.sampled_token_ids):
            tokens.setdefault(req_id, []).extend(ids)
    gen = {r: s for r, s in specs.items() if s.kind == "generate"}
    assert {r: len(tokens[r]) for r in gen} == {r: s.params.max_tokens for r, s in gen.items()}
    assert summary.tokens == sum(s.params.max_tokens for s in gen.values())
    assert all(0 <= t < TINY.vocab_size for ids in tokens.values() for t in ids)


def test_demo_speculative_rows_have_cu_num_generated_tokens(tiny_run: tuple[Path, Any]) -> None:
    path, summary = tiny_run
    spec_steps = 0
    for out in open_run(path).outputs():
        lp = out.logprobs
        if lp is None:
            continue
        cu = lp.cu_num_generated_tokens
        assert cu is not None
        assert len(cu) == len(out.req_ids) + 1
        sampled = [len(x) for x in out.sampled_token_ids]
        positions = np.diff(cu)
        assert (positions >= np.maximum(sampled, 1)).all()
        if cu[-1] > sum(sampled):  # rejected drafts keep their rows, with token id 0
            spec_steps += 1
        for i, ids in enumerate(out.sampled_token_ids):
            rows = lp.logprob_token_ids[cu[i] : cu[i + 1], 0]
            assert rows[: len(ids)].tolist() == ids  # column 0 is the sampled token
            if ids:
                assert (rows[len(ids) :] == 0).all()
        assert (lp.sampled_token_ranks >= 1).all()
    assert spec_steps > 0
    assert summary.speculative_rows > 0
    assert max(summary.acceptance) > 1
    assert min(summary.acceptance) == 1


def test_demo_prompt_logprobs_cover_prompt_len_minus_one(tiny_run: tuple[Path, Any]) -> None:
    path, _ = tiny_run
    specs = _specs()
    rows: dict[str, list[np.ndarray]] = {}
    for out in open_run(path).outputs():
        for req_id, lp in out.prompt_logprobs_dict.items():
            rows.setdefault(req_id, []).append(lp.logprob_token_ids.numpy())
            assert lp.logprob_token_ids.shape[1] == specs[req_id].params.prompt_logprobs + 1
    want = {r for r, s in specs.items() if s.params.prompt_logprobs is not None}
    assert set(rows) == want
    assert want
    for req_id, chunks in rows.items():
        ids = np.concatenate(chunks)
        # One row per prompt position after the first, scoring that prompt token.
        assert ids[:, 0].tolist() == list(specs[req_id].prompt[1:])


def test_demo_masks_are_the_sampling_support(tiny_run: tuple[Path, Any]) -> None:
    path, summary = tiny_run
    specs = _specs()
    checked = wide = 0
    for out in open_run(path).outputs():
        if out.sampling_masks is None:
            continue
        masks = out.sampling_masks
        nested = masks.to_nested_list()
        cu = masks.cu_num_generated_tokens
        assert cu is not None  # several rows per request: one per sampled position
        for i, (req_id, ids) in enumerate(zip(out.req_ids, out.sampled_token_ids)):
            assert cu[i + 1] - cu[i] == len(ids)
            p = specs[req_id].params
            for tok, row in zip(ids, nested[cu[i] : cu[i + 1]]):
                assert tok in row
                assert row == sorted(row)
                if p.top_k and p.top_p == 1.0:
                    assert len(row) == p.top_k  # continuous logits: no ties at the k-th
                elif p.top_k:
                    assert 1 <= len(row) <= p.top_k
                wide += len(row) > max(s.params.top_k for s in specs.values())
                checked += 1
    assert checked == summary.tokens
    assert summary.mask_positions == checked
    assert wide > 0  # some rows (top-p alone) were read back from the bitmask


def test_demo_nan_counts_belong_to_the_injected_requests(tiny_run: tuple[Path, Any]) -> None:
    path, summary = tiny_run
    specs = _specs()
    table = open_run(path).read_all()
    gen = table.filter(pc.is_valid(table.column("num_nans_in_logits")))
    counts: dict[str, int] = {}
    for req_id, n in zip(
        gen.column("req_id").to_pylist(), gen.column("num_nans_in_logits").to_pylist()
    ):
        counts[req_id] = counts.get(req_id, 0) + n
    for req_id, n in counts.items():
        assert (n > 0) == specs[req_id].inject_nans, req_id
    assert summary.nans_in_logits == sum(counts.values()) > 0


def test_demo_pooling_rows_are_unit_vectors(tiny_run: tuple[Path, Any]) -> None:
    path, summary = tiny_run
    specs = _specs()
    pooled: dict[str, Any] = {}
    for out in open_run(path).outputs():
        if out.pooler_output is None:
            continue
        assert out.sampled_token_ids == []  # a pooling step samples nothing
        for req_id, row in zip(out.req_ids, out.pooler_output):
            if row is not None:
                pooled[req_id] = row
    assert set(pooled) == {r for r, s in specs.items() if s.kind == "pool"}
    for row in pooled.values():
        assert tuple(row.shape) == (TINY.d_model,)
        assert abs(float(row.norm()) - 1.0) < 1e-5
    assert summary.pooler_rows == len(pooled) == summary.pooling_requests
    field = open_run(path).schema.field("pooler_output")
    assert isinstance(field.type, pa.FixedShapeTensorType)


def test_demo_summary_is_computed_from_the_file(tiny_run: tuple[Path, Any]) -> None:
    path, summary = tiny_run
    from arrow_outputs import analysis

    base = analysis.summary(open_run(path).read_all())
    assert summary.mean_logprob == base["mean_logprob"] < 0
    assert summary.perplexity == pytest.approx(math.exp(-summary.mean_logprob))
    assert summary.steps_per_second is not None
    assert summary.steps_per_second > 0
    text = summary.format()
    for word in ("requests", "tokens", "steps/s", "perplexity", "acceptance", "mask sizes"):
        assert word in text
    assert summary.to_dict()["acceptance"]


def test_demo_same_seed_same_run(tmp_path: Path) -> None:
    cfg = DemoConfig(**{**TINY.__dict__, "num_requests": 5, "max_steps": 12})
    a, b = (
        run_demo(
            tmp_path / name,
            num_requests=5,
            max_steps=12,
            seed=TINY.seed,
            progress=False,
            config=cfg,
        )
        for name in ("a.arrow", "b.arrow")
    )
    ta, tb = open_run(a.path).read_all(), open_run(b.path).read_all()
    assert ta.column("sampled_token_ids").equals(tb.column("sampled_token_ids"))
    assert ta.column("logprobs").equals(tb.column("logprobs"))


def test_demo_without_speculative_decoding_has_one_row_per_request(tmp_path: Path) -> None:
    cfg = DemoConfig(**{**TINY.__dict__, "num_speculative_tokens": 0})
    summary = run_demo(
        tmp_path / "r.arrow", num_requests=6, max_steps=40, seed=1, progress=False, config=cfg
    )
    for out in open_run(summary.path).outputs():
        if out.logprobs is not None:
            assert out.logprobs.cu_num_generated_tokens is None
            assert len(out.logprobs.logprob_token_ids) == len(out.req_ids)
        assert all(len(ids) <= 1 for ids in out.sampled_token_ids)
    assert summary.speculative_rows == 0


def test_demo_batches_continuously_with_chunked_prefill(tiny_run: tuple[Path, Any]) -> None:
    path, _ = tiny_run
    table = open_run(path).read_all()
    steps = table.column("step").to_numpy()
    rows_per_step = np.bincount(steps)
    assert rows_per_step.max() <= TINY.max_num_seqs
    assert rows_per_step.max() > 1
    # Requests join and leave while others run: first steps differ, last steps differ.
    per = {}
    for step, req in zip(steps.tolist(), table.column("req_id").to_pylist()):
        per.setdefault(req, []).append(step)
    assert len({v[0] for v in per.values()}) > 3
    assert len({v[-1] for v in per.values()}) > 3
    # A mid-prompt chunk samples nothing ([]) in a step where others decode.
    lens = pc.list_value_length(table.column("sampled_token_ids")).to_numpy(zero_copy_only=False)
    mid = {int(s) for s, n in zip(steps, lens) if n == 0}
    busy = {int(s) for s, n in zip(steps, lens) if n > 0}
    assert mid & busy


def test_demo_steps_give_the_same_batch_by_both_async_exits() -> None:
    # The runner's MRv2 tensors through AsyncArrowOutput: the vectorised record batch equals
    # the record batch of vLLM's get_output() lists, step after step.
    from arrow_outputs.demo.runner import ModelRunner, Scheduler

    pool = ao.StagingPool(max_slabs=4)
    runner, scheduler = ModelRunner(TINY, pool), Scheduler(TINY, make_requests(TINY))
    kinds = set()
    for step in range(14):
        sched = scheduler.schedule(step)
        if sched is None:
            continue
        async_output, result = runner.execute(sched)
        kinds.add(sched.kind)
        batch = async_output.get_record_batch(step=step)
        expected = ao.to_record_batch(async_output.get_output(), step=step)
        assert batch.equals(expected), step
        scheduler.update(sched, result)
    assert kinds == {"generate", "pool"}


def test_run_demo_keeps_config_values_and_refuses_unknown_fields(tmp_path: Path) -> None:
    cfg = DemoConfig(**{**TINY.__dict__, "num_requests": 2, "max_steps": 3})
    summary = run_demo(tmp_path / "k.arrow", progress=False, config=cfg)
    assert summary.steps == 3  # the config's max_steps, not run_demo's
    assert ao.run_metadata(open_run(summary.path).schema)["config"]["num_requests"] == 2
    with pytest.raises(ao.FieldTypeError, match="top_k_everywhere"):
        run_demo(tmp_path / "u.arrow", progress=False, top_k_everywhere=5)


def test_demo_config_refuses_bad_values() -> None:
    with pytest.raises(ao.ArrowOutputsError, match=r"DemoConfig\.num_requests"):
        DemoConfig(num_requests=0)
    with pytest.raises(ao.ArrowOutputsError, match=r"DemoConfig\.prompt_len"):
        DemoConfig(prompt_len=(9, 3))
    with pytest.raises(ao.ArrowOutputsError, match=r"DemoConfig\.draft_layers"):
        DemoConfig(num_layers=2, draft_layers=3)
    with pytest.raises(ao.ArrowOutputsError, match="device"):
        run_demo("unused.arrow", device="tpu", progress=False)


def test_demo_main_runs_and_prints_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "cli.arrow"
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        code = main(["--requests", "3", "--steps", "6", "--out", str(out), "--no-progress"])
    assert code == 0
    run = open_run(out)
    assert run.complete
    assert len(run) == 6
    text = stdout.getvalue()
    assert "steps           6 " in text
    assert "complete" in text


def test_demo_main_bad_arguments_give_one_line_and_exit_2(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is there: --device cuda is valid")
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        code = main(["--device", "cuda", "--out", str(tmp_path / "x.arrow"), "--no-progress"])
    assert code == 2
    lines = stderr.getvalue().strip().splitlines()
    assert len(lines) == 1
    assert "device" in lines[0]


def test_progress_bar_draws_to_its_stream() -> None:
    out = io.StringIO()
    bar = Progress(10, "demo", file=out, interval=0)
    bar.update(5, tokens=3)
    bar.close()
    assert "demo  50%" in out.getvalue()
    assert "tokens=3" in out.getvalue()


@pytest.mark.gpu
def test_demo_on_cuda_stages_through_pinned_memory(cuda_device: Any, tmp_path: Path) -> None:
    cfg = DemoConfig(**{**TINY.__dict__, "device": str(cuda_device)})
    summary = run_demo(
        tmp_path / "gpu.arrow",
        num_requests=8,
        max_steps=60,
        seed=2,
        device=str(cuda_device),
        progress=False,
        config=cfg,
    )
    assert summary.complete
    assert summary.tokens > 0
    assert all(isinstance(o, ao.ModelRunnerOutput) for o in open_run(summary.path).outputs())
