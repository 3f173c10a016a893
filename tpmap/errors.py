"""The errors tpmap raises, under their public name (`from tpmap.errors import TpmapError`).

They are defined in the mapping-language layer, `tpmap.spec.errors`, which every other layer imports.
"""
from tpmap.spec.errors import *  # noqa: F403
from tpmap.spec.errors import __all__  # noqa: F401
