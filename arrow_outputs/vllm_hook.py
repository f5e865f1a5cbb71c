"""Stream every step's ``ModelRunnerOutput`` out of vLLM into an ``OutputWriter``, unpatched.

vLLM 0.33 takes a scheduler class by name (``--scheduler-cls``, ``SchedulerConfig.scheduler_cls``)
and hands it every step's ``ModelRunnerOutput`` in ``update_from_output(scheduler_output,
model_runner_output)``, in the engine-core process. The classes here are vLLM's own
schedulers with that one method wrapped: the output is queued to an
:class:`~arrow_outputs.OutputWriter` (encoded and written on its thread), then vLLM's method
runs as before.

- ``arrow_outputs.vllm_hook.ArrowAsyncScheduler``: vLLM's ``AsyncScheduler`` (async
  scheduling, vLLM's default where it is on).
- ``arrow_outputs.vllm_hook.ArrowScheduler``: vLLM's ``Scheduler``.

They are built on first access, so importing this module does not import vLLM. Configure them
with environment variables (the engine core inherits them)::

    ARROW_OUTPUTS_VLLM_PATH=runs/{pid}.arrows \\
    vllm serve MODEL --scheduler-cls arrow_outputs.vllm_hook.ArrowAsyncScheduler

or, from Python, build a class with :func:`arrow_scheduler` and pass it as ``scheduler_cls``.
"""

from __future__ import annotations

import atexit
import copy
import copyreg
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, cast

from .errors import FieldTypeError
from .writer import OutputWriter

# ArrowScheduler and ArrowAsyncScheduler too, built on access (not listed: `import *` would
# import vLLM).
__all__ = ["ENV", "arrow_scheduler", "writer_from_env"]

log = logging.getLogger(__name__)

#: The environment variables read by :func:`writer_from_env`, with their defaults.
ENV = {
    "ARROW_OUTPUTS_VLLM_PATH": None,  # the run file; "{pid}" becomes the process id
    "ARROW_OUTPUTS_VLLM_FORMAT": "stream",
    "ARROW_OUTPUTS_VLLM_COMPRESSION": "",  # "", "lz4" or "zstd"
    "ARROW_OUTPUTS_VLLM_QUEUE": "256",
    "ARROW_OUTPUTS_VLLM_ON_FULL": "block",  # or "drop": never slow the engine, count drops
    "ARROW_OUTPUTS_VLLM_SKIP_EMPTY": "1",  # skip steps with no request and no connector output
}

_BASES = {
    "ArrowScheduler": ("vllm.v1.core.sched.scheduler", "Scheduler"),
    "ArrowAsyncScheduler": ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler"),
}
_built: dict[str, type] = {}
_lock = threading.Lock()


def writer_from_env(
    environ: Any = None, *, run_metadata: dict[str, Any] | None = None
) -> OutputWriter | None:
    """An :class:`OutputWriter` configured by the ``ARROW_OUTPUTS_VLLM_*`` variables
    (:data:`ENV`), or ``None`` when ``ARROW_OUTPUTS_VLLM_PATH`` is unset or empty."""
    env = os.environ if environ is None else environ

    def get(name: str) -> str:
        value = env.get(name)
        return (ENV[name] or "") if value is None else value

    path = get("ARROW_OUTPUTS_VLLM_PATH")
    if not path:
        return None
    queue = get("ARROW_OUTPUTS_VLLM_QUEUE")
    if not queue.isdigit():
        raise FieldTypeError("ARROW_OUTPUTS_VLLM_QUEUE", "a number of steps", repr(queue))
    path = path.replace("{pid}", str(os.getpid()))
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    return OutputWriter(
        path,
        format=get("ARROW_OUTPUTS_VLLM_FORMAT"),
        compression=get("ARROW_OUTPUTS_VLLM_COMPRESSION") or None,
        queue_size=int(queue),
        on_full=get("ARROW_OUTPUTS_VLLM_ON_FULL"),
        run_metadata=run_metadata,
    )


class _Recording:
    """The mixin: vLLM's scheduler with ``update_from_output`` also writing the output."""

    _arrow_writer: OutputWriter | None
    _arrow_writer_factory: Any = None
    _arrow_skip_empty: bool | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        factory = type(self)._arrow_writer_factory
        meta = _run_metadata(self)
        self._arrow_writer = (
            writer_from_env(run_metadata=meta) if factory is None else factory(meta)
        )
        skip = type(self)._arrow_skip_empty
        if skip is None:
            skip = os.environ.get("ARROW_OUTPUTS_VLLM_SKIP_EMPTY", "1") != "0"
        self._arrow_skip = skip
        if self._arrow_writer is None:
            log.warning("arrow_outputs: ARROW_OUTPUTS_VLLM_PATH is not set; no outputs written")
        else:
            atexit.register(self._arrow_close)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        writer = self._arrow_writer
        if writer is not None and not (self._arrow_skip and _empty(model_runner_output)):
            # vLLM trims sampled-token lists in place at stop tokens: keep what the model
            # produced (the lists are copied; arrays are shared, vLLM does not change them).
            writer.write(_snapshot(model_runner_output))
        return super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            self._arrow_close()

    def _arrow_close(self) -> None:
        writer, self._arrow_writer = self._arrow_writer, None
        if writer is not None:
            writer.close()


