"""What the run's tables have in common: an append-only, versioned LanceDB table per run whose
rows carry deterministic ids. :class:`LanceTable` holds that machinery once;
:class:`~replay_pipeline.buffer.store.RolloutStore` (``rollouts_<run_id>``) and
:class:`~replay_pipeline.buffer.usage.UsageStore` (``usage_<run_id>``) are thin subclasses that
set the class attributes (schema, id column, sort order, table prefix, indexed columns) and add
their own queries.

Decisions (DESIGN.md, principles 1, 3, 4 and 5):

* **Idempotent appends without ``merge_insert``.** Ids are deterministic, so a write whose
  outcome is unknown can be retried. :meth:`LanceTable._append` looks up which of the batch's
  ids are already stored, through the btree index on the id column, and appends only the
  others as one new fragment (a plain Lance append, what lancedb's ``table.add`` does): a
  committed batch that is retried inserts nothing and makes no commit. ``merge_insert`` joins
  the batch against the whole id column and costs several times more: after an unindexed
  lookup it appended about a fifth as many rows a second as this append does
  (``python -m replay_pipeline.benchmarks.buffer``).
* **The id lookup is one range probe, not an ``IN`` list.** The lookup reads the stored ids
  between the batch's smallest and largest id (``id >= lo AND id <= hi``, one btree probe) and
  intersects them with the batch in memory. Deterministic ids sort by run and step, so a batch
  of one step's rollouts spans nothing but its own ids (a 2,048-string ``IN`` list would cost
  ~20 ms to plan alone). If the range holds many other rows (ids from far-apart steps in one
  batch), the lookup falls back to exact ``IN`` lists.
* **Indexes.** :meth:`create` builds a btree index on every column in ``INDEXED``; filters on
  them (and the id lookup) are answered from the index. An index covers the rows present when
  it was built or last refreshed; rows appended since are scanned, correctly but more slowly,
  until :meth:`compact` runs (merge the small per-append fragments, then add the new rows to
  every index). The training loop compacts every ``buffer.compact_every`` steps.
  :meth:`compact` also creates any index missing from a table made by an older version.
* **Reads and appends go to the Lance dataset under the lancedb table** (:meth:`_dataset`): the
  same pushed-down scans as lancedb's ``search()``, without its few milliseconds of overhead
  per call, and several times faster over not-yet-indexed fragments. :meth:`compact` calls
  Lance's compaction directly too (for its fragment-size option). lancedb creates, opens,
  lists, counts, tags and builds the indexes.
* **Other writers are visible.** The connection uses ``read_consistency_interval=timedelta(0)``,
  so every read checks for commits by other handles and processes.
* **Versions and tags.** Every commit is a Lance version; :meth:`tag` names one and
  :meth:`read_at` reads the table as it was then through a separate handle, so the live handle
  keeps following the newest version.
* **Damaged tables.** A data file that is missing or whose bytes no longer decode makes every
  scan that reaches it fail with Lance's own error, which names no table, run or step. Every
  read goes through :func:`read_rows`: when Lance fails it reads each fragment of the version
  on its own (every column, :func:`scan_damage`) to find the damaged files, and raises
  :class:`DamagedTable` (run, table, file, fragment, rows, version, and the repair command);
  if every fragment reads, Lance's error was something else and is raised as it was. Nothing
  is checked while reads succeed (no cost on a healthy table). Inside :func:`intact_reads` a
  read that meets a damaged file skips its fragments instead (a warning names them, once per
  file): ``flows.query --skip-damaged``. :meth:`LanceTable.damage` checks a table on request
  (``deep=False``: only that every file exists and its footer decodes, one small read a file;
  ``deep=True``: every page decodes, a full read). Corrupted bytes that still decode (Lance v2
  files carry no page checksums) cannot be seen by any reader. The repair is
  :mod:`replay_pipeline.buffer.repair`'s.

Concurrency (lancedb 0.40): several processes may append to one table and every commit
succeeds (appends never conflict). The lookup and the append are two steps, so two writers that
append the *same* new id at the same moment would both insert it: each writer must own its ids,
which deterministic ids per (run, step, group, sample) or (run, learner step, position) give.
Retrying one's own write after it returned or failed is always safe.

Object stores (``s3://bucket/prefix``, ``gs://``, ``az://``; infra/object-storage.md): every
method takes ``storage_options`` (normalised by :func:`normalize_storage_options`; keys left
out are read from the usual environment variables, ``AWS_*`` for S3). On S3 Lance commits a
version with a conditional PUT (``If-None-Match: *``) of its manifest, so concurrent appends
stay safe there as on a local disk, on any store that honours it. ``s3+ddb://`` (Lance's
DynamoDB commit store) is refused: appends go through the Lance dataset under the lancedb table
(:meth:`LanceTable._dataset`), which lancedb 0.40 opens as plain ``s3://`` and which would then
commit behind DynamoDB's back. :func:`check_storage` probes a database before a run starts, and
connection failures raise :class:`StoreError` saying what to set.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from lancedb.index import BTree

from .schema import SchemaMismatch, rows_to_table, schema_mismatches

__all__ = ["COMPACT_TARGET_ROWS", "DamagedFile", "DamagedTable", "LanceTable", "StoreError", "check_storage",
           "describe_storage_error", "int_filter", "intact_reads", "is_object_store", "normalize_storage_options",
           "read_rows", "scan_damage", "sql_str", "table_names"]

_RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]+")
# Rows besides the batch's own that the id lookup's range may hold before it falls back to
# IN lists.
_ID_RANGE_SLACK = 1024
#: Fragments below this many rows are merged by :meth:`LanceTable.compact`. Lance's default
#: (1M) makes every compaction rewrite all the rows since the last full fragment again, so its
#: cost grows with the table (~9 s per compaction at 1M rows here); at 128k a row's data is
#: rewritten once or twice. The indexes still grow the cost with the table: every compaction
#: adds the new rows to each btree index by rewriting it whole, and one that merged indexed
#: fragments remaps them too (the buffer benchmark at 10M rows: about a second per compaction in
#: the first tenth of the fill, several in the last; docs/performance.md, "At 10M rows").
COMPACT_TARGET_ROWS = 1 << 17
_KEEP_VERSIONS = timedelta(days=7)  # lancedb's optimize() default
# Values per `col IN (...)` filter; planning cost grows with the list, so keep it modest.
_IN_CHUNK = 1024


class StoreError(RuntimeError):
    """A store operation was refused; the message says why and what to do instead."""


class ConcurrentAppend(StoreError):
    """A numbered append found rows it did not expect: another process writes the same table.
    Never retried (a retry would interleave two drivers' steps)."""


@dataclass(frozen=True)
class DamagedFile:
    """One unreadable data file of a table version: its full path, the fragment it holds
    rows of, those rows, and what is wrong (``missing``, or ``corrupt: <Lance's words>``)."""

    path: str
    fragment: int
    rows: int
    problem: str

    def describe(self) -> str:
        return f"{self.path} ({self.problem}; fragment {self.fragment}, {self.rows} rows)"


#: How a damaged table is repaired, named once for every message.
REPAIR_COMMAND = "python -m flows.query repair {run_id} --uri {uri}"


class DamagedTable(StoreError):
    """A read met data files of the table's current version that are missing or do not
    decode. Attributes: ``run_id``, ``table`` (its name), ``version``, ``files``
    (:class:`DamagedFile`, each with its path), ``uri`` (the database)."""

    def __init__(self, table: str, run_id: str, version: int, files: Sequence[DamagedFile], uri: str):
        self.table, self.run_id, self.version, self.files, self.uri = table, run_id, int(version), list(files), uri
        rows = sum(f.rows for f in self.files)
        super().__init__(
            f"table {table} of run {run_id} is damaged at version {version}: "
            + "; ".join(f"data file {f.describe()}" for f in self.files)
            + f" ({rows} rows unreadable). Repair it with `{self.repair_command}` (it keeps every "
            "readable row, brings back what an older version still holds, and moves the damaged files "
            "aside into the table's _damaged/ folder; add --dry-run to see what it would do), or read "
            "the intact rows meanwhile with `python -m flows.query ... --skip-damaged`")

    @property
    def repair_command(self) -> str:
        return REPAIR_COMMAND.format(run_id=self.run_id, uri=self.uri)

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]


