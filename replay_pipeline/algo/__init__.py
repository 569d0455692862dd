"""The paper's math, pure: rewards and frozen group advantages (scoring), the policy objectives
(objectives), the compute ledger (compute), the replay planner and its noise parameters (planner,
noise), adaptive reuse rules (reuse) and per-value bounds (bounds).

Plain functions over tensors, arrays and numbers: no configuration objects, no I/O, no lancedb,
prefect or mlflow (DESIGN.md principles 6 and 10), so each is tested against hand-worked numbers.
"""
