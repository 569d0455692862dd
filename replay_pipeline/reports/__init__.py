"""Reading runs back: offline analysis of rollout and usage tables (analysis), the evidence a
sweep's headline rests on (evidence), a sweep's report (report), one run's plots (run_plots), what
the rollout viewer shows (viewer) and curated exports (export).

The top of the library: these read what runs stored and never change it.
"""