# Lance raises these for a missing or undecodable file (pyarrow's ArrowInvalid is a ValueError).
_READ_ERRORS = (OSError, ValueError, RuntimeError)


def _lance_words(exc: BaseException) -> str:
    """The first line of Lance's message, without its Rust source location."""
    text = " ".join(str(exc).split()).removeprefix("External error: ")
    text = re.sub(r",? /\S+\.rs:\d+:\d+", "", text)
    return text if len(text) <= 160 else text[:160] + " ..."


def _file_path(dataset: Any, data_file: Any) -> str:
    """Where a fragment's data file lives: the table's data/ folder, or (a fork's shallow
    clone) the data/ folder of the base it was cloned from."""
    base = str(dataset.uri).rstrip("/")
    base_id = getattr(data_file, "base_id", None)
    if base_id is not None:
        try:
            base = str(dataset.base_paths()[base_id].path).rstrip("/")
        except (AttributeError, KeyError, IndexError, TypeError, ValueError):
            pass
    return f"{base}/data/{data_file.path}"


def _fragment_rows(fragment: Any) -> int:
    meta = fragment.metadata
    return int(meta.physical_rows) - int(meta.num_deletions or 0)


def scan_damage(dataset: Any, deep: bool = True, fragments: Iterable[Any] | None = None) -> list[DamagedFile]:
    """The unreadable data files of ``dataset``'s version (of ``fragments``, default all):
    each fragment is read on its own, every column (``deep``), or only opened (its files'
    footers and schema decode: ``deep=False``, one small read a file). A missing local file is
    ``missing``; any other failure is ``corrupt`` with Lance's words. A fragment of several
    data files (columns added later) is blamed on the files that fail on their own columns."""
    out: list[DamagedFile] = []
    for fragment in dataset.get_fragments() if fragments is None else fragments:
        problem = _fragment_problem(fragment, deep)
        if problem is None:
            continue
        files = fragment.data_files()
        rows = _fragment_rows(fragment)
        blamed = []
        for data_file in files:
            path = _file_path(dataset, data_file)
            if not is_object_store(path) and not Path(path.removeprefix("file://")).exists():
                blamed.append(DamagedFile(path, fragment.fragment_id, rows, "missing"))
        if not blamed and len(files) > 1:
            names = {f.id(): f.name() for f in dataset.lance_schema.fields()}  # top-level columns
            for data_file in files:
                cols = [names[i] for i in data_file.field_ids() if i in names]
                if cols and _fragment_problem(fragment, deep, cols) is not None:
                    blamed.append(DamagedFile(_file_path(dataset, data_file), fragment.fragment_id, rows, problem))
        if not blamed:
            blamed = [DamagedFile(_file_path(dataset, f), fragment.fragment_id, rows, problem) for f in files]
        out.extend(blamed)
    return out


def _fragment_problem(fragment: Any, deep: bool, columns: list[str] | None = None) -> str | None:
    try:
        if deep:
            for _ in fragment.to_batches(columns=columns, batch_size=4096):
                pass
        else:
            fragment.validate()
    except _READ_ERRORS as exc:
        words = _lance_words(exc)
        missing = ("Not found" in words or "No such file" in words) and "decode" not in words
        return "missing" if missing else f"corrupt: {words}"
    return None


