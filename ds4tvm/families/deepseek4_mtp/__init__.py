"""Legacy one-stage MTP support file for DeepSeek-V4-Flash (ds4-spec §1.2, §7)."""

from ..contract import Family
from .config import ARCH, Config, is_legacy_mtp
from .tensors import tensor_specs

FAMILY = Family(name="deepseek4_mtp", title="DeepSeek-V4-Flash legacy MTP support", architecture=ARCH, role="draft", config_from_gguf=Config.from_gguf,
                tensor_specs=tensor_specs, claims=is_legacy_mtp,
                pair="ds4tvm.families.deepseek4_mtp.config:paired_with")
