"""`tpmap.parallelize`: a tensor-parallel model driven from one plain process (docs/parallelize.md).

* `handle`         -- `parallelize()` and its `Parallelized` handle: start the workers, forward calls to them
* `rank_processes` -- a pool of rank processes on this machine: spawn once, run many tasks, report crashes
                      and hangs (also the tests' and `tpmap verify`'s `RankPool`)
* `worker`         -- what each worker runs: load its shard once, then answer calls
* `wire`           -- the message format between the driving process and its workers (tensors out of band)
* `call_checks`    -- what a call through the handle is checked for on every worker, before the model runs

`tpmap.parallelize` (the attribute of `tpmap`) is the function; this package is `tpmap.parallelize.*`.
"""
