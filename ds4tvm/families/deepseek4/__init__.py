"""DeepSeek-V4-Flash (`deepseek4`): hyper-connections, compressed sparse attention, hash + routed MoE."""

from .. import Family
from .config import ARCH, Config
from .tensors import tensor_specs

FAMILY = Family(name="deepseek4", architecture=ARCH, role="target",
                config_from_gguf=Config.from_gguf, tensor_specs=tensor_specs)
