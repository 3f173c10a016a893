"""Third-party noise that tpmap's own commands trigger, silenced in the command's process and in the ranks it spawns.

`tpmap lint`, `verify`, `demo` and the others import transformers, which imports torchao where it is installed (the
test extra brings it): torchao then logs "Failed to load ..." for kernels built for other machines, and torch logs a
pytree deprecation warning for each of torchao's enums; transformers notes kernel fallbacks ("falling back to its
reference PyTorch implementation") and shows progress bars for tiny models. None of it is about the user's model.
Only the `tpmap` command calls `quiet` (through the environment, so its spawned ranks do too): a program that
imports tpmap keeps every message it would get otherwise.
"""
from __future__ import annotations

import logging
import os

ENV = "TPMAP_QUIET_THIRD_PARTY"  # set by the tpmap command; its spawned ranks inherit it


def quiet() -> None:
    """Silence the messages above, in this process and (through `ENV`) in the processes it spawns. Call it before
    transformers is imported: transformers reads its verbosity once."""
    os.environ[ENV] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def quiet_if_asked() -> None:
    """In a spawned rank: `quiet` where the process that started it asked for it."""
    if os.environ.get(ENV) == "1":
        quiet()
