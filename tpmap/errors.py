"""The errors tpmap raises, under their public name (`from tpmap.errors import TpmapError`).

Each floor defines its own, beside it, all subclassing `TpmapError` (a ValueError):

* `tpmap.language.errors`    -- mapping files and what they name (positions, patterns, config attributes, sizes)
* `tpmap.engine.errors`      -- a model the engine cannot shard as it is
* `tpmap.api_errors`         -- the call to `apply`: process group, meta tensors, inputs, installed transformers
* `tpmap.checkpoint.errors`  -- checkpoint folders and files, and a failure on another rank
* `tpmap.parallelize.errors` -- `tpmap.parallelize` and its handle
* `tpmap.tool_errors`        -- `tpmap draft` and `tpmap verify`
* `tpmap.training.errors`    -- training checkpoints (`tpmap.training`)
"""
from tpmap.api_errors import *  # noqa: F403
from tpmap.api_errors import __all__ as _api
from tpmap.checkpoint.errors import *  # noqa: F403
from tpmap.checkpoint.errors import __all__ as _checkpoint
from tpmap.engine.errors import *  # noqa: F403
from tpmap.engine.errors import __all__ as _engine
from tpmap.language.errors import *  # noqa: F403
from tpmap.language.errors import __all__ as _language
from tpmap.parallelize.errors import *  # noqa: F403
from tpmap.parallelize.errors import __all__ as _parallelize
from tpmap.tool_errors import *  # noqa: F403
from tpmap.tool_errors import __all__ as _tools
from tpmap.training.errors import *  # noqa: F403
from tpmap.training.errors import __all__ as _training

__all__ = sorted({*_language, *_engine, *_api, *_checkpoint, *_parallelize, *_tools, *_training})
