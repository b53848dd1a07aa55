"""DSpark drafter support file for DeepSeek-V4-Flash (`deepseek4-dspark`)."""

from ..contract import Family
from .config import ARCH, Config
from .tensors import tensor_specs

FAMILY = Family(name="dspark", title="DeepSeek-V4-Flash DSpark support", architecture=ARCH, role="draft", config_from_gguf=Config.from_gguf,
                tensor_specs=tensor_specs, pair="ds4tvm.families.dspark.config:paired_with")
