"""One training run, as the loop it is. Rooms, from the top floor down (each imports only
rooms below it):

    loop.py        the one-screen loop: a round, an async round, the evaluation/checkpoint schedule
    build.py       from a validated configuration to a run ready for its first round
    phases.py      the run's state and its phases: generate, score, append, sample, learn, evaluate, checkpoint
    preflight.py   the configuration's I/O checks, before any work
    replay.py      replay sampling and the reuse metrics (handed the tables and settings, not the run)
    lineage.py     resume, fork, checkpoint state, run.json
    accounting.py  the compute ledger's metrics, the pipeline's overhead, the summary
    settings.py    the frozen runtime form of the configuration and its derived values
    workers.py     the async loop's generator workers (local processes or Ray actors)
    batches.py     what the learner and the workers share: prompts, seeds, a batch generated and scored
    files.py       the async file protocol (STOP, heartbeat, ready markers, stats): ground floor

The package imports none of them, so a generator process imports only what it runs.
"""