# The damaged files each intact_reads() block has skipped (None: outside such a block).
_SKIPPING: contextvars.ContextVar[dict[str, DamagedFile] | None] = contextvars.ContextVar("skipping", default=None)
# Damaged fragments found so far, per (table directory, version): a version never changes.
_KNOWN_DAMAGE: dict[tuple[str, int], list[DamagedFile]] = {}


@contextlib.contextmanager
def intact_reads() -> Iterator[dict[str, DamagedFile]]:
    """Within this block every read of a damaged table skips its damaged fragments instead of
    raising :class:`DamagedTable`, with one warning per skipped file. Yields the files skipped
    so far (path -> :class:`DamagedFile`), filled in as reads meet them."""
    skipped: dict[str, DamagedFile] = {}
    token = _SKIPPING.set(skipped)
    try:
        yield skipped
    finally:
        _SKIPPING.reset(token)


def read_rows(dataset: Any, where: str | None, columns: Sequence[str] | None, limit: int | None = None, *,
              table: str, run_id: str, uri: str, count: bool = False) -> Any:
    """``dataset.to_table(columns, filter=where, limit)`` (the row count instead, ``count``),
    with a damaged table reported as :class:`DamagedTable` or, inside :func:`intact_reads`,
    read without its damaged fragments (see the module docstring)."""
    columns = None if columns is None else list(columns)
    key = (str(dataset.uri), int(dataset.version))
    skipping = _SKIPPING.get()
    if skipping is None or key not in _KNOWN_DAMAGE:
        try:
            if count:
                return dataset.count_rows(where)
            return dataset.to_table(columns=columns, filter=where, limit=limit)
        except _READ_ERRORS as exc:
            if key not in _KNOWN_DAMAGE:
                damage = scan_damage(dataset)
                if not damage:
                    raise  # not the files: Lance's own error, as it was
                _KNOWN_DAMAGE[key] = damage
            if skipping is None:
                raise DamagedTable(table, run_id, dataset.version, _KNOWN_DAMAGE[key], uri) from exc
    damage = _KNOWN_DAMAGE[key]
    for f in damage:
        if f.path not in skipping:
            skipping[f.path] = f
            warnings.warn(f"skipped {f.rows} unreadable rows of {table} (run {run_id}, version "
                          f"{dataset.version}): data file {f.describe()}", stacklevel=2)
    bad = {f.fragment for f in damage}
    scanner = dataset.scanner(columns=columns, filter=where, limit=limit,
                              fragments=[f for f in dataset.get_fragments() if f.fragment_id not in bad])
    return scanner.count_rows() if count else scanner.to_table()


def in_order(table: pa.Table, keys: Sequence[str]) -> bool:
    """Whether `table`'s rows are already sorted ascending by `keys` (lexicographically). Lance
    returns rows in fragment order, which is the append order, so a query's result usually is:
    checking costs a pass over the key columns, where `sort_by` would copy every column through
    a `take` (the token lists too: 100k rows of 100-token rollouts are ~65 MB)."""
    if table.num_rows < 2:
        return True
    # rows i and i+1 are decided by the first key that differs; still tied after all keys: fine
    undecided = np.ones(table.num_rows - 1, dtype=bool)
    for key in keys:
        column = table.column(key)
        if column.null_count:
            return False
        values = column.to_numpy(zero_copy_only=False)
        before, after = values[:-1], values[1:]
        if np.any(undecided & (before > after)):
            return False
        undecided &= before == after
        if not undecided.any():
            return True
    return True


def sql_str(value: str) -> str:
    """A SQL string literal (single quotes doubled)."""
    return "'" + value.replace("'", "''") + "'"


def is_object_store(uri: str | Path) -> bool:
    """True for an object-store URI (``s3://``, ``gs://``, ``az://``, ...), False for a local
    directory (a plain path or ``file://``)."""
    text = str(uri)
    return "://" in text and not text.startswith("file://")


def normalize_storage_options(storage_options: Mapping[str, Any] | None) -> dict[str, str] | None:
    """Lance's ``storage_options`` as it takes them: a flat ``str -> str`` dict (None if empty).

    Booleans become ``"true"``/``"false"`` and numbers their text, so a Hydra override such as
    ``buffer.storage_options={allow_http:true}`` works (Lance refuses non-string values).
    """
    if not storage_options:
        return None
    out: dict[str, str] = {}
    for key, value in dict(storage_options).items():
        if value is None:
            continue
        if isinstance(value, bool):
            out[str(key)] = "true" if value else "false"
        elif isinstance(value, (str, int, float)):
            out[str(key)] = str(value)
        else:
            raise StoreError(
                f"storage option {key!r} must be a string, number or boolean, got "
                f"{type(value).__name__}; storage_options is a flat mapping such as "
                f"{{aws_endpoint: 'http://127.0.0.1:9000', allow_http: true}}"
            )
    return out or None


def _check_scheme(uri: str | Path) -> None:
    if str(uri).startswith("s3+ddb://"):
        raise StoreError(
            f"{str(uri)!r}: the DynamoDB commit store (s3+ddb://) is not supported. The stores "
            "append through the Lance dataset under each lancedb table, and with lancedb 0.40 that "
            "dataset commits to S3 directly, bypassing the DynamoDB table, so other readers would "
            "miss those commits. Use s3://bucket/prefix on a store with conditional PUT "
            "(If-None-Match; AWS S3, MinIO, Cloudflare R2 and moto have it): Lance's own "
            "commits are then safe with concurrent writers. See infra/object-storage.md."
        )


def _connect(uri: str | Path, storage_options: Mapping[str, Any] | None) -> lancedb.DBConnection:
    _check_scheme(uri)
    options = normalize_storage_options(storage_options)
    try:
        return lancedb.connect(str(uri), read_consistency_interval=timedelta(0), storage_options=options)
    except (ValueError, RuntimeError, OSError) as exc:
        if not is_object_store(uri):
            raise
        raise StoreError(describe_storage_error(uri, options, exc)) from exc


