"""The transformers versions tpmap is proven on, and the check that refuses others.

`TRANSFORMERS` is the range of pyproject.toml's transformers dependency (tests/test_versions.py keeps the two
equal) and the range CI proves: `.ci/run` lints and verifies every shipped mapping on its oldest release and runs
the whole suite on the newest. Module structures change between transformers releases (CodeGen's fused q/v/k
moved from a local constant to an attribute in 5.24), so a mapping proven on one release can be wrong on another;
`tpmap.apply` refuses an untested release instead of guessing. ``TPMAP_UNTESTED_TRANSFORMERS=1`` turns the
refusal into a warning, for trying a newer release (then run ``tpmap verify`` on the model types you use).
"""
from __future__ import annotations

import os

import transformers

from tpmap.api_errors import TransformersVersionError, warn
from tpmap.language.schema import release_matches

TRANSFORMERS = ">=5.23,<5.25"
PROVEN = ("5.23.0", "5.24.0")  # the oldest and the newest release of the range: what .ci/run installs
OVERRIDE = "TPMAP_UNTESTED_TRANSFORMERS"


def check_transformers(version: str | None = None) -> None:
    """Raise `TransformersVersionError` when the installed transformers is outside `TRANSFORMERS`."""
    version = version or transformers.__version__
    if mapping_applies(TRANSFORMERS, version):
        return
    message = (f"transformers {version} is outside the range tpmap is tested on (transformers{TRANSFORMERS}, "
               f"proven on {' and '.join(PROVEN)}): install one of those, e.g. pip install 'transformers"
               f"{TRANSFORMERS}', or set {OVERRIDE}=1 to try it anyway and check your model with tpmap verify")
    if os.environ.get(OVERRIDE) == "1":
        warn(message)
        return
    raise TransformersVersionError(message)


def mapping_applies(spec: str | None, version: str | None = None) -> bool:
    """Whether a mapping's own `transformers` range (None: tpmap's whole range) admits the installed version."""
    return release_matches(spec, version)
