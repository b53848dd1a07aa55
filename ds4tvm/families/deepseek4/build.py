"""DeepSeek-V4-Flash's entry points for the pipeline: the module (with the drafter its support file
holds), its bounds, and the published shapes for --shapes-only."""

from __future__ import annotations

from dataclasses import replace

from ...errors import Ds4Error
from ..contract import Build, BuildRequest, load_attr, module_build


def check_bounds(cfg, bounds) -> None:
    # ratio-128 layers keep one compressed row per 128 positions: the context is a multiple of it
    if bounds.max_context % 128 or bounds.max_context <= 0:
        raise Ds4Error(f"--max-context {bounds.max_context}: expected a positive multiple of 128")


def _window_within_context(cfg, max_context: int):
    """cfg with its sliding window cut to the context: a window longer than the context reads every
    position, as one of the context's length does, and the rings it sizes would only waste memory."""
    if hasattr(cfg, "block"):   # a support file's config: its V4 blocks
        return replace(cfg, block=_window_within_context(cfg.block, max_context))
    return replace(cfg, sliding_window=min(cfg.sliding_window, max_context))


def build(req: BuildRequest) -> Build:
    from .model import DeepSeekV4

    req = replace(req, config=_window_within_context(req.config, req.bounds.max_context),
                  support_config=None if req.support_config is None
                  else _window_within_context(req.support_config, req.bounds.max_context))
    if req.support is None:
        module = DeepSeekV4(req.config, req.types, req.bounds, kv_rounding=req.kv_rounding)
    else:   # the support file's family extends the target class with its drafter's functions
        cls = load_attr(f"ds4tvm.families.{req.support.name}.model:extend")(DeepSeekV4)
        module = cls(req.config, req.types, req.bounds, req.kv_rounding, req.support_config, req.support_types)
    return module_build(module, req.forms)


def published() -> BuildRequest:
    """DeepSeek-V4-Flash with its DSpark drafter at the published shapes and Q2 recipe types."""
    from ..dspark import FAMILY as DSPARK
    from ..dspark.tensors import tensor_specs as dspark_specs
    from .published import flash_config, flash_dspark_config, q2_recipe_type
    from .tensors import tensor_specs

    cfg = flash_config()
    dcfg = flash_dspark_config(cfg)
    return BuildRequest(cfg, {s.name: q2_recipe_type(s) for s in tensor_specs(cfg)}, None, True, DSPARK, dcfg,
                        {s.name: q2_recipe_type(s) for s in dspark_specs(dcfg)})