def _storage_setting(options: Mapping[str, str], keys: Sequence[str], env: Sequence[str]) -> tuple[str | None, str]:
    """The value of the first of ``keys`` set in ``options`` (or of ``env`` in the
    environment), with where it came from."""
    for key in keys:
        if options.get(key):
            return options[key], f"storage option {key}"
    for var in env:
        if os.environ.get(var):
            return os.environ[var], f"${var}"
    return None, "not set"


#: What to set for an S3-compatible store, named once for every error message.
S3_SETTINGS = (
    "For S3 and S3-compatible servers set storage options (buffer.storage_options in the "
    "training config, --storage-option KEY=VALUE for flows.query) or the environment variables "
    "Lance reads when an option is left out: aws_endpoint / AWS_ENDPOINT_URL (the server, e.g. "
    "http://127.0.0.1:9000; leave it out for AWS S3 itself), allow_http=true / AWS_ALLOW_HTTP=true "
    "(needed for a plain-http endpoint), aws_region / AWS_REGION, and the credentials "
    "aws_access_key_id / AWS_ACCESS_KEY_ID and aws_secret_access_key / AWS_SECRET_ACCESS_KEY "
    "(keep secrets in the environment: the training config is saved with the run)."
)


def describe_storage_error(uri: str | Path, storage_options: Mapping[str, Any] | None, exc: BaseException) -> str:
    """A short message for a failure to reach an object store: the likely cause, what to set
    to fix it, and the start of Lance's own error."""
    options = normalize_storage_options(storage_options) or {}
    text = str(exc)
    raw = " ".join(text.split())
    raw = raw if len(raw) <= 400 else raw[:400] + " ..."
    uri = str(uri)
    scheme, _, rest = uri.partition("://")
    bucket = rest.split("/", 1)[0]
    head = f"cannot reach the LanceDB database at {uri!r}"
    if scheme != "s3":
        return (f"{head}: {raw}. Check the URI and the storage options for {scheme}:// (Lance's "
                "object_store keys, e.g. google_service_account / GOOGLE_APPLICATION_CREDENTIALS "
                "for gs://, azure_storage_account_name and azure_storage_account_key / "
                "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY for az://); see "
                "infra/object-storage.md.")
    endpoint, endpoint_from = _storage_setting(options, ("aws_endpoint", "endpoint", "aws_endpoint_url"),
                                               ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"))
    where = f"endpoint {endpoint} ({endpoint_from})" if endpoint else "AWS S3 itself (no endpoint is set)"
    if "NoSuchBucket" in text:
        cause = (f"the bucket {bucket!r} does not exist at {where}. Create it first (e.g. "
                 f"`aws s3 mb s3://{bucket}" + (f" --endpoint-url {endpoint}`" if endpoint else "`")
                 + ", or the server's console), or point the URI at an existing bucket")
    elif "InvalidBucketName" in text:
        cause = f"{bucket!r} is not a valid bucket name (3-63 lowercase letters, digits, '.' and '-')"
    elif "BadScheme" in text:
        cause = (f"the {where} is plain http, which is refused unless allowed: set allow_http=true "
                 "(or AWS_ALLOW_HTTP=true)")
    elif "resolve region" in text:
        cause = "no region is set: set aws_region (or AWS_REGION), e.g. us-east-1"
    elif any(s in text for s in ("credentials", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                 "AccessDenied", "Forbidden", "403")):
        cause = (f"the credentials were refused or could not be found for {where}: set "
                 "aws_access_key_id and aws_secret_access_key (or AWS_ACCESS_KEY_ID and "
                 "AWS_SECRET_ACCESS_KEY)" + ("" if endpoint else
                 "; for MinIO or another S3-compatible server also set aws_endpoint"))
    elif any(s in text for s in ("kind: Connect", "ConnectError", "tcp connect error", "Connection refused",
                                 "dns error", "timed out", "error sending request")):
        cause = (f"nothing answered at {where}: check the endpoint's host, port and scheme "
                 "(http or https)" + ("" if endpoint else
                 "; for MinIO or another S3-compatible server set aws_endpoint"))
    else:
        cause = f"the request to {where} failed"
    return f"{head}: {cause}. {S3_SETTINGS} (Lance said: {raw})"


def check_storage(uri: str | Path, storage_options: Mapping[str, Any] | None = None) -> None:
    """Fail fast, with a message that says what to set, if the object store behind ``uri`` is
    unreachable, the bucket is missing or the credentials are refused: connects and lists the
    database's tables (one or two LIST requests). Does nothing for a local directory.

    Raises :class:`StoreError`. Connection failures are retried once here, not Lance's default
    three times, so a wrong endpoint is reported within seconds.
    """
    if not is_object_store(uri):
        return
    _check_scheme(uri)
    options = {"client_max_retries": "1", "client_retry_timeout": "30",
               **(normalize_storage_options(storage_options) or {})}
    try:
        db = lancedb.connect(str(uri), storage_options=options)
        table_names(db)
    except (ValueError, RuntimeError, OSError) as exc:
        raise StoreError(describe_storage_error(uri, options, exc)) from exc


def table_names(db: lancedb.DBConnection) -> list[str]:
    """Every table name in the database (all pages of ``list_tables``)."""
    names: list[str] = []
    token = None
    while True:
        resp = db.list_tables(page_token=token)
        names.extend(resp.tables)
        token = resp.page_token
        if not token:
            return names


def _exists(uri: str | Path) -> bool:
    """False only for a local path that does not exist (connecting would create it)."""
    local = "://" not in str(uri) or str(uri).startswith("file://")
    return not local or Path(str(uri).removeprefix("file://")).exists()


def _chunks(values: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    return (values[i : i + size] for i in range(0, len(values), size))


def int_filter(column: str, values: np.ndarray) -> list[str]:
    """Pushed-down filters selecting the rows whose integer ``column`` is in ``values``.

    One range filter when the values are dense (their span is at most 4x their number, as for
    a window); otherwise ``IN`` lists of :data:`_IN_CHUNK`. Callers drop the extra rows a range
    may return.
    """
    values = np.unique(np.asarray(values, dtype=np.int64))
    if len(values) == 0:
        return []
    lo, hi = int(values[0]), int(values[-1])
    if hi - lo + 1 <= 4 * len(values):
        return [f"{column} >= {lo} AND {column} <= {hi}"]
    return [f"{column} IN ({', '.join(map(str, chunk))})" for chunk in _chunks(values.tolist(), _IN_CHUNK)]


class LanceTable:
    """A run's append-only LanceDB table, ``<TABLE_PREFIX><run_id>``, with deterministic row ids.

    Subclasses set the class attributes below and use :meth:`_append`, :meth:`_query` and
    :meth:`_ordered`; everything else (create/open/list, schema checks, tags, versions,
    compaction) is shared.
    """

    SCHEMA: ClassVar[pa.Schema]
    SCHEMA_NAME: ClassVar[str]
    """The schema's constant name, for error messages (``ROLLOUT_SCHEMA``)."""
    KIND: ClassVar[str]
    """What a row is, for error messages (``rollout``)."""
    TABLE_PREFIX: ClassVar[str]
    ID_COLUMN: ClassVar[str]
    ORDER: ClassVar[tuple[str, ...]]
    """Sort key of every multi-row read; the last column breaks ties."""
    INDEXED: ClassVar[tuple[str, ...]]
    ASSIGNED: ClassVar[tuple[str, ...]] = ()
    ADDED_LATER: ClassVar[tuple[str, ...]] = ()
    """Nullable columns added to SCHEMA after tables existed: `migrate` adds them."""
    """Columns the store fills in on append (callers leave them out or null)."""

    def __init__(self, db: lancedb.DBConnection, table: Any, uri: str, run_id: str):
        # Use the classmethods; this only wires an already opened table.
        self._db = db
        self._table = table
        self.uri = uri
        self.run_id = run_id
        self.table_name = self.table_name_for(run_id)
        self._live: Any = None  # the Lance dataset at the newest version read so far
        self._cache: Any = None  # the Lance cache session all of them share
        self.last_appended: pa.Table | None = None
        """The rows the last append through this handle inserted, as stored (assigned columns
        filled in); None if it inserted nothing."""

    # ------------------------------------------------------------------ opening
    def handle(self):
        """Another handle on the same table (same connection, its own table object and dataset
        cache), for a thread that reads while this handle's owner writes."""
        return type(self)(self._db, self._db.open_table(self.table_name), self.uri, self.run_id)

    @classmethod
    def table_name_for(cls, run_id: str) -> str:
        """``<TABLE_PREFIX><run_id>``, after checking ``run_id`` matches ``[A-Za-z0-9_-]+``."""
        if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
            raise StoreError(
                f"invalid run_id {run_id!r}: use only letters, digits, '_' and '-' "
                f"(it becomes part of the table name {cls.TABLE_PREFIX}<run_id>)"
            )
        return cls.TABLE_PREFIX + run_id

    @classmethod
    def create(cls, uri: str | Path, run_id: str, *, storage_options: Mapping[str, str] | None = None):
        """Create the (empty) table of a new run, with its indexes. Refuses if it exists."""
        name = cls.table_name_for(run_id)
        db = _connect(uri, storage_options)
        exists_msg = (
            f"{cls.KIND} table {name!r} for run {run_id!r} already exists in {str(uri)!r}; "
            f"use {cls.__name__}.open(...) to resume the run (or open_or_create), "
            f"or choose a new run_id"
        )
        if name in table_names(db):
            raise StoreError(exists_msg)
        try:
            table = db.create_table(name, schema=cls.SCHEMA)
        except ValueError as exc:  # lost a race with another creator
            if "already exists" in str(exc):
                raise StoreError(exists_msg) from exc
            raise
        store = cls(db, table, str(uri), run_id)
        store._ensure_indexes()
        return store

    @classmethod
    def open(cls, uri: str | Path, run_id: str, *, storage_options: Mapping[str, str] | None = None):
        """Open an existing run's table; checks its schema and modifies nothing."""
        name = cls.table_name_for(run_id)
        if not _exists(uri):
            raise StoreError(
                f"no {cls.KIND} table for run {run_id!r}: {str(uri)!r} does not exist; "
                f"use {cls.__name__}.create(...) to start a new run"
            )
        db = _connect(uri, storage_options)
        names = table_names(db)
        if name not in names:
            runs = cls._runs_in(names)
            raise StoreError(
                f"no {cls.KIND} table for run {run_id!r} in {str(uri)!r} (runs there: {runs or 'none'}); "
                f"use {cls.__name__}.create(...) to start a new run"
            )
        table = db.open_table(name)
        problems = schema_mismatches(table.schema, expected=cls.SCHEMA)
        if problems:
            later = [n for n in cls.ADDED_LATER if n not in table.schema.names]
            hint = (f"; it predates the columns {later}: add them (null: not recorded, nothing stored "
                    f"changes) with `python -m flows.query migrate {run_id} --uri {uri}`"
                    if later else "")
            raise StoreError(
                f"{cls.KIND} table {name!r} in {str(uri)!r} does not match {cls.SCHEMA_NAME}: "
                + "; ".join(problems)
                + " (the table was left unchanged)" + hint
            )
        return cls(db, table, str(uri), run_id)

    @classmethod
    def migrate(cls, uri: str | Path, run_id: str, *, storage_options: Mapping[str, str] | None = None) -> list[str]:
        """Add the ADDED_LATER columns a table lacks, as null columns (a new table version; no
        stored value changes); returns the columns added ([] if none were missing)."""
        db = _connect(uri, storage_options)
        name = cls.table_name_for(run_id)
        if name not in table_names(db):
            raise StoreError(f"no {cls.KIND} table for run {run_id!r} in {str(uri)!r}")
        table = db.open_table(name)
        missing = [f for f in cls.SCHEMA if f.name in cls.ADDED_LATER and f.name not in table.schema.names]
        if missing:
            table.add_columns(pa.schema(missing))
        return [f.name for f in missing]

    @classmethod
    def open_or_create(cls, uri: str | Path, run_id: str, *, storage_options: Mapping[str, str] | None = None):
        """Open the run's table if it exists, else create it."""
        cls.table_name_for(run_id)  # validates run_id
        if run_id in cls.list_runs(uri, storage_options=storage_options):
            return cls.open(uri, run_id, storage_options=storage_options)
        try:
            return cls.create(uri, run_id, storage_options=storage_options)
        except StoreError:  # created by someone else in between
            return cls.open(uri, run_id, storage_options=storage_options)

    @classmethod
    def fork(cls, uri: str | Path, source_run_id: str, tag: str, run_id: str, *, drop_where: str | None = None,
             storage_options: Mapping[str, str] | None = None):
        """A new run's table that begins as ``source_run_id``'s table at ``tag``, sharing its
        data files (Lance's shallow clone: nothing is copied; the clone writes its own new
        fragments, deletions and indexes, and the source is never modified).

        ``drop_where`` deletes the clone's rows matching it (the rows a tag may hold beyond the
        fork point). The tag on the source keeps the shared files alive: a source compaction
        never removes a tagged version's files, so do not delete a tag a fork was made from.
        If the clone already exists (a fork interrupted after cloning), it is reused and the
        deletion applied again (idempotent). If a repair moved files of the tagged version aside,
        the clone is made of the source's current (repaired) version instead, tagged
        ``fork-<run_id>``: the fork then starts with every readable row of the source.
        """
        source = cls.open(uri, source_run_id, storage_options=storage_options)
        name = cls.table_name_for(run_id)
        tags = source.tags()
        if tag not in tags:
            raise StoreError(f"cannot fork {source.table_name!r} at {tag!r}: no such tag "
                             f"(tags: {sorted(tags) or 'none'})")
        db = source._db
        if name not in table_names(db):
            src_uri = str(source._dataset().uri).rstrip("/")
            target = src_uri.rsplit("/", 1)[0] + f"/{name}.lance"
            reference: str | int = tag
            if scan_damage(source._dataset().checkout_version(tags[tag]), deep=False):
                # A repair (replay_pipeline/buffer/repair.py) moved files of the tagged version
                # aside: clone the repaired version instead, which holds every readable row
                # (drop_where trims what lies past the fork point), tagged so that the source's
                # compactions keep its files.
                source.check_intact(deep=False)  # damaged now too: DamagedTable, with the repair command
                reference = f"fork-{run_id}"
                if reference not in tags:
                    source.tag(reference, source.version)
            source._dataset().shallow_clone(target, reference, storage_options=normalize_storage_options(storage_options))
        table = db.open_table(name)
        store = cls(db, table, str(uri), run_id)
        # The cloned indexes point into the source's directory, which index updates in the
        # clone cannot extend: rebuild them as the clone's own.
        for column in cls.INDEXED:
            table.create_index(column, config=BTree(), replace=True)
        if drop_where:
            table.delete(drop_where)
        return store

    @classmethod
    def list_runs(cls, uri: str | Path, *, storage_options: Mapping[str, str] | None = None) -> list[str]:
        """The run ids that have a table of this kind at ``uri``, sorted; [] if ``uri`` does not exist."""
        if not _exists(uri):
            return []  # connecting would create the directory
        return cls._runs_in(table_names(_connect(uri, storage_options)))

    @classmethod
    def _runs_in(cls, names: Iterable[str]) -> list[str]:
        return sorted(n[len(cls.TABLE_PREFIX):] for n in names if n.startswith(cls.TABLE_PREFIX))

    def _ensure_indexes(self) -> None:
        have = {tuple(ix.columns) for ix in self._table.list_indices()}
        for column in self.INDEXED:
            if (column,) not in have:
                self._table.create_index(column, config=BTree())

    # ------------------------------------------------------------------ writing
    def _to_input_table(self, data: Any) -> pa.Table:
        refused = f"cannot append to {self.table_name!r}"
        if isinstance(data, pa.RecordBatch):
            data = pa.Table.from_batches([data])
        if not isinstance(data, pa.Table):
            if isinstance(data, Mapping):
                raise StoreError(f"{refused}: pass a pyarrow Table or a list of row dicts, not a single dict")
            try:
                return rows_to_table(list(data), self.SCHEMA, assigned=self.ASSIGNED, noun=self.KIND)
            except SchemaMismatch as exc:
                raise StoreError(f"{refused}: {exc}") from exc
        if data.schema.equals(self.SCHEMA):  # built in the schema already (the training loop's batches)
            problems = []
        else:
            problems = schema_mismatches(data.schema, expected=self.SCHEMA, optional=self.ASSIGNED)
        if problems:
            raise StoreError(
                f"{refused}: the batch does not match {self.SCHEMA_NAME}: " + "; ".join(problems)
                + " (nothing was written)"
            )
        for column in self.ASSIGNED:
            if column not in data.column_names:
                data = data.append_column(column, pa.nulls(data.num_rows, self.SCHEMA.field(column).type))
            elif data.column(column).null_count != data.num_rows:
                raise StoreError(
                    f"{refused}: the batch has {column} values, but {column} is assigned by the "
                    f"store; drop the column or leave it null"
                )
        return data if data.schema.equals(self.SCHEMA) else data.select(self.SCHEMA.names).cast(self.SCHEMA)

    def _check_batch(self, data: pa.Table) -> None:
        refused = f"cannot append to {self.table_name!r}"
        ids = data.column(self.ID_COLUMN)
        if ids.null_count:
            raise StoreError(f"{refused}: {ids.null_count} rows have a null {self.ID_COLUMN}")
        if pc.count_distinct(ids).as_py() != len(ids):
            counts = pc.value_counts(ids)
            dups = sorted(counts.field("values").filter(pc.greater(counts.field("counts"), 1)).to_pylist())
            raise StoreError(f"{refused}: duplicate {self.ID_COLUMN} within the batch: {dups[:5]}")
        run_ids = pc.unique(data.column("run_id")).to_pylist()
        if run_ids != [self.run_id]:
            raise StoreError(
                f"{refused}: rows carry run_id {sorted(map(str, run_ids))}, expected only {self.run_id!r}"
            )

    def _stored_ids(self, ids: pa.ChunkedArray | pa.Array) -> pa.Array:
        """The subset of ``ids`` already stored (see the module docstring for the lookup)."""
        col = self.ID_COLUMN
        lo, hi = pc.min_max(ids).values()
        limit = len(ids) + _ID_RANGE_SLACK
        span = f"{col} >= {sql_str(lo.as_py())} AND {col} <= {sql_str(hi.as_py())}"
        hits = self._query(span, [col], limit=limit).column(col)
        if len(hits) >= limit:  # the range spans many other rows: look the ids up exactly
            ordered = sorted(ids.to_pylist())
            found = [
                self._query(f"{col} IN ({', '.join(map(sql_str, chunk))})", [col]).column(col)
                for chunk in _chunks(ordered, _IN_CHUNK)
            ]
            hits = pa.chunked_array([c for f in found for c in f.chunks], pa.string())
        return pc.filter(hits, pc.is_in(hits, value_set=ids)).combine_chunks()

    def _assign(self, data: pa.Table, start: int | None = None, positions: np.ndarray | None = None) -> pa.Table:
        """Fill in the ``ASSIGNED`` columns of the rows about to be inserted (none by default);
        ``start``: the number of rows stored, if the caller knows it (see :meth:`prepare`);
        ``positions``: where these rows were in the batch, when stored rows were dropped from it."""
        return data

    def _append(self, data: Any, known_new: bool = False) -> int:
        """Validate, drop the rows whose id is stored (unless the caller knows none is),
        assign, append; returns rows inserted."""
        self.last_appended = None
        prepared = self.prepare(data, known_new=known_new)
        return 0 if prepared is None else self.insert(prepared)

    def prepare(self, data: Any, known_new: bool = False, start: int | None = None) -> pa.Table | None:
        """The first half of an append: validate the batch (raising :class:`StoreError` as the
        append would), drop the rows whose id is stored (unless ``known_new``) and fill in the
        assigned columns; returns the rows exactly as :meth:`insert` will store them, or None
        if there is nothing to insert. Nothing is written.

        For a single writer that wants the assigned values before the write is done (the
        training loop writes behind its learner steps): assigned values (``seq``) are computed
        from the rows stored now, so no other append may come between this and :meth:`insert`.
        ``start``, the number of rows the table holds, saves counting them (about 2 ms); pass
        the same number to :meth:`insert` as ``expect_count``, which checks it before writing.
        """
        data = self._to_input_table(data)
        if data.num_rows == 0:
            return None
        self._check_batch(data)
        stored = [] if known_new else self._stored_ids(data.column(self.ID_COLUMN))
        positions = None
        if len(stored):
            keep = pc.invert(pc.is_in(data.column(self.ID_COLUMN), value_set=stored))
            positions = np.flatnonzero(keep.to_numpy(zero_copy_only=False))
            data = data.filter(keep)
            if data.num_rows == 0:
                return None
        return self._assign(data, start, positions)

    def insert(self, prepared: pa.Table, expect_count: int | None = None) -> int:
        """The second half of an append: commit rows returned by :meth:`prepare` (one new
        fragment); returns the rows inserted. A retry after an unknown outcome must go through
        the idempotent append (or :meth:`prepare` again), not repeat this.

        ``expect_count``: the row count :meth:`prepare` numbered the rows from; if the table
        holds another number (another writer appended in between) nothing is written and
        :class:`StoreError` says so."""
        if expect_count is not None and (held := self.count()) != expect_count and self._numbered_to() != expect_count:
            raise ConcurrentAppend(
                f"cannot append to {self.table_name!r}: the rows were numbered for a table of {expect_count} "
                f"rows, but it holds {held}: another process appended in between. Nothing was written. A "
                "run has one driver (replay_pipeline/system/lease.py), so this is a second process on the same "
                "table (another root on the same buffer.uri?); stopping rather than interleaving two runs' "
                "steps. `python -m flows.query runs` shows who holds each run")
        self._dataset().insert(prepared)
        self.last_appended = prepared
        return prepared.num_rows

    def _numbered_to(self) -> int:
        """The number the next appended row is counted from: the row count here; a table that
        numbers its rows (RolloutStore's seq) says one past its largest number, which differs
        from the count once a repair lost rows. Asked only when the count does not match."""
        return self.count()

    # ------------------------------------------------------------------ reading
    def _dataset(self, table: Any = None) -> Any:
        """The Lance dataset behind ``table`` (default: the live table at its newest version).

        The live dataset is reopened only when the version changed (an own append moves it
        along in place), and every dataset shares one cache session, so index pages stay
        cached from one version to the next.
        """
        if table is not None:
            return table.to_lance(session=self._session())
        version = self._table.version  # checks for other writers' commits
        if self._live is None or self._live.version != version:
            self._live = self._table.to_lance(session=self._session())
        return self._live

    def _session(self) -> Any:
        if self._cache is None:
            self._cache = self._table.to_lance().session()
        return self._cache

    def _query(
        self, where: str | None, columns: Sequence[str] | None, table: Any = None, limit: int | None = None
    ) -> pa.Table:
        """Rows matching ``where`` (pushed down; None: all), with only ``columns``, unordered
        (:func:`read_rows`: a damaged table raises :class:`DamagedTable`)."""
        return read_rows(self._dataset(table), where, columns, limit, table=self.table_name, run_id=self.run_id,
                         uri=self.uri)

    def _check_columns(self, columns: Sequence[str] | None) -> list[str] | None:
        if columns is None:
            return None
        columns = list(columns)
        unknown = [c for c in columns if c not in self.SCHEMA.names]
        if unknown:
            raise StoreError(f"unknown columns {unknown}; the {self.KIND} table has {self.SCHEMA.names}")
        return columns

    def _fetch_columns(self, columns: Sequence[str] | None) -> list[str] | None:
        """``columns`` plus the sort key (None: every column)."""
        return None if columns is None else list(dict.fromkeys([*columns, *self.ORDER]))

    def _empty(self, columns: Sequence[str] | None) -> pa.Table:
        empty = self.SCHEMA.empty_table()
        return empty if columns is None else empty.select(list(columns))

    def _sorted(self, out: pa.Table, columns: Sequence[str] | None) -> pa.Table:
        if not in_order(out, self.ORDER):
            out = out.sort_by([(c, "ascending") for c in self.ORDER])
        return out if columns is None else out.select(list(columns))

    def _ordered(self, where: str | None, columns: Sequence[str] | None, table: Any = None) -> pa.Table:
        """Rows matching ``where`` (pushed down), sorted by ``ORDER``, with only ``columns``."""
        columns = self._check_columns(columns)
        return self._sorted(self._query(where, self._fetch_columns(columns), table), columns)

    def count(self) -> int:
        """Rows stored (all writers' commits so far)."""
        return self._table.count_rows()

    def count_where(self, where: str) -> int:
        """Rows matching ``where`` (:func:`read_rows`: a damaged table raises :class:`DamagedTable`)."""
        return int(read_rows(self._dataset(), where, None, table=self.table_name, run_id=self.run_id,
                             uri=self.uri, count=True))

    def damage(self, deep: bool = True) -> list[DamagedFile]:
        """The unreadable data files of the current version ([] if none): :func:`scan_damage`
        (``deep=False`` only opens each file: cheap, but misses damage inside its pages)."""
        return scan_damage(self._dataset(), deep=deep)

    def check_intact(self, deep: bool = True) -> None:
        """Raise :class:`DamagedTable` if :meth:`damage` finds unreadable files."""
        found = self.damage(deep=deep)
        if found:
            raise DamagedTable(self.table_name, self.run_id, self.version, found, self.uri)

    def compact(self) -> None:
        """Merge the small per-append fragments, add the new rows to every index, and drop
        untagged versions older than a week (what lancedb's ``optimize`` does, with a smaller
        fragment target, see :data:`COMPACT_TARGET_ROWS`); creates any index the table lacks.
        Rows and tagged versions are kept. A run calls this every ``buffer.compact_every``
        steps so appends and reads stay fast."""
        self._ensure_indexes()
        if self.count() == 0:
            return
        self._dataset().optimize.compact_files(target_rows_per_fragment=COMPACT_TARGET_ROWS)
        self._dataset().optimize.optimize_indices()
        self._dataset().cleanup_old_versions(older_than=_KEEP_VERSIONS, error_if_tagged_old_versions=False)

    # ------------------------------------------------------------------ versions and tags
    @property
    def version(self) -> int:
        """The table's current (newest) Lance version."""
        return int(self._table.version)

    @property
    def table(self) -> Any:
        """The underlying ``lancedb`` table (for fork/shallow_clone, maintenance and queries)."""
        return self._table

    def tags(self) -> dict[str, int]:
        """Tag name -> table version."""
        return {name: int(info["version"]) for name, info in self._table.tags.list().items()}

    def tag(self, name: str, version: int | None = None) -> None:
        """Tag ``version`` (default: the current one) as ``name``.

        Idempotent: re-tagging the same version is a no-op; a tag that already points at a
        different version is an error (tags are never moved). Names may use letters, digits,
        ``.``, ``-`` and ``_``.
        """
        version = self.version if version is None else int(version)
        existing = self.tags()
        if name in existing:
            if existing[name] == version:
                return
            raise StoreError(
                f"tag {name!r} on {self.table_name!r} already points at version {existing[name]}, "
                f"not {version}; tags are never moved, choose another name"
            )
        try:
            self._table.tags.create(name, version)
        except (RuntimeError, ValueError) as exc:
            if self.tags().get(name) == version:  # created concurrently by a retry of the same call
                return
            raise StoreError(f"cannot tag version {version} of {self.table_name!r} as {name!r}: {exc}") from exc

    def read_at(self, tag_or_version: str | int, columns: Sequence[str] | None = None) -> pa.Table:
        """The whole table as it was at a tag or version, sorted by ``ORDER``.

        Reads through a separate handle, so this store keeps following the newest version.
        """
        if isinstance(tag_or_version, str):
            tags = self.tags()
            if tag_or_version not in tags:
                raise StoreError(f"no tag {tag_or_version!r} on {self.table_name!r}; tags: {sorted(tags) or 'none'}")
            version = tags[tag_or_version]
        elif isinstance(tag_or_version, (int, np.integer)) and not isinstance(tag_or_version, bool):
            version = int(tag_or_version)
        else:
            raise StoreError(f"read_at takes a tag name or a version number, got {tag_or_version!r}")
        try:
            old = self._db.open_table(self.table_name, version=version)
        except (ValueError, RuntimeError) as exc:
            raise StoreError(
                f"cannot read version {version} of {self.table_name!r} (current version {self.version}): {exc}"
            ) from exc
        return self._ordered(None, columns, table=old)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(uri={self.uri!r}, run_id={self.run_id!r}, version={self.version})"
