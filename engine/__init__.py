"""tpmap's generic engine (installed as ``tpmap.engine``): plan, slice, replace, communicate.

It reads the mapping language (`tpmap.language`), torch and transformers, and nothing else of tpmap.

* `planner`         -- mapping + model structure -> a `plan.Plan` (checks everything, touches no tensor)
* `whole_model`     -- the planner's whole-model features: vocab_parallel, grad_allreduce, tied parameters
* `plan`            -- the plan's data: what every rank holds and does
* `pieces`          -- which (start, length) ranges of a split dim each rank holds
* `quant_blocks`    -- weights quantized in blocks: shard boundaries that would cut a block
* `shard`           -- execute a plan on one rank (slice tensors, swap modules, set attributes, hooks)
* `layers`          -- the parallel modules (Column/Row linear, Column and vocab-parallel embedding, norms)
* `collectives`     -- autograd collectives in Megatron's named forward/backward pairs
* `rng`             -- dropout RNG regions
* `loss`            -- the cross-entropy of vocabulary-sharded logits
* `slice_io`        -- the byte runs of a rank's slice in a stored tensor (checkpoint reads)
* `blocks`          -- the repeated blocks of a model
* `sequence_plan`   -- where sequence parallelism's collectives go, and what it refuses
* `sequence`        -- installs sequence parallelism on a model: its hooks and its state
* `sequence_state`  -- sequence parallelism's per-forward state, called by the blocks' Columns and Rows
* `sequence_hooks`  -- sequence parallelism's hooks, grouped by what they hook
* `shm`             -- same-host shared-memory collectives for CPU ranks (chosen per group, gloo otherwise)
* `symm_mem`        -- the opt-in symmetric-memory all-reduce for small CUDA messages
* `errors`          -- the engine's errors (a model the mapping cannot shard as it is)
"""
