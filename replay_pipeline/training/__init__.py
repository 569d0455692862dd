"""The policy's side of a run: one optimizer step of an objective on stored rollouts (learner),
checkpoints written atomically and verified on load (checkpoints), policy weights published to
generators (weights), and held-out evaluation (evaluation).

Imports neither lancedb, prefect nor mlflow: these run on a bare torch machine (GPU-CHECK.md).
"""
