"""Legacy one-stage MTP support file of DeepSeek-V4-Flash (ds4-spec §1.2): one V4 block under
`mtp.0.` with the projections e_proj / h_proj, their norms, and an HC head; no embedding and no
output head (the target's are used). The file has no keys of its own: everything is read from
its tensors and completed by the target when paired."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...gguf.reader import GGUFFile
from ..deepseek4.config import Config as V4Config
from ..deepseek4.support import block_shapes, paired_block, tensor_shape

ARCH = "deepseek4-mtp"   # what our writer records; ds4's own files are recognised by their tensors
MAX_DRAFT = 16           # --mtp-draft N: tokens per cycle, the chosen one included


def is_legacy_mtp(f: GGUFFile) -> bool:
    """ds4's rule: a support file is DSpark when it has main_proj (and the heads); one with the
    MTP projections and no main_proj is the legacy one-stage MTP file."""
    return "mtp.0.e_proj.weight" in f.tensors and "mtp.0.main_proj.weight" not in f.tensors


@dataclass(frozen=True)
class Config:
    block: V4Config           # the MTP block's V4 shapes (from the tensors)

    @property
    def n_layers(self) -> int:
        return 1

    @property
    def n_embd(self) -> int:
        return self.block.n_embd

    @property
    def n_vocab(self) -> int:
        return self.block.n_vocab   # 0 until paired: the file has no vocabulary-sized tensor

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Config":
        hc, = tensor_shape(f, "mtp.0.hc_head_base.weight", 1)
        return cls(block_shapes(f, 1, hc, vocab=0))


def paired_with(cfg: Config, target: V4Config) -> Config:
    """The block with the target's hyper-parameters, after checking the shared shapes."""
    return replace(cfg, block=paired_block(replace(cfg.block, n_vocab=target.n_vocab), target,
                                           ("n_embd", "n_head", "head_dim", "q_lora_rank", "hc"), []))
