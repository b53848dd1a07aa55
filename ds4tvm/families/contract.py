"""The contract between a family and the family-blind pipeline: what a family's entry says
(`Family`), what its builder gets and returns (`BuildRequest`, `Build`) and the drafters it offers
(`DraftSpec`). Families import it; the registry (families/__init__.py) imports the families."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ..artifact import Bounds, FunctionSpec, StateSpec
from ..errors import Ds4Error
from ..gguf.reader import GGUFFile
from ..gguf.validate import TensorSpec
from ..kernels.forms import TE, Forms


def load_attr(path: str):
    """'package.module:attribute' imported on first use: a family's entry names its model, drafter
    and tool-syntax code without importing TVM or the runtime when the registry loads."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class DraftSpec:
    """A drafter a target family offers: its name in the manifest, how users call it (label) and
    the flags that select it (for messages); support: the family name of the support file it
    reads, or None when its weights are in the model GGUF; enabled(options): whether the
    speculation flags (runtime/drafters.SpecOptions) ask for it; drafter: the name of its module in
    runtime/drafters/, whose from_options(engine, options) builds the runtime drafter (families
    name a drafter, they import nothing of the runtime); compile_with: how an artifact gets it (for
    messages)."""
    name: str
    label: str
    flags: str
    support: str | None
    enabled: Callable[[Any], bool]
    drafter: str
    compile_with: str = "--mtp SUPPORT.gguf"


@dataclass
class BuildRequest:
    """What a family's builder gets: its config and tensor types (from the GGUF, or published
    shapes), the bounds, and the support file's family, config and types when one is paired."""
    config: Any
    types: dict
    bounds: Bounds
    kv_rounding: bool = True
    support: "Family | None" = None
    support_config: Any = None
    support_types: dict = field(default_factory=dict)
    forms: Forms = TE   # which kernels the module's blocks emit for the target (Target.forms)


@dataclass
class Build:
    """A family's compiled-to-be model: the nn.Module whose `spec()` names the exported functions,
    the state and function specs written to the manifest, where each parameter comes from
    (id(parameter) -> (GGUF tensor, plane field or None, weight file role)), and the settings of
    each drafter compiled in (manifest `drafters`)."""
    module: Any
    states: list[StateSpec]
    functions: list[FunctionSpec]
    sources: dict[int, tuple[str, str | None, str]]
    drafters: dict[str, dict] = field(default_factory=dict)


def module_build(module, forms: Forms) -> Build:
    """The Build of a family module that lists its own state and function specs, and the settings
    of the drafters compiled into it when it has any (`drafter_settings()`), its blocks set to
    emit `forms`."""
    from ..nn.qweight import parameter_sources, set_forms

    set_forms(module, forms)
    settings = module.drafter_settings() if hasattr(module, "drafter_settings") else {}
    return Build(module, module.state_specs(), module.function_specs(), parameter_sources(module), settings)


@dataclass(frozen=True)
class Family:
    name: str                                       # package name under ds4tvm/families
    architecture: str                               # general.architecture
    role: str                                       # "target" or "draft" (a support file)
    config_from_gguf: Callable[[GGUFFile], Any]     # -> Config with n_layers, n_embd, n_vocab
    tensor_specs: Callable[[Any], list[TensorSpec]]
    # Files whose architecture key does not say what they are (shared with another family, or
    # absent): claims(f) picks this family before the key is looked up.
    claims: Callable[[GGUFFile], bool] | None = None
    build: str | None = None                        # 'module:function', BuildRequest -> Build
    pair: str | None = None                         # support families: 'module:function' (cfg, target_cfg) -> cfg
    check_bounds: Callable[[Any, Bounds], None] | None = None
    default_bounds: Bounds = Bounds()
    drafters: tuple[DraftSpec, ...] = ()
    tool_syntax: str | None = None                  # 'module:Class' of the chat template's tool-call syntax
    chat_template: str | None = None                # 'module:NAME' of a template for GGUFs that carry none
    hf_model_types: tuple[str, ...] = ()            # transformers model_type values `ds4 convert` reads
    convert: str | None = None                      # 'module:function' (hf_dir, out, ...) -> Path
    published: str | None = None                    # 'module:function' () -> BuildRequest, for --shapes-only
    # Host inputs (FunctionSpec kind "host"): name -> 'module:function' (engine, inputs) -> array, computed
    # from the call's other inputs and the engine (its token history): rows of a table too large to
    # bind, read lazily
    host_inputs: dict = field(default_factory=dict)
    # `ds4 inspect`'s lines of what this family's config says beyond its size: cfg -> {label: text}
    describe: Callable[[Any], dict] | None = None
    # The family's own check of the speculation flags (runtime/drafters.SpecOptions), before a drafter
    # is chosen: flags that mean nothing for its drafters are a Ds4Error, not silently ignored
    check_speculation: Callable[[Any], None] | None = None
    title: str = ""                                 # the model's published name, for users (`ds4 inspect`)
    # ds4's sampling defaults for this family's models: (temperature, top-p, min-p)
    sampling: tuple[float, float, float] = (1.0, 1.0, 0.05)
    # whether its module exports batched decodes (Bounds.max_batch > 1: nn/functions.target_functions)
    batches: bool = False

    def drafter_for_support(self, support: "Family") -> DraftSpec | None:
        return next((d for d in self.drafters if d.support == support.name), None)

    def check_support_file(self, support) -> None:
        """--mtp FILE is an error for a family whose drafters read no support file."""
        if support is not None and not any(d.support for d in self.drafters):
            inside = ", ".join(f"{d.label} ({d.flags})" for d in self.drafters) or "none"
            raise Ds4Error(f"--mtp {support}: {self.name} models read no support file; their drafters: {inside}, "
                           f"from the model GGUF itself")


def nextn_speculation(model: str, max_draft: int, drafts: str) -> Callable[[Any], None]:
    """Family.check_speculation of a family whose one drafter is the MTP (nextn) layer inside its GGUF
    (--mtp FILE: Family.check_support_file): DSpark flags, and --mtp-draft above max_draft (rows per
    cycle, the chosen token included), are errors; drafts: what its cycle drafts, for the message."""
    def check(o) -> None:
        if o.dspark or o.dspark_confidence is not None or o.dspark_strict:
            raise Ds4Error(f"--dspark: {model} has no DSpark drafter; its MTP layer is in the main GGUF: pass --mtp")
        if o.mtp_draft > max_draft:
            raise Ds4Error(f"--mtp-draft {o.mtp_draft}: {model}'s MTP cycle {drafts}; pass --mtp")
    return check