def _snapshot(output: Any) -> Any:
    sampled = getattr(output, "sampled_token_ids", None)
    if not sampled:
        return output
    copied = copy.copy(output)
    copied.sampled_token_ids = [list(ids) for ids in sampled]
    return copied


def _empty(output: Any) -> bool:
    return not output.req_ids and all(
        getattr(output, name, None) is None
        for name in ("kv_connector_output", "ec_connector_output")
    )


def _run_metadata(scheduler: Any) -> dict[str, Any]:
    config = getattr(scheduler, "vllm_config", None)
    model = getattr(getattr(config, "model_config", None), "model", None)
    base = next(c for c in type(scheduler).__mro__[1:] if c is not _Recording)
    meta: dict[str, Any] = {"producer": "vllm", "scheduler": base.__name__}
    if isinstance(model, str):
        meta["model"] = model
    return meta


def arrow_scheduler(
    base: type,
    path: str | None = None,
    *,
    skip_empty: bool = True,
    **writer_options: Any,
) -> type:
    """A subclass of the scheduler class ``base`` that writes every step's output.

    Parameters
    ----------
    base
        vLLM's ``Scheduler`` or ``AsyncScheduler`` (or any class with their
        ``update_from_output`` and ``shutdown``).
    path
        The run file (``"{pid}"`` becomes the process id); ``None``: the environment
        variables (:func:`writer_from_env`).
    skip_empty
        Skip steps with no request and no connector output (idle engine steps).
    writer_options
        Passed to :class:`OutputWriter` (``format``, ``compression``, ``queue_size``,
        ``on_full``).
    """
    if not isinstance(base, type):
        raise FieldTypeError("base", "a scheduler class", type(base).__name__)
    factory: Callable[[dict[str, Any]], OutputWriter] | None = None
    if path is not None:

        def make(meta: dict[str, Any]) -> OutputWriter:
            return OutputWriter(
                path.replace("{pid}", str(os.getpid())), run_metadata=meta, **writer_options
            )

        factory = make

    elif writer_options:
        raise FieldTypeError("path", "a path when writer options are given", "None")
    return _picklable_meta(type(base))(
        f"Arrow{base.__name__}",
        (_Recording, base),
        {
            "_arrow_writer_factory": None if factory is None else staticmethod(factory),
            "_arrow_skip_empty": skip_empty,
            "_arrow_recipe": (base, path, skip_empty, writer_options),
            "__module__": __name__,
            "__qualname__": f"Arrow{base.__name__}",
        },
    )


# vLLM may start its engine core with `spawn` and then pickles `scheduler_cls` with the
# config. A class made here is not reachable by its name, so pickling by reference would fail:
# its metaclass reduces it to the call that makes it again (the base pickles by reference).
_metas: dict[type, type] = {}
_metas_lock = threading.Lock()  # not _lock: __getattr__ holds that one while it builds


def _picklable_meta(meta: type) -> type:
    with _metas_lock:
        made = _metas.get(meta)
        if made is None:
            made = _metas[meta] = type(f"_Arrow{meta.__name__}", (meta,), {})
            copyreg.pickle(made, _reduce_class)
    return made


def _reduce_class(cls: Any) -> tuple[Any, tuple[Any, ...]]:
    name = cls.__dict__.get("_arrow_name")
    if name is not None:  # ArrowScheduler / ArrowAsyncScheduler: by name, as vLLM does
        return _named_class, (name,)
    base, path, skip_empty, writer_options = cls.__dict__["_arrow_recipe"]
    return _rebuild_class, (base, path, skip_empty, writer_options)


def _named_class(name: str) -> type:
    return __getattr__(name)


def _rebuild_class(
    base: type, path: str | None, skip_empty: bool, writer_options: dict[str, Any]
) -> type:
    return arrow_scheduler(base, path, skip_empty=skip_empty, **writer_options)


def __getattr__(name: str) -> type:
    """``ArrowScheduler`` / ``ArrowAsyncScheduler``, built from vLLM's classes on access."""
    if name not in _BASES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _lock:
        if name not in _built:
            import importlib

            module, cls = _BASES[name]
            try:
                base = getattr(importlib.import_module(module), cls)
            except ImportError as e:  # hasattr() says False; the message says why
                raise AttributeError(
                    f"module {__name__!r} has no attribute {name!r}: it is built from vLLM's "
                    f"{module}.{cls}, which cannot be imported ({e})"
                ) from e
            built = arrow_scheduler(base)
            built.__name__ = built.__qualname__ = name
            cast(Any, built)._arrow_skip_empty = None  # the environment decides
            cast(Any, built)._arrow_name = name
            _built[name] = built
    return _built[name]
