"""The replay buffer: the run's versioned LanceDB rollout and usage tables, queries over
them, and the sampling strategies that draw minibatches from the window."""

from .schema import INPUT_COLUMNS, ROLLOUT_SCHEMA, SchemaMismatch, make_rollout_id, rows_to_table
from .store import RolloutStore, StoreError
from .usage import USAGE_SCHEMA, UsageStore, make_usage_id

__all__ = [
    "INPUT_COLUMNS",
    "ROLLOUT_SCHEMA",
    "RolloutStore",
    "SchemaMismatch",
    "StoreError",
    "USAGE_SCHEMA",
    "UsageStore",
    "make_usage_id",
    "make_rollout_id",
    "rows_to_table",
]
