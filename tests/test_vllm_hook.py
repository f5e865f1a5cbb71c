"""The vLLM scheduler hook, against a stand-in with vLLM 0.33's signatures (and vLLM itself
where it is importable; it is never downloaded by the tests)."""

from __future__ import annotations

import importlib
import inspect
import multiprocessing
import pickle
import sys
import types

import numpy as np
import pytest

import arrow_outputs as ao
from arrow_outputs import vllm_hook


class StandInScheduler:
    """vLLM 0.33's ``Scheduler`` as far as the hook touches it: the constructor's
    parameters, ``update_from_output`` (which trims token lists in place at a stop, as
    vLLM's ``_update_request_with_output`` does) and ``shutdown``."""

    def __init__(
        self,
        vllm_config,
        kv_cache_config,
        structured_output_manager,
        block_size,
        hash_block_size=None,
        mm_registry=None,
        include_finished_set=False,
        log_stats=False,
    ):
        self.vllm_config = vllm_config
        self.seen = []
        self.closed = False

    def update_from_output(self, scheduler_output, model_runner_output):
        for ids in model_runner_output.sampled_token_ids:
            del ids[1:]  # a stop after the first token
        self.seen.append(scheduler_output)
        return {0: f"outputs of {scheduler_output}"}

    def shutdown(self):
        self.closed = True


class StandInAsyncScheduler(StandInScheduler):
    pass


