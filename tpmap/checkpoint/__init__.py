"""Checkpoints: each rank reads only its own slices, and rank 0 writes a standard checkpoint back.

* `safetensors` -- safetensors files: headers, byte reads, the writer
* `conversion`  -- checkpoint names and layouts -> the model's tensors (transformers' renames and
  conversions), read lazily where a rank needs a slice
* `load`        -- `tpmap.from_pretrained`
* `save`        -- `tpmap.save_pretrained`
"""
