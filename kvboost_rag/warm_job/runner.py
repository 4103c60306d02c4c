"""Running a warm job: in this process, or split over Ray actors.

The corpus is cut into batches. The first batch runs alone first (on one worker), so the
corpus's first documents, which every worker warms the others behind, are stored once; the
rest goes to the workers as they free up, two batches in flight each. Documents already in
the shared store are found and skipped, so a job killed midway resumes where it stopped when
run again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Literal

from kvboost_rag.errors import InvalidInputError
from kvboost_rag.warm_job.report import BatchOutcome, DocumentFailure, WarmReport
from kvboost_rag.warm_job.sources import SourceDocument, read_source
from kvboost_rag.warm_job.worker import EngineSpec, WarmWorker

logger = logging.getLogger(__name__)

Backend = Literal["auto", "local", "ray"]
ProgressCallback = Callable[[WarmReport], None]
#: Batches queued on each Ray actor at once (one running, one waiting).
IN_FLIGHT_PER_WORKER = 2


def _checked_job(settings: dict[str, Any], source: Any, text_field: str, workers: int, batch_size: int) -> list[SourceDocument]:
    """The source's documents, after checking the job can run: a shared store, sizes of at
    least 1, at least one document."""
    disk = settings.get("disk_cache_dir")
    if not settings.get("redis_url") and (disk is None or disk == "auto"):
        raise InvalidInputError("a warm job writes to a shared store: set redis_url, or disk_cache_dir to a folder")
    if workers < 1 or batch_size < 1:
        raise InvalidInputError(f"workers and batch_size must be at least 1, got {workers} and {batch_size}")
    docs = read_source(source, text_field)
    if not docs:
        raise InvalidInputError("the source holds no documents")
    return docs


def _report_keeping(
    report: WarmReport, start: float, on_progress: ProgressCallback | None
) -> tuple[Callable[[BatchOutcome], None], Callable[[], None]]:
    """``(count, ready)``: add a batch's outcome to ``report`` (and tell ``on_progress``), and
    note when the workers were ready."""

    def count(outcome: BatchOutcome) -> None:
        report.add(outcome)
        report.seconds = time.perf_counter() - start
        if on_progress is not None:
            on_progress(report)

    def ready() -> None:
        report.startup_seconds = time.perf_counter() - start

    return count, ready


def warm_corpus(
    source: Any,
    spec: EngineSpec | None = None,
    *,
    workers: int = 1,
    batch_size: int = 16,
    backend: Backend = "auto",
    ray_address: str | None = None,
    text_field: str = "text",
    on_progress: ProgressCallback | None = None,
) -> WarmReport:
    """Warm every document of ``source`` into the shared store ``spec`` names.

    Args:
        source: A folder of text files, a JSONL file, a LangChain or LlamaIndex document
            store, or a list of texts or documents (see :mod:`kvboost_rag.warm_job.sources`).
        spec: How each worker builds its engine; its settings must name a shared store
            (``redis_url`` or a ``disk_cache_dir`` folder). Default: the embedded model.
        workers: Workers (Ray actors, each loading the model once).
        batch_size: Documents per batch handed to a worker.
        backend: ``"ray"``, ``"local"`` (this process, one worker), or ``"auto"``: Ray when
            it is installed and ``workers > 1`` or ``ray_address`` is given.
        ray_address: Address of a running Ray cluster (``None``: Ray's default, which starts
            a local one when none is running).
        text_field: Field holding the text in a JSONL source.
        on_progress: Called with the running report after each batch.

    Returns:
        The job's report: documents computed, skipped (stored already) and failed, tokens,
        bytes written, documents/s and tokens/s.

    Raises:
        InvalidInputError: No shared store in the settings, an empty source, bad sizes.
        ImportError: ``backend="ray"`` without Ray installed.
    """
    spec = spec or EngineSpec()
    settings = spec.settings
    docs = _checked_job(settings, source, text_field, workers, batch_size)
    batches = [docs[i : i + batch_size] for i in range(0, len(docs), batch_size)]
    context = [doc.text for doc in docs[: int(settings.get("warm_context_documents", 1)) + 1]]
    use_ray = _use_ray(backend, workers, ray_address)
    report = WarmReport(documents=len(docs), workers=workers if use_ray else 1, backend="ray" if use_ray else "local")
    start = time.perf_counter()
    count, ready = _report_keeping(report, start, on_progress)
    if use_ray:
        _run_on_ray(batches, spec, context, workers, ray_address, count, ready)
    else:
        worker = WarmWorker(spec, context)
        ready()
        for batch in batches:
            count(worker.warm(batch))
    report.seconds = time.perf_counter() - start
    return report


def _use_ray(backend: Backend, workers: int, ray_address: str | None) -> bool:
    if backend == "local":
        return False
    try:
        import ray  # noqa: F401
    except ImportError:
        if backend == "ray":
            raise ImportError("the Ray backend needs Ray: pip install 'kvboost-rag[ray]'") from None
        if workers > 1:
            logger.warning("Ray is not installed (pip install 'kvboost-rag[ray]'): warming in this process")
        return False
    return backend == "ray" or workers > 1 or ray_address is not None


def _run_on_ray(
    batches: list[list[SourceDocument]],
    spec: EngineSpec,
    context: list[str],
    workers: int,
    address: str | None,
    count: Callable[[BatchOutcome], None],
    ready: Callable[[], None],
) -> None:
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        options: dict[str, Any] = {"address": address, "include_dashboard": False, "log_to_driver": False}
        if address is None:
            options["num_cpus"] = workers
        ray.init(**options)
    try:
        gpus = float(ray.cluster_resources().get("GPU", 0))
        per_worker = 1.0 if gpus >= workers else gpus / workers
        if gpus and "device" not in spec.settings:
            spec = EngineSpec(spec.model, {**spec.settings, "device": "cuda"}, spec.factory, spec.threads)
        actor_class = ray.remote(num_cpus=1, num_gpus=per_worker)(WarmWorker)
        actors = [actor_class.remote(spec, context) for _ in range(workers)]
        names = ray.get([actor.ready.remote() for actor in actors])
        ready()
        logger.info("warm job on Ray: %d workers (%s), %g GPU each", workers, ", ".join(names), per_worker)
        _dispatch(ray, actors, batches, count)
    finally:
        if started_here:
            ray.shutdown()


def _dispatch(ray: Any, actors: list[Any], batches: list[list[SourceDocument]], count: Callable[[BatchOutcome], None]) -> None:
    """Run ``batches`` on ``actors``: the first alone, then up to two in flight per actor.
    A batch whose actor died counts its documents as failures."""
    queue = list(reversed(batches))
    running: dict[Any, tuple[Any, list[SourceDocument]]] = {}
    load = {id(actor): 0 for actor in actors}
    alive = list(actors)

    def submit(actor: Any) -> None:
        batch = queue.pop()
        running[actor.warm.remote(batch)] = (actor, batch)
        load[id(actor)] += 1

    if queue:
        submit(alive[0])
        _collect(ray, running, load, alive, count, wait_all=True)
    while queue or running:
        for actor in list(alive):
            while queue and load[id(actor)] < IN_FLIGHT_PER_WORKER:
                submit(actor)
        if not running:
            raise RuntimeError("every warm worker died")
        _collect(ray, running, load, alive, count)


def _collect(ray: Any, running: dict, load: dict, alive: list, count: Callable[[BatchOutcome], None], wait_all: bool = False) -> None:
    done, _ = ray.wait(list(running), num_returns=len(running) if wait_all else 1)
    for ref in done:
        actor, batch = running.pop(ref)
        load[id(actor)] -= 1
        try:
            count(ray.get(ref))
        except ray.exceptions.RayActorError as exc:
            if actor in alive:
                alive.remove(actor)
                logger.warning("a warm worker died: %s", exc)
            count(BatchOutcome(failures=[DocumentFailure(d.doc_id, f"worker died: {type(exc).__name__}") for d in batch]))
        except ray.exceptions.RayTaskError as exc:
            count(BatchOutcome(failures=[DocumentFailure(d.doc_id, str(exc).splitlines()[0]) for d in batch]))
