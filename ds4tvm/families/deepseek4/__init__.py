"""DeepSeek-V4-Flash (`deepseek4`): hyper-connections, compressed sparse attention, hash + routed MoE.
Drafters: DSpark (`--mtp DSPARK.gguf --dspark`) and the legacy one-stage MTP
(`--mtp MTP.gguf --mtp-draft N`), each from its own support file."""

from ..contract import DraftSpec, Family
from .build import check_bounds
from .config import ARCH, Config
from .tensors import tensor_specs

_HERE = "ds4tvm.families.deepseek4"

FAMILY = Family(
    name="deepseek4", title="DeepSeek-V4-Flash", architecture=ARCH, role="target", config_from_gguf=Config.from_gguf,
    tensor_specs=tensor_specs,
    build=f"{_HERE}.build:build", check_bounds=check_bounds,   # default_bounds: Bounds() (max-verify 16)
    drafters=(
        DraftSpec("dspark", "DSpark", "--dspark", support="dspark",
                  enabled=lambda o: o.dspark or o.dspark_confidence is not None or o.dspark_strict,
                  drafter="dspark"),
        DraftSpec("mtp", "legacy MTP", "--mtp-draft", support="deepseek4_mtp",
                  enabled=lambda o: o.mtp_draft > 1 or o.mtp_timing,
                  drafter="mtp"),
    ),
    tool_syntax=f"{_HERE}.tools:DSMLToolSyntax", chat_template="ds4tvm.gguf.vocab:CHAT_TEMPLATE",
    hf_model_types=("deepseek_v4",), convert="ds4tvm.families.deepseek4.convert:convert_hf",
    published=f"{_HERE}.build:published", batches=True,
)
