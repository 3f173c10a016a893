"""tpmap's generic engine (installed as ``tpmap.engine``): plan, slice, replace, communicate.

* `plan`        -- mapping + model structure -> pure-data plan (checks everything, touches no tensor)
* `shard`       -- execute a plan on one rank (slice tensors, swap modules, set attributes)
* `layers`      -- the parallel modules (Column/Row linear, Column embedding)
* `collectives` -- autograd collectives in Megatron's named pairs
"""
