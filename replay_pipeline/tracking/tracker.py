"""Experiment tracking: one MLflow run per training run, behind a small interface.

`MlflowTracker` talks to any MLflow tracking URI (a local SQLite store by default, a
server by config) through `MlflowClient`, not the fluent API, so several runs can live in
one process (tests, sweeps). The one exception is `log_model`: MLflow's model flavours log
through the fluent API only, so it points the process's tracking URI at this store for the
call and back after it. Metrics are written by a background thread, so a round never
waits for the tracking store, and that thread gathers what was logged over up to
`COALESCE_SECONDS` (1 s) into one batch, less work for a thread that shares the interpreter
lock and the cores with generation and training (docs/performance.md, "Metrics into MLflow's
SQLite store"). On a plain SQLite store the batch's rows go straight into MLflow's metric
tables (replay_pipeline/tracking/mlflow_sqlite.py: MLflow's own log_batch spends 80-110 us of
CPU a metric in its ORM, 45-60 ms a second of the default run, the rows 17 us); any other
store gets `log_batch`. The MLflow UI then lags by at most a second. `flush()` writes at once
and waits for them, and runs before every checkpoint and at `finish()`, so a checkpoint implies
that the metrics of the steps it covers are stored. A writer error surfaces at the next call.
`NullTracker` has the same interface and does nothing, which keeps `if tracker:` checks out of
the training loop. A new local SQLite store starts as a copy of an empty migrated one
(`seed_sqlite_store`, replay_pipeline.tracking.sqlite_templates).

A SIGTERM or Ctrl-C that arrives while the calling thread is inside a tracking-store call is
held until the call returns (`deferred_signals`): Prefect's SIGTERM handler raises wherever the
main thread is, and an exception raised inside a SQLAlchemy statement can leave the SQLite
store locked, so the run could not then be marked KILLED.

Secrets stay out of MLflow: params, tags and text artifacts (config.yaml, summary.json) have
the values of secret-looking keys (`aws_secret_access_key`, `..._token`, `password`, account
keys, ...; see `is_secret_key`) replaced by `***` (`mask_secrets`, `mask_secrets_text`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import queue
import re
import signal
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Mapping

from replay_pipeline.tracking import sqlite_templates
from replay_pipeline.tracking.mlflow_sqlite import open_writer, sqlite_path
from replay_pipeline.system.threadnames import os_named

# MLflow's SQLite store logs Alembic migrations at INFO on first use; keep the terminal clean.
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")

#: The metrics writer gathers what was logged over this many seconds into one batch.
COALESCE_SECONDS = 1.0
_FLUSH = object()  # queued by flush(): write what was gathered now

MAX_PARAM_LENGTH = 6000
MASK = "***"
# Key words (between `_`, `-`, `.`) and key fragments that mark a value as a secret.
_SECRET_WORDS = {"secret", "password", "passwd", "token", "credential", "credentials", "sas"}
_SECRET_PARTS = ("access_key", "account_key", "private_key", "api_key", "secret")
# `key: value` (YAML) or `"key": value,` (JSON), one per line.
_KEY_LINE = re.compile(r'^(?P<head>\s*(?:-\s+)?(?P<q>"?)(?P<key>[^\s":]+)(?P=q)\s*:[ \t]+)'
                       r'(?P<value>.*?)(?P<comma>,?)[ \t]*$', re.M)


def is_secret_key(key: str) -> bool:
    """True for a config or param key whose value is a secret: its last component contains
    `secret`, `access_key`, `account_key`, `private_key` or `api_key`, or has the word
    `token`, `password`, `credential(s)` or `sas` (`max_new_tokens` is not one)."""
    name = str(key).rsplit(".", 1)[-1].lower()
    words = set(re.split(r"[_\-]+", name))
    return bool(words & _SECRET_WORDS) or any(part in name for part in _SECRET_PARTS)


def mask_secrets(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with the value of every secret-looking key (see `is_secret_key`) replaced by
    `***` (empty and None values are left as they are)."""
    return {k: MASK if is_secret_key(k) and v not in (None, "") else v for k, v in values.items()}


def mask_secrets_text(text: str) -> str:
    """YAML or JSON text with the value of every `key: value` line whose key looks secret
    replaced by `***` (null and empty values are left alone)."""
    def repl(m: re.Match) -> str:
        value = m.group("value")
        if not is_secret_key(m.group("key")) or value.strip() in ("", "null", "~", "''", '""', "{}"):
            return m.group(0)
        masked = f'"{MASK}"' if m.group("q") or value.startswith('"') else f"'{MASK}'"
        return f"{m.group('head')}{masked}{m.group('comma')}"

    return _KEY_LINE.sub(repl, text)


_DEFERRED = (signal.SIGTERM, signal.SIGINT)
_deferring = threading.local()


