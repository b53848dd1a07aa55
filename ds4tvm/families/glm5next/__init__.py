"""GLM-5.3-Flash (`glm5-next`, ds4-spec §1.4 and §4): KDA linear attention and DSA (MLA without RoPE
with the pooled sparse indexer) under mHC, MoE with a sigmoid router; GGUFs in ds4's layout or
llama.cpp's both load (config.py, tensors.py)."""

from ..contract import DraftSpec, Family, nextn_speculation
from .build import DEFAULT_BOUNDS, check_bounds
from .config import ARCH, Config
from .tensors import tensor_specs

_HERE = "ds4tvm.families.glm5next"

FAMILY = Family(
    name="glm5next", title="GLM-5.3-Flash", architecture=ARCH, role="target", config_from_gguf=Config.from_gguf, tensor_specs=tensor_specs,
    build=f"{_HERE}.build:build", check_bounds=check_bounds, default_bounds=DEFAULT_BOUNDS,
    describe=Config.describe, hf_model_types=("glm5_next",), convert=f"{_HERE}.convert:convert_hf",
    published=f"{_HERE}.build:published", tool_syntax=f"{_HERE}.tools:GLMToolSyntax", batches=True,
    sampling=(1.0, 0.95, 0.0),
    check_speculation=nextn_speculation("GLM-5.3", 2, "drafts one token (2 per cycle with the chosen one)"),
    drafters=(DraftSpec("glm_mtp", "GLM MTP", "--mtp", support=None, enabled=lambda o: o.mtp is not None or o.mtp_timing,
                        drafter="glm_mtp",
                        compile_with="a GLM-5.3 GGUF that holds its nextn (MTP) layer"),),
)
