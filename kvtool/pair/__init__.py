"""A producer / consumer pair of vLLM servers and the store they share (``kvtool serve-pair``).

- ``config``: ``ServePairConfig`` (what to run) and its choices; ``engines``: each engine's command
  line, environment and connector configuration; ``preflight``: start-up failures as one sentence.
- ``profiles``: one entry per connector (kvtool, vLLM's Mooncake store connector, LMCache, none):
  what each engine needs to run it.
- ``launch``: start the master (and store), both engines, wait until ready, supervise, stop.
- ``supervise``: restarts of a master that dies or hangs; ``procs``: processes by pid, ports, logs.
- ``smoke``: the first command's round trip (a prompt stored by the producer, found by the consumer).
- ``ready``: the ready file (its model, its contents, its writer) serve-pair writes and bench, inspect
  and the tests read.
"""
