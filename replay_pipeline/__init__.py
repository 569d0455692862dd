"""replay-pipeline: RL post-training for LLMs with experience replay.

The library side: tasks and rewards, models, generation backends, the rollout table and
sampling (buffer), objectives, the learner, compute ledger, tracking and checkpoints.
`flows/` wires these into Prefect flows; everything here works without Prefect.
"""

__version__ = "0.1.0"
