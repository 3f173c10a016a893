"""Training a tpmap model: `tpmap.training.trainer` (Hugging Face `Trainer` on a tensor-parallel model, alone or
inside data parallelism) and `tpmap.training.checkpoint` (the whole training state, saved and resumed)."""
