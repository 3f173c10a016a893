"""The mapping language, tpmap's bottom layer: what a mapping file may say and how it is read.

* `schema`   -- the pydantic models of a mapping file (entry kinds, fields, verify configs)
* `expr`     -- per-rank size expressions (``num_attention_heads // tp_size``, ``per_rank(...)``)
* `source`   -- reading a mapping's YAML with the position of every node; the shipped mappings
* `patterns` -- module-path globs (``layers.*.self_attn.q_proj``)
* `errors`   -- every error tpmap raises, located ones printing as ``path:line:col: message``

It imports nothing of the engine or of the tools above it.
"""
