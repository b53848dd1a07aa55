"""Drafters for the speculative loop (runtime/speculative.py), and the one place the speculation
flags are turned into a drafter: the model's family lists the drafters it offers and the flags
that enable each (families.DraftSpec), `_generic()` the ones every family has (ONNX draft heads over
the target's hidden state); the artifact says which were compiled in."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from ...errors import Ds4Error


@dataclass(frozen=True)
class SpecOptions:
    """The speculation flags of `ds4 run / serve / bench` (ds4's meanings). mtp: the support file
    (--mtp FILE), "" for a bare --mtp (the draft layer in the model GGUF), None when absent;
    draft_onnx likewise: the heads to compile in (--draft-onnx FILE), "" for the compiled ones."""
    mtp: str | None = None
    draft_onnx: str | None = None
    mtp_draft: int = 1
    mtp_margin: float | None = None
    mtp_timing: bool = False
    dspark: bool = False
    dspark_confidence: float | None = None
    dspark_strict: bool = False
    exact_sampling: bool = False
    quality: bool = False

    def __post_init__(self):
        if self.draft_onnx is not None and self.mtp is not None:
            raise Ds4Error("--draft-onnx and --mtp: choose one drafter")

    @property
    def support(self) -> Path | None:
        return Path(self.mtp) if self.mtp else None

    @property
    def heads(self) -> Path | None:
        return Path(self.draft_onnx) if self.draft_onnx else None


def _generic():
    from ...families import DraftSpec

    return (DraftSpec("onnx", "ONNX draft heads", "--draft-onnx", support=None,
                      enabled=lambda o: o.draft_onnx is not None, drafter="onnx",
                      compile_with="ds4-compile --draft-onnx HEADS.onnx"),)


def drafter_tag(drafter) -> str:
    """What a checkpoint says besides the target's state: the drafter whose states it fed."""
    return type(drafter).__name__.lower().removesuffix("drafter") if drafter is not None else ""


def wanted(family, options: SpecOptions) -> list:
    """The family's drafters (DraftSpec) and the generic ones that the flags ask for."""
    if family.check_speculation is not None:
        family.check_speculation(options)
    asked = [d for d in (*family.drafters, *_generic()) if d.enabled(options)]
    if options.mtp is not None and not asked:   # --mtp alone would be accepted and do nothing
        flag = f"--mtp {options.mtp}" if options.mtp else "--mtp"
        how = "; ".join(f"{d.label}: {d.flags}" for d in family.drafters) or "none"
        raise Ds4Error(f"{flag}: enables no drafter of {family.name} by itself; its drafters: {how}")
    return asked


def check_support_given(family, options: SpecOptions, model: Path) -> None:
    """Before a GGUF is compiled on first use: a drafter that reads a support file needs --mtp FILE,
    and that file must hold this drafter."""
    from ...families import family_for
    from ...gguf import open_gguf

    family.check_support_file(options.support)
    for d in wanted(family, options):
        if d.support is None:
            continue
        if options.support is None:
            raise Ds4Error(f"{d.flags} needs the {d.label} support file: pass --mtp SUPPORT.gguf with {model}")
        held = family.drafter_for_support(family_for(open_gguf(options.support)))
        if held is not None and held.name != d.name:
            raise Ds4Error(f"{options.support}: holds the {held.name} drafter; {d.flags} needs a {d.label} "
                           f"support file")


def choose_drafter(engine, options: SpecOptions, model: Path):
    """The drafter the flags ask for, built (and so checked) on this engine; None for target-only
    decoding (no speculation flag, --quality, or a drafter's own check-only flag)."""
    from ...families import family_named

    asked = wanted(family_named(engine.manifest.family), options)
    if len(asked) > 1:
        raise Ds4Error(f"{' and '.join(d.flags for d in asked)}: choose one drafter")
    if not asked:
        return None
    d = asked[0]
    if d.name not in engine.drafters:
        held = ", ".join(engine.drafters) or "no"
        support = engine.manifest.weights.get("support", {}).get("gguf_path")
        if support and engine.drafters and d.support is not None:
            raise Ds4Error(f"{support}: holds the {held} drafter; {d.flags} needs a {d.label} support file")
        raise Ds4Error(f"{model}: the artifact has no {d.label} drafter (it holds {held} drafter); "
                       f"compile it with {d.compile_with}")
    drafter = importlib.import_module(f"{__name__}.{d.drafter}").from_options(engine, options)
    return None if options.quality else drafter
