"""The error of training checkpoints (`tpmap.training`)."""
from __future__ import annotations

from tpmap.language.errors import TpmapError

__all__ = ["TrainingCheckpointError"]


class TrainingCheckpointError(TpmapError):
    """A training checkpoint cannot be saved or resumed as asked: another model, mapping or optimizer, a missing,
    truncated or corrupted file, or a run shape the mapping cannot serve. `tpmap.training.load` raises it on every
    rank alike, before any rank has changed its model, optimizer or RNG."""
