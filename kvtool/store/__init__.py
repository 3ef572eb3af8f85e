"""The store's side of kvtool's tools: what runs it and what reads it from outside the engines.

- ``mooncake``: the Mooncake master's and standalone store's command lines, environment and client
  config files (and LMCache's server, the other store process a pair may start).
- ``master``: a loopback ``mooncake_master`` on free ports, started and stopped by pid (tests and
  benchmarks), and a loopback etcd for a master group in high-availability mode.
- ``admin``: the master's HTTP admin API (keys, object sizes, metrics), behind ``StoreAdmin``, and
  waiting for a key (a save's durability).

The engines' side (keys, objects, the store client behind time-outs and a breaker) is ``connector/``.
"""
