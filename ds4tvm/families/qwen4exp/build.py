"""Qwen3.8 Flash Next's entry points for the pipeline: the module and its bounds."""

from __future__ import annotations

from ...artifact import Bounds
from ...errors import Ds4Error
from ..contract import Build, BuildRequest, module_build

# a real-size GDN snapshot is 36 layers x 48 heads x 128 x 128 floats = 108 MiB, and each layer keeps
# max_verify + 1 of them: the MTP cycle verifies up to 3 rows
DEFAULT_BOUNDS = Bounds(max_verify=3)


def check_bounds(cfg, bounds) -> None:
    ratios = sorted({cfg.ratio(i) for i in range(cfg.n_layers) if not cfg.is_gdn(i)})
    if bounds.max_context <= 0 or any(bounds.max_context % r for r in ratios):
        raise Ds4Error(f"--max-context {bounds.max_context}: expected a positive multiple of the QSA block size "
                       f"{ratios[-1] if ratios else 1}")


def build(req: BuildRequest) -> Build:
    from .model import Qwen4Exp
    from .mtp import Qwen4ExpWithMTP

    cls = Qwen4ExpWithMTP if req.config.n_nextn else Qwen4Exp   # the nextn layer is in the same GGUF
    return module_build(cls(req.config, req.types, req.bounds), req.forms)


def published() -> BuildRequest:
    """Qwen3.8 Flash Next at its published shapes and Q4K recipe types (ds4-spec §1.5)."""
    from .published import published_config, q4k_recipe_type
    from .tensors import tensor_specs

    cfg = published_config()
    return BuildRequest(cfg, {s.name: q4k_recipe_type(s) for s in tensor_specs(cfg)}, None, True)
