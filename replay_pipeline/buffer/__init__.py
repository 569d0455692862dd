"""The replay buffer: the run's versioned LanceDB rollout table and queries over it."""

from .schema import INPUT_COLUMNS, ROLLOUT_SCHEMA, SchemaMismatch, make_rollout_id, rows_to_table
from .store import RolloutStore, StoreError

__all__ = [
    "INPUT_COLUMNS",
    "ROLLOUT_SCHEMA",
    "RolloutStore",
    "SchemaMismatch",
    "StoreError",
    "make_rollout_id",
    "rows_to_table",
]
