"""GLM-5.3-Flash's entry points for the pipeline: the module (with its MTP layer's functions when the
GGUF has one), its bounds, the published shapes."""

from __future__ import annotations

from ...artifact import Bounds
from ...errors import Ds4Error
from ..contract import Build, BuildRequest, module_build

# a real-size KDA snapshot is 34 layers x 64 heads x 128 x 128 floats = 136 MiB, and each layer keeps
# max_verify + 1 of them: the MTP cycle verifies 2 rows
DEFAULT_BOUNDS = Bounds(max_verify=2)


def check_bounds(cfg, bounds) -> None:
    if bounds.max_context <= 0 or bounds.max_context % cfg.idx_pool:
        raise Ds4Error(f"--max-context {bounds.max_context}: expected a positive multiple of the indexer's pool "
                       f"size {cfg.idx_pool}")


def build(req: BuildRequest) -> Build:
    from .model import GLM5Next
    from .mtp import GLM5NextWithMTP

    cls = GLM5NextWithMTP if req.config.n_nextn else GLM5Next   # the nextn layer is in the same GGUF
    return module_build(cls(req.config, req.types, req.bounds), req.forms)


def published() -> BuildRequest:
    """GLM-5.3-Flash at its published shapes and Q2 recipe types (ds4-spec §1.4)."""
    from .published import published_config, q2_recipe_type
    from .tensors import tensor_specs

    cfg = published_config()
    return BuildRequest(cfg, {s.name: q2_recipe_type(s) for s in tensor_specs(cfg)}, None, True)
