"""Experiment tracking: one MLflow run per training run behind a small interface (tracker), the
per-round metrics written straight into MLflow's SQLite store (mlflow_sqlite), and new SQLite
databases made from kept templates for MLflow and the private Prefect server (sqlite_templates).
"""