@pytest.fixture
def fake_vllm(monkeypatch):
    """``vllm.v1.core.sched.{scheduler,async_scheduler}`` in sys.modules, as vLLM lays them."""
    names = ["vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sched = types.ModuleType("vllm.v1.core.sched.scheduler")
    sched.Scheduler = StandInScheduler
    async_sched = types.ModuleType("vllm.v1.core.sched.async_scheduler")
    async_sched.AsyncScheduler = StandInAsyncScheduler
    monkeypatch.setitem(sys.modules, sched.__name__, sched)
    monkeypatch.setitem(sys.modules, async_sched.__name__, async_sched)
    monkeypatch.setattr(vllm_hook, "_built", {})
    return sched


def resolve(qualname: str):
    """What vLLM's ``resolve_obj_by_qualname`` does with ``--scheduler-cls``."""
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def steps():
    out = []
    for s in range(4):
        ids = [f"r{s}-{i}" for i in range(3)]
        out.append(
            ao.ModelRunnerOutput(
                ids,
                {r: i for i, r in enumerate(ids)},
                [[s, s + 1, s + 2], [7], []],
                ao.LogprobsLists(
                    np.arange(8, dtype=np.int64).reshape(4, 2),
                    np.full((4, 2), -0.5, np.float32),
                    np.ones(4, np.int64),
                    [0, 3, 4, 4],
                ),
            )
        )
    return out


def config():
    return types.SimpleNamespace(model_config=types.SimpleNamespace(model="org/tiny-model"))


@pytest.mark.parametrize(
    ("qualname", "base"),
    [
        ("arrow_outputs.vllm_hook.ArrowScheduler", StandInScheduler),
        ("arrow_outputs.vllm_hook.ArrowAsyncScheduler", StandInAsyncScheduler),
    ],
)
def test_scheduler_cls_writes_every_step(fake_vllm, tmp_path, monkeypatch, qualname, base):
    monkeypatch.setenv("ARROW_OUTPUTS_VLLM_PATH", str(tmp_path / "runs" / "{pid}.arrows"))
    cls = resolve(qualname)
    assert issubclass(cls, base)
    assert cls.__name__ == qualname.rpartition(".")[2]
    scheduler = cls(config(), None, None, 16)
    want = steps()
    given = steps()
    results = [scheduler.update_from_output(f"so{i}", out) for i, out in enumerate(given)]
    # vLLM's own method ran, unchanged: its results, its in-place trimming.
    assert results == [{0: f"outputs of so{i}"} for i in range(4)]
    assert given[0].sampled_token_ids == [[0], [7], []]
    scheduler.shutdown()
    assert scheduler.closed
    (path,) = (tmp_path / "runs").iterdir()
    assert path.name == f"{__import__('os').getpid()}.arrows"
    run = ao.open_run(path)
    assert run.complete
    assert ao.run_metadata(run.schema) == {
        "producer": "vllm",
        "scheduler": base.__name__,
        "model": "org/tiny-model",
    }
    # The file has what the model produced, before the scheduler trimmed it.
    for got, expected in zip(run.outputs(), want, strict=True):
        ao.assert_outputs_equal(got, expected)


def test_without_a_path_the_scheduler_is_vllms(fake_vllm, monkeypatch, caplog):
    monkeypatch.delenv("ARROW_OUTPUTS_VLLM_PATH", raising=False)
    scheduler = resolve("arrow_outputs.vllm_hook.ArrowScheduler")(config(), None, None, 16)
    assert scheduler._arrow_writer is None
    assert "ARROW_OUTPUTS_VLLM_PATH is not set" in caplog.text
    assert scheduler.update_from_output("so", steps()[0]) == {0: "outputs of so"}
    scheduler.shutdown()


def test_idle_steps_are_skipped_unless_asked(fake_vllm, tmp_path, monkeypatch):
    empty = ao.ModelRunnerOutput([], {})
    for skip, expected in (("1", 1), ("0", 2)):
        path = tmp_path / f"run{skip}.arrows"
        monkeypatch.setenv("ARROW_OUTPUTS_VLLM_PATH", str(path))
        monkeypatch.setenv("ARROW_OUTPUTS_VLLM_SKIP_EMPTY", skip)
        monkeypatch.setattr(vllm_hook, "_built", {})
        scheduler = resolve("arrow_outputs.vllm_hook.ArrowScheduler")(config(), None, None, 16)
        scheduler.update_from_output("a", empty)
        scheduler.update_from_output("b", steps()[0])
        scheduler.shutdown()
        assert len(ao.open_run(path)) == expected


def test_arrow_scheduler_with_arguments(tmp_path):
    cls = vllm_hook.arrow_scheduler(
        StandInScheduler, str(tmp_path / "run.arrows"), format="file", compression="zstd"
    )
    scheduler = cls(config(), None, None, 16)
    for out in steps():
        scheduler.update_from_output("so", out)
    scheduler.shutdown()
    run = ao.open_run(tmp_path / "run.arrows")
    assert run.format == "file"
    assert len(run) == 4


def _engine_core(scheduler_cls, outputs) -> None:
    """A spawned engine core: vLLM pickles ``scheduler_cls`` with its config for it."""
    scheduler = scheduler_cls(config(), None, None, 16)
    for out in outputs:
        scheduler.update_from_output("so", out)
    scheduler.shutdown()


def test_arrow_scheduler_classes_cross_a_spawned_process(tmp_path, fake_vllm, monkeypatch):
    cls = vllm_hook.arrow_scheduler(
        StandInAsyncScheduler, str(tmp_path / "{pid}.arrows"), format="file", skip_empty=False
    )
    again = pickle.loads(pickle.dumps(cls))
    assert issubclass(again, StandInAsyncScheduler)
    assert again._arrow_recipe == (
        StandInAsyncScheduler,
        str(tmp_path / "{pid}.arrows"),
        False,
        {"format": "file"},
    )
    # The named classes pickle by name, as vLLM resolves them.
    named = resolve("arrow_outputs.vllm_hook.ArrowAsyncScheduler")
    assert pickle.loads(pickle.dumps(named)) is named

    child = multiprocessing.get_context("spawn").Process(target=_engine_core, args=(cls, steps()))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    run = ao.open_run(tmp_path / f"{child.pid}.arrows")
    assert run.format == "file"
    assert run.complete
    assert [len(o.req_ids) for o in run.outputs()] == [3, 3, 3, 3]


def test_environment_errors_are_clear(tmp_path):
    env = {"ARROW_OUTPUTS_VLLM_PATH": str(tmp_path / "x.arrows"), "ARROW_OUTPUTS_VLLM_QUEUE": "x"}
    with pytest.raises(ao.FieldTypeError, match="ARROW_OUTPUTS_VLLM_QUEUE"):
        vllm_hook.writer_from_env(env)
    env["ARROW_OUTPUTS_VLLM_QUEUE"] = "8"
    env["ARROW_OUTPUTS_VLLM_ON_FULL"] = "wait"
    with pytest.raises(ao.FieldTypeError, match="on_full"):
        vllm_hook.writer_from_env(env)
    assert vllm_hook.writer_from_env({}) is None
    with pytest.raises(ao.FieldTypeError, match="base"):
        vllm_hook.arrow_scheduler("Scheduler")
    with pytest.raises(AttributeError):
        vllm_hook.NoSuchScheduler  # noqa: B018


def test_importing_the_hook_does_not_import_vllm():
    import subprocess

    code = "import arrow_outputs.vllm_hook, sys; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_against_vllm_itself():
    vllm_sched = pytest.importorskip("vllm.v1.core.sched.scheduler")
    cls = resolve("arrow_outputs.vllm_hook.ArrowScheduler")
    assert issubclass(cls, vllm_sched.Scheduler)
    ours = inspect.signature(cls.update_from_output)
    theirs = inspect.signature(vllm_sched.Scheduler.update_from_output)
    assert list(ours.parameters)[:3] == list(theirs.parameters)[:3]


def test_without_vllm_the_classes_are_absent_not_an_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # an import of vllm now fails
    monkeypatch.setattr(vllm_hook, "_built", {})
    assert not hasattr(vllm_hook, "ArrowScheduler")
    with pytest.raises(AttributeError, match="cannot be imported"):
        vllm_hook.ArrowAsyncScheduler  # noqa: B018
