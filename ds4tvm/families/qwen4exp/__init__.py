"""Qwen3.8 Flash Next (`qwen4exp`, ds4-spec §1.5 and §5): Gated DeltaNet and gated attention with the
QSA indexer under the low-rank HC mixer, softmax-routed MoE, and PLE n-gram rows read lazily from
the GGUF on the host (ple.py); the MTP (nextn) layer of the GGUF drafts (mtp.py)."""

from ..contract import DraftSpec, Family, nextn_speculation
from .build import DEFAULT_BOUNDS, check_bounds
from .config import ARCH, Config
from .tensors import tensor_specs

_HERE = "ds4tvm.families.qwen4exp"

FAMILY = Family(
    name="qwen4exp", title="Qwen3.8 Flash Next", architecture=ARCH, role="target", config_from_gguf=Config.from_gguf, tensor_specs=tensor_specs,
    build=f"{_HERE}.build:build", check_bounds=check_bounds, default_bounds=DEFAULT_BOUNDS,
    describe=Config.describe, hf_model_types=("qwen4_exp", "qwen4_exp_text"), convert=f"{_HERE}.convert:convert_hf",
    published=f"{_HERE}.build:published", batches=True,
    check_speculation=nextn_speculation("Qwen3.8", 3, "drafts 1 or 2 tokens (3 rows per cycle with the chosen one; "
                                                      "DS4_QWEN4_MTP_DEPTH=2|3 pins the depth)"),
    host_inputs={"ple": f"{_HERE}.ple:host_rows"}, tool_syntax=f"{_HERE}.tools:QwenToolSyntax",
    drafters=(DraftSpec("qwen_mtp", "Qwen3.8 MTP", "--mtp", support=None,
                        enabled=lambda o: o.mtp is not None or o.mtp_timing,
                        drafter="qwen_mtp",
                        compile_with="a Qwen3.8 GGUF that holds its nextn (MTP) layer"),),
)