@contextlib.contextmanager
def deferred_signals():
    """Hold SIGTERM and SIGINT that arrive inside the block, then hand them to the handlers
    they would have reached, in arrival order, once it is done (so an exception a handler
    raises, such as Prefect's TerminationSignal or KeyboardInterrupt, comes out of the `with`
    instead of out of the middle of a store write). Only the main thread runs signal handlers,
    so elsewhere, and inside an outer block, this does nothing; a handler Python did not
    install (getsignal is None) is left in place."""
    if threading.current_thread() is not threading.main_thread() or getattr(_deferring, "on", False):
        yield
        return
    pending: list[tuple[int, Any]] = []
    previous = {s: h for s in _DEFERRED if (h := signal.getsignal(s)) is not None}
    for signum in previous:
        signal.signal(signum, lambda n, frame: pending.append((n, frame)))
    _deferring.on = True
    try:
        yield
    finally:
        _deferring.on = False
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum, frame in pending:
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


def _uninterrupted(method):
    """Run a tracker method that talks to the store with `deferred_signals`."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with deferred_signals():
            return method(*args, **kwargs)
    return wrapper


class NullTracker:
    run_id: str | None = None
    uri: str | None = None

    def params(self) -> dict[str, str]: return {}
    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None: ...
    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: Mapping[str, str]) -> None: ...
    def log_dataset(self, name: str, source: str, version: int, rows: int, context: str = "training") -> None: ...
    def log_model(self, model, tokenizer, *, step: int, max_new_tokens: int, tags: Mapping[str, str] | None = None
                  ) -> str | None: return None
    def flush(self) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...


#: The experiment tag MLflow 3's UI reads to choose its view, and the value of a model-training
#: experiment (the runs table and metric charts, not the GenAI traces view).
EXPERIMENT_KIND = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"


def _migrate_sqlite(path: Path) -> None:
    """A new SQLite file with MLflow's tables at its newest schema, as its store's first open
    makes them (no experiment yet: the store adds its default one, with this root's artifact
    location, when it opens the copy)."""
    # start-up cost: MLflow's store, only for a database that did not exist
    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables

    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    try:
        _initialize_tables(engine)
    finally:
        engine.dispose()


def seed_sqlite_store(uri: str) -> None:
    """A new local SQLite tracking store (`sqlite:///<file>` that does not exist yet) starts as
    a copy of an empty migrated one (`replay_pipeline.tracking.sqlite_templates`): MLflow's first open of
    a new file migrates it (3.4 s here, against 1.1 s to open one at head). Any other URI, or
    a file that exists: nothing."""
    path = sqlite_path(uri)
    if path is not None:
        sqlite_templates.seed(path, f"mlflow-db-{version('mlflow')}/mlflow.db", _migrate_sqlite)


class MlflowTracker:
    @_uninterrupted
    def __init__(self, uri: str, experiment: str, artifact_location: str | Path | None,
                 run_name: str, tags: Mapping[str, str] | None = None):
        # start-up cost: mlflow takes seconds to import; only this path talks to the store
        from mlflow.tracking import MlflowClient

        seed_sqlite_store(uri)
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            location = (None if not artifact_location else str(artifact_location)
                        if "://" in str(artifact_location) else Path(artifact_location).resolve().as_uri())
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        else:
            self.experiment_id = exp.experiment_id
        if exp is None or exp.tags.get(EXPERIMENT_KIND) != TRAINING_KIND:
            # MLflow 3 opens an untagged experiment in its GenAI (traces) view, empty for us
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND, TRAINING_KIND)
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=dict(tags or {}))
        self.run_id = run.info.run_id
        self.artifact_uri = run.info.artifact_uri
        self._start_writer()

    def _start_writer(self) -> None:
        # a plain SQLite store: rows go straight into MLflow's two metric tables (mlflow_sqlite)
        self._rows = open_writer(self.uri, self.run_id)
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        threading.Thread(target=os_named(self._drain), name="mlflow-metrics", daemon=True).start()

    def _drain(self) -> None:
        while True:
            batches = [self._queue.get()]
            deadline = time.monotonic() + COALESCE_SECONDS
            while batches[-1] is not _FLUSH and (left := deadline - time.monotonic()) > 0:
                try:
                    batches.append(self._queue.get(timeout=left))
                except queue.Empty:
                    break
            items = [m for batch in batches if batch is not _FLUSH for m in batch]
            try:
                self._write(items)
            except Exception as exc:  # noqa: BLE001 - re-raised in the caller's thread
                self._error = exc
            finally:
                for _ in batches:
                    self._queue.task_done()

    def _write(self, rows: list[tuple[str, float, int, int]]) -> None:
        """Store metric rows (key, value, timestamp in ms, step): straight into a SQLite store's
        tables when it has a row writer, else through MLflow's log_batch (any store)."""
        if self._rows is not None:
            self._rows.write(rows)
            return
        # start-up cost: mlflow takes seconds to import; only this path talks to the store
        from mlflow.entities import Metric

        items = [Metric(*row) for row in rows]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"logging metrics to MLflow at {self.uri} failed: {error}") from error

    def flush(self) -> None:
        """Wait until every metric logged so far is stored (the writer stops gathering)."""
        self._queue.put(_FLUSH)
        self._queue.join()
        self._raise_pending()

    @classmethod
    @_uninterrupted
    def attach(cls, uri: str, run_id: str) -> "MlflowTracker":
        """Continue logging into an existing MLflow run (a resumed training run): the run is
        set back to RUNNING. Raises ValueError if the run does not exist at `uri`."""
        # start-up cost: mlflow takes seconds to import; only this path talks to the store
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self = cls.__new__(cls)
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        try:
            run = self.client.get_run(run_id)
        except MlflowException as exc:
            raise ValueError(f"MLflow run {run_id} not found at {uri}: {exc}. Resume needs the "
                             "tracking store the run logged to (tracking.mlflow_uri).") from exc
        self.experiment_id = run.info.experiment_id
        self.run_id = run.info.run_id
        self.artifact_uri = run.info.artifact_uri
        self.client.update_run(self.run_id, status="RUNNING")
        self._start_writer()
        return self

    @_uninterrupted
    def status(self) -> str:
        return self.client.get_run(self.run_id).info.status

    @_uninterrupted
    def params(self) -> dict[str, str]:
        return dict(self.client.get_run(self.run_id).data.params)

    @_uninterrupted
    def log_params(self, params: Mapping[str, Any]) -> None:
        # start-up cost: mlflow takes seconds to import; only this path talks to the store
        from mlflow.entities import Param

        items = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in mask_secrets(params).items()]
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._raise_pending()
        now = int(time.time() * 1000)
        items = [(k, float(v), now, step) for k, v in metrics.items()
                 if v is not None and math.isfinite(float(v))]
        if items:
            self._queue.put(items)

    @_uninterrupted
    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, mask_secrets_text(text), artifact_file)

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        self.log_text(json.dumps(data, indent=2, sort_keys=True, default=str), artifact_file)

    @_uninterrupted
    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    @_uninterrupted
    def log_model(self, model, tokenizer, *, step: int, max_new_tokens: int, tags: Mapping[str, str] | None = None
                  ) -> str | None:
        """The policy as an MLflow model of the transformers flavour (task text-generation),
        named "model" and linked to this run at `step` (its "Logged models"); returns its
        models:/ URI. Its signature takes prompts (strings) and `max_new_tokens` (default
        this run's). The requirements are pinned to the installed torch and transformers, not
        inferred (inference imports the model in a subprocess)."""
        import mlflow  # start-up cost: mlflow's fluent API and the transformers flavour
        import mlflow.transformers
        from mlflow.models import infer_signature

        signature = infer_signature(["1+2="], ["3"], params={"max_new_tokens": int(max_new_tokens)})
        quiet = logging.getLogger("mlflow.transformers")  # "no model card on the hub": a local model
        level, previous_uri = quiet.level, mlflow.get_tracking_uri()
        quiet.setLevel(logging.ERROR)
        mlflow.set_tracking_uri(self.uri)  # the fluent API logs to the process's tracking URI
        # Created here, in the run's experiment: the fluent API would put it in its active one.
        logged = self.client.create_logged_model(self.experiment_id, name="model", source_run_id=self.run_id,
                                                 tags=dict(tags or {}))
        try:
            info = mlflow.transformers.log_model(
                transformers_model={"model": model, "tokenizer": tokenizer}, name="model", model_id=logged.model_id,
                task="text-generation", run_id=self.run_id, step=int(step), signature=signature,
                model_config={"max_new_tokens": int(max_new_tokens)},
                pip_requirements=[f"torch=={version('torch')}", f"transformers=={version('transformers')}"])
        finally:
            mlflow.set_tracking_uri(previous_uri)
            quiet.setLevel(level)
        return info.model_uri

    @_uninterrupted
    def set_tags(self, tags: Mapping[str, str]) -> None:
        for k, v in mask_secrets(tags).items():
            self.client.set_tag(self.run_id, k, str(v))

    @_uninterrupted
    def log_dataset(self, name: str, source: str, version: int, rows: int, context: str = "training") -> None:
        """Record a table version as a dataset input of the run (the run page's Datasets): its
        source is the Lance URI and version, its digest names the version, so each checkpoint's
        buffer shows as what the run trained on."""
        # start-up cost: mlflow's entities, only on this path
        from mlflow.entities import Dataset, DatasetInput, InputTag

        dataset = Dataset(name=name, digest=f"v{int(version)}", source_type="lance",
                          source=json.dumps({"uri": mask_secrets_text(source), "version": int(version)}),
                          profile=json.dumps({"num_rows": int(rows)}))
        self.client.log_inputs(self.run_id, datasets=[DatasetInput(dataset, tags=[
            InputTag("mlflow.data.context", context)])])

    def finish(self, status: str = "FINISHED") -> None:
        try:
            self.flush()
            rows, self._rows = self._rows, None  # anything logged later goes through log_batch
            if rows is not None:
                rows.close()
        finally:
            with deferred_signals():
                self.client.set_terminated(self.run_id, status=status)

