"""Process plumbing, below everything else: where a run's files live (runs), the run lease that
lets one process drive a run (lease), stopping on a signal (stopping), fault injection for the
crash tests (faults), the interpreter's garbage collector at start-up and exit (heap,
process_exit) and operating-system thread names (threadnames).

Nothing here knows about RL: these modules import only the standard library and each other.
"""
