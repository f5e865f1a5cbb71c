"""``run_demo``: the embedded engine loop, from a seeded workload to a summarised run file.

Each engine step the scheduler picks the work, the model runner executes it and hands back
vLLM 0.33's async output (:class:`~arrow_outputs.AsyncArrowOutput`, or
:class:`~arrow_outputs.AsyncArrowPoolingOutput` for a pooling step), and the engine queues
that object on an :class:`~arrow_outputs.OutputWriter`, whose thread builds the record batch
from the staged tensors and appends it to the IPC file while the next step runs. After the
last step the writer closes the run with its end marker and the summary is computed from the
file.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

from ..device import StagingPool
from ..errors import FieldTypeError, UnsupportedValueError
from ..progress import progress_bar
from ..schema import ColumnTypes, output_schema
from ..tensors import TensorSpec
from ..writer import OutputWriter
from .config import DemoConfig, make_requests
from .runner import ModelRunner, Scheduler
from .summary import DemoSummary, summarize

__all__ = ["run_demo"]

# Steps the writer may hold queued; the staging pool has a slab for each, and two spare.
_QUEUE_SIZE = 16


def _check_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UnsupportedValueError("device", "'cpu' or 'cuda[:N]'", repr(device)) from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedValueError("device", "an available device", f"{device!r} (no CUDA)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UnsupportedValueError(
                "device", f"cuda:0..{torch.cuda.device_count() - 1}", repr(device)
            )
    elif dev.type != "cpu":
        raise UnsupportedValueError("device", "'cpu' or 'cuda[:N]'", repr(device))
    return dev


def run_demo(
    out_path: str | os.PathLike[str],
    *,
    num_requests: int | None = None,
    max_steps: int | None = None,
    device: str | None = None,
    seed: int | None = None,
    progress: bool = True,
    config: DemoConfig | None = None,
    **overrides: Any,
) -> DemoSummary:
    """Run the demo engine and write every step to an Arrow IPC file at ``out_path``.

    Parameters
    ----------
    out_path
        The run file to create (IPC file format; overwritten).
    num_requests, max_steps, device, seed
        The main knobs (see :class:`~arrow_outputs.demo.DemoConfig`; None keeps the
        config's value: 64 requests, 400 steps at most, ``"cpu"``, seed 0 by default).
        ``device="cuda"`` runs the model and the sampler on the GPU and stages outputs
        through pinned memory.
    progress
        Show a progress bar on stderr.
    config
        A whole :class:`~arrow_outputs.demo.DemoConfig` instead of the defaults; the keyword
        arguments above that are not None, and ``overrides`` (any other config field),
        replace its fields.

    Returns
    -------
    DemoSummary
        Computed from the written file.

    Raises
    ------
    ArrowOutputsError
        A bad config value or device (the message names it), or a writer failure.

    Examples
    --------
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "run.arrow")
    >>> s = run_demo(path, num_requests=4, max_steps=30, progress=False,
    ...              vocab_size=1024, d_model=32, prompt_len=(4, 12), output_len=(2, 6))
    >>> s.complete, s.requests
    (True, 4)
    """
    base = config if config is not None else DemoConfig()
    knobs: dict[str, Any] = {
        "num_requests": num_requests,
        "max_steps": max_steps,
        "device": device,
        "seed": seed,
    }
    changes = {k: v for k, v in knobs.items() if v is not None}
    changes.update(overrides)
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(DemoConfig)})
    if unknown:
        raise FieldTypeError("run_demo", "DemoConfig fields as keywords", ", ".join(unknown))
    cfg = dataclasses.replace(base, **changes)
    dev = _check_device(cfg.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, dev, out_path, progress)
    finally:
        torch.set_num_threads(threads)


def _run(
    cfg: DemoConfig, dev: torch.device, out_path: str | os.PathLike[str], progress: bool
) -> DemoSummary:
    specs = make_requests(cfg)
    pool = StagingPool(max_slabs=_QUEUE_SIZE + 2, pin=dev.type == "cuda")
    runner = ModelRunner(cfg, pool)
    scheduler = Scheduler(cfg, specs)
    run_meta = {
        "producer": "arrow-outputs demo",
        "model": f"tiny-decoder-{cfg.num_layers}x{cfg.d_model}-v{cfg.vocab_size}",
        "config": cfg.to_json(),
    }
    # Declared up front: pooler rows are fixed-shape [d_model] tensors (one zero-copy column),
    # whichever kind of step comes first.
    schema = output_schema(ColumnTypes(pooler_output=TensorSpec("float32", 1, (cfg.d_model,))))
    # Progress in requests served (the run's length in steps is known only at its end).
    bar = progress_bar(len(specs), "requests", enabled=progress)
    start = time.perf_counter()
    clock = 0
    steps = tokens = 0
    with OutputWriter(
        out_path,
        format="file",
        compression=cfg.compression,
        queue_size=_QUEUE_SIZE,
        run_metadata=run_meta,
        schema=schema,
    ) as writer:
        try:
            while steps < cfg.max_steps and not scheduler.done:
                sched = scheduler.schedule(clock)
                if sched is None:  # idle until the next request arrives
                    arrival = scheduler.next_arrival()
                    if arrival is None:  # nothing can ever run (not reached: a guard)
                        break
                    clock = max(clock + 1, arrival)
                    continue
                async_output, result = runner.execute(sched)
                writer.write(async_output)
                finished = scheduler.update(sched, result)
                steps += 1
                clock += 1
                tokens += sum(len(t) for t in result.new_tokens)
                bar.update(len(finished), step=steps, tokens=tokens)
        finally:
            bar.close()
    elapsed = time.perf_counter() - start
    return summarize(out_path, elapsed_s=elapsed)
