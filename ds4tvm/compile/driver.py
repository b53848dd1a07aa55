"""`ds4-compile`: read and validate a GGUF, build the family's module, compile it for a target
and write the artifact directory."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..artifact import MODEL, Bounds, Manifest, file_identity, file_sha256, width_variant
from ..errors import Ds4Error
from ..families import BuildRequest, family_named, load_attr, load_model, tensor_types
from ..gguf import open_gguf
from . import onnx_heads
from .targets import resolve
from .toolchains import cuda_fatbin, prepare

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id", "tokenizer.ggml.add_bos_token",
                  "tokenizer.ggml.add_eos_token", "tokenizer.chat_template")


class Phases:
    """A progress bar over the compile phases (on stderr, when it is a terminal: redirected, rich
    would leave a blank line where the bar was)."""

    def __init__(self, names: list[str], enabled: bool):
        self.names, self.p = names, None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
            console = Console(stderr=True)
            enabled = console.is_terminal
        if enabled:
            self.p = Progress(TextColumn("ds4-compile"), BarColumn(), TextColumn("{task.description}"),
                              TimeElapsedColumn(), console=console, transient=True)
            self.p.start()
            self.task = self.p.add_task(names[0], total=len(names))
        self.times: dict[str, float] = {}
        self._t = time.time()
        self._i = 0

    def next(self) -> None:
        now = time.time()
        self.times[self.names[self._i]] = round(now - self._t, 3)
        self._t, self._i = now, self._i + 1
        if self.p is not None:
            self.p.update(self.task, advance=1,
                          description=self.names[self._i] if self._i < len(self.names) else "done")

    def close(self) -> None:
        if self.p is not None:
            self.p.stop()


def _tokenizer_data(f, family) -> dict:
    """The GGUF's tokenizer keys; its family's chat template when the file carries none."""
    out = {}
    for key in TOKENIZER_KEYS:
        field = f._reader.get_field(key)
        if field is not None:
            out[key] = field.contents()
    if "tokenizer.chat_template" not in out and family.chat_template is not None:
        out["tokenizer.chat_template"] = load_attr(family.chat_template)
    return out


def _load_pair(gguf_path: Path, support: Path | None):
    """The validated target model and, with --mtp, its support file, checked to be one of the
    drafters the target's family offers and paired with the target's config."""
    m = load_model(open_gguf(gguf_path))
    if m.family.role != "target":
        raise Ds4Error(f"{gguf_path}: is a {m.family.name} {m.family.role} file; compile its target model "
                       f"and pass it with --mtp")
    if m.family.build is None:
        raise Ds4Error(f"{gguf_path}: compiling the {m.family.name} family is not supported yet")
    if support is None:
        return m, None, None
    m.family.check_support_file(support)
    dm = load_model(open_gguf(support))
    offered = [d.support for d in m.family.drafters if d.support]
    if m.family.drafter_for_support(dm.family) is None:
        raise Ds4Error(f"{support}: --mtp expects a support file of {m.family.name} ({', '.join(offered) or 'none'}), "
                       f"got {dm.family.name} ({dm.gguf.architecture})")
    return m, dm, load_attr(dm.family.pair)(dm.config, m.config)


def check_bounds(family, cfg, bounds) -> None:
    if not 1 <= bounds.max_verify <= 64:
        raise Ds4Error(f"--max-verify {bounds.max_verify}: expected 1..64")
    if not 1 <= bounds.prefill_chunk <= bounds.max_context:
        raise Ds4Error(f"--prefill-chunk {bounds.prefill_chunk}: expected 1..max-context")
    if not 1 <= bounds.max_batch <= 64:
        raise Ds4Error(f"--max-batch {bounds.max_batch}: expected 1..64")
    if family.check_bounds is not None:
        family.check_bounds(cfg, bounds)


@dataclass
class CompileRequest:
    """What a compile is asked for beside the model. records: the tuning database to apply (and,
    with tune_trials > 0, to tune into); by default the one shipped for the target
    (schedules/tuning.py). draft_onnx: draft heads to compile in (compile/onnx_heads.py).
    int8_activations: the CPU linears quantize their inputs to int8 (kernels/cpu_int8.py); None: the
    target's default (Target.int8_by_default: yes on CPUs with an int8 dot instruction). report:
    where to write what each function's call runs (schedules/report.py). gpu_forms: True exports a
    CPU target's linears in the GPU forms (their numerics checked here)."""
    target: str
    bounds: Bounds
    kv_rounding: bool = True
    progress: bool = False
    support: Path | None = None
    tune_trials: int = 0
    records: Path | None = None
    draft_onnx: Path | None = None
    int8_activations: bool | None = None
    report: Path | None = None
    gpu_forms: bool | None = None


@dataclass
class _Exported:
    """A family's module built for a target and exported to Relax: its parameters in argument
    order, whether its functions are recorded (records_functions) and at which widths."""
    built: Any
    mod: Any
    named: list
    recording: bool
    widths: dict


def _prepared_target(req: CompileRequest):
    """The Target of req and req with the target's defaults filled in, its flags checked and its
    toolchain set up (for CUDA, before TVM is imported)."""
    tgt_spec = resolve(req.target)
    check_int8_activations(tgt_spec, req.int8_activations)
    if req.int8_activations is None:
        req = replace(req, int8_activations=tgt_spec.int8_by_default())
    if req.tune_trials and tgt_spec.device != "cpu":
        raise Ds4Error(f"--tune: {tgt_spec.name} kernels can only be tuned on their device; tune cpu targets here "
                       f"(schedules/tuning.py), or compile without --tune")
    prepare(tgt_spec.device)
    return tgt_spec, req


def _build_and_export(build: str, build_req: BuildRequest, tgt_spec, req: CompileRequest, phases) -> _Exported:
    """The family's builder run with the target's kernel forms, then the module exported."""
    forms = tgt_spec.forms(req.int8_activations, req.gpu_forms)
    recording = records_functions(tgt_spec, forms)
    build_req.forms = forms
    built = load_attr(build)(build_req)
    phases.next()
    if req.bounds.max_batch > 1 and not any(f.sequences > 1 for f in built.functions):
        raise Ds4Error(f"--max-batch {req.bounds.max_batch}: the {build.split('.')[2]} family has no batched "
                       f"functions yet; compile with --max-batch 1")
    widths = recorded_widths(built.functions, recording, req.bounds)
    mod, named = _export(built.module, widths)
    return _Exported(built, mod, named, recording, widths)


def compile_gguf(gguf_path: Path, out_dir: Path, req: CompileRequest) -> Path:
    """The artifact of a GGUF (and of req.support's drafter) for req.target, written to out_dir."""
    tgt_spec, req = _prepared_target(req)
    import tvm

    m, dm, support_cfg = _load_pair(gguf_path, req.support)
    check_bounds(m.family, m.config, req.bounds)
    heads = (onnx_heads.read(req.draft_onnx, m.config.n_embd, m.config.n_vocab, req.bounds.max_verify)
             if req.draft_onnx else None)
    records_dir = _records(tgt_spec, req.records)
    phases = Phases(["validate", "build module", "export", *(["tune"] if req.tune_trials else []), "compile",
                     "write artifact"], req.progress and not req.tune_trials)
    extra = {}
    try:
        phases.next()
        x = _build_and_export(m.family.build, BuildRequest(
            m.config, tensor_types(m.gguf), req.bounds, req.kv_rounding, dm.family if dm else None, support_cfg,
            tensor_types(dm.gguf) if dm else {}), tgt_spec, req, phases)
        params = [[name, *x.built.sources[id(p)]] for name, p in x.named]
        mod, functions, weights = x.mod, x.built.functions, {MODEL: file_identity(gguf_path),
                                                              **({"support": file_identity(req.support)} if dm else {})}
        drafters = dict(x.built.drafters)
        out_dir = Path(out_dir)
        if heads is not None:
            mod, functions = _with_heads(mod, functions, heads, req.draft_onnx, tgt_spec, out_dir, params, weights,
                                         drafters)
        phases.next()
        if req.tune_trials:
            from ..schedules.tuning import tune

            extra["tuning"] = tune(mod, tvm.target.Target(tgt_spec.tvm), records_dir, req.tune_trials, req.progress)
            phases.next()
        recorded = []
        ex = _compile_module(mod, tgt_spec, records_dir, req.report, [f.name for f in functions],
                             recorded=recorded if x.recording else None, widths=x.widths)
        functions = _with_recorded(functions, recorded, x.widths)
        phases.next()
        if _applies(records_dir):
            extra["tuning_records"] = str(records_dir)
        if req.int8_activations:
            extra["int8_activations"] = True
        manifest = _write_artifact(out_dir, ex, m, tgt_spec, req, functions=[f.to_json() for f in functions],
                                   params=params, states=[s.to_json() for s in x.built.states], weights=weights,
                                   drafters=drafters)
        phases.next()
        manifest.extra.update(compile_seconds=phases.times, **extra)
        manifest.write(out_dir)
        return out_dir
    finally:
        phases.close()


def _write_artifact(out_dir: Path, ex, m, tgt_spec, req: CompileRequest, **contents) -> Manifest:
    """The library and the tokenizer written to out_dir, and their manifest: `contents` (the
    functions, parameters, states, weights and drafters) with the model, the target and the hashes."""
    import tvm

    out_dir.mkdir(parents=True, exist_ok=True)
    ex.export_library(str(out_dir / tgt_spec.library))
    (out_dir / "tokenizer.json").write_text(json.dumps(_tokenizer_data(m.gguf, m.family)))
    return Manifest(
        **contents, family=m.family.name, architecture=m.gguf.architecture, target=tgt_spec.tvm,
        target_name=tgt_spec.name, device=tgt_spec.device, arches=list(tgt_spec.arches),
        bounds=asdict(req.bounds), kv_rounding=req.kv_rounding, library=tgt_spec.library, n_vocab=m.config.n_vocab,
        tvm_version=tvm.__version__,
        hashes={name: file_sha256(out_dir / name) for name in (tgt_spec.library, "tokenizer.json")})


TARGET_FUNCTIONS = ("prefill", "decode", "verify")   # what the engine calls by name


def records_functions(tgt_spec, forms) -> bool:
    """Whether the compile records each function's kernels as one graph (CUDA graphs:
    schedules/graphs.py), or, for a CPU target exported in the GPU forms, compiles as CUDA does to
    check that rewrite here."""
    return tgt_spec.records_functions or (tgt_spec.device == "cpu" and forms.gpu)


def recorded_widths(functions: list, recording: bool, bounds) -> dict:
    """The functions called with 1..max_verify rows (FunctionSpec.per_width), with the widths at
    which a copy of each is recorded (schedules/graphs.width_copies): every width, since the
    speculative loop verifies 1 + however many drafts it has. {} where nothing is recorded."""
    if not recording:
        return {}
    return {f.name: list(range(1, bounds.max_verify + 1)) for f in functions if f.per_width}


def _with_recorded(functions: list, recorded: list, widths: dict) -> list:
    """functions marked recorded as the pipeline recorded them, each with the widths recorded for
    it (FunctionSpec.widths) and a FunctionSpec per width copy."""
    out = []
    for f in functions:
        ws = tuple(w for w in widths.get(f.name, ()) if width_variant(f.name, w) in recorded)
        out.append(replace(f, recorded=f.name in recorded, widths=ws))
        out += [replace(f, name=width_variant(f.name, w), recorded=True) for w in ws]
    return out


def _with_heads(mod, functions, heads, path: Path, tgt_spec, out_dir: Path, params: list, weights: dict,
                drafters: dict):
    """mod and functions with the ONNX draft heads added: their weights written into the artifact
    (a weight file of its own role), their function taking the weight arguments after the module's."""
    import tvm

    from ..artifact import FunctionSpec

    missing = [f.name for f in functions if f.name in TARGET_FUNCTIONS and "hidden" not in f.outputs]
    if missing:
        raise Ds4Error(f"--draft-onnx {path}: this family's {', '.join(missing)} do not return the hidden state "
                       f"('hidden') that draft heads read")
    model, keep = onnx_heads.prepare(heads.model)
    try:
        func = onnx_heads.import_function(model)
    except Exception as e:  # noqa: BLE001 - the frontend's converters raise anything on what they cannot take
        raise Ds4Error(f"{path}: TVM's ONNX frontend cannot import it ({onnx_heads.first_line(e)})") from None
    if tgt_spec.device == "cpu":
        mod = onnx_heads.add_to_module(mod, func, cpu=(tgt_spec.threads, tgt_spec.blocking()))
    else:
        mod = onnx_heads.add_to_module(mod, func, gpu_target=tvm.target.Target(tgt_spec.tvm))
    out_dir.mkdir(parents=True, exist_ok=True)
    weights_path = out_dir / onnx_heads.WEIGHTS_FILE
    tensors = onnx_heads.write_weights(weights_path, keep, heads.sha256)
    n = len(params)
    params += [[name, tensor, None, onnx_heads.ROLE] for (name, _), tensor in zip(keep, tensors)]
    weights[onnx_heads.ROLE] = file_identity(weights_path, inside=out_dir)
    drafters["onnx"] = {"function": onnx_heads.FUNCTION, "k": heads.k, "inputs": list(heads.inputs),
                        "opset": heads.opset, "source": str(path), "source_sha256": heads.sha256}
    kinds = {"hidden": "float32", "tokens": "tokens"}
    spec = FunctionSpec(onnx_heads.FUNCTION, tuple((i, kinds[i]) for i in heads.inputs), ("logits",),
                        params=(n, len(params)))
    return mod, [replace(f, params=(0, n)) for f in functions] + [spec]


def check_int8_activations(tgt_spec, wanted: bool) -> None:
    """The int8 path's dot products are AVX-512 VNNI or AVX2 instructions: only CPU targets that
    have one."""
    if not wanted:
        return
    if tgt_spec.device != "cpu":
        raise Ds4Error(f"--int8-activations: a CPU option; {tgt_spec.name} is a {tgt_spec.device} target")
    if tgt_spec.int8_dot() is None:
        raise Ds4Error(f"--int8-activations: target {tgt_spec.name} has neither AVX-512 VNNI (vpdpbusd) nor AVX2 "
                       f"(vpmaddubsw); use --target cpu on a CPU that has one, or compile without it")


def _export(model, widths: dict | None = None):
    """The Relax module and its parameters (the model's blocks in the forms its builder set).
    widths: the functions exported once more as their width templates (recorded_widths)."""
    return model.export_tvm(spec=_with_width_templates(model, model.spec(), widths or {}))


def _with_width_templates(model, spec: dict, widths: dict) -> dict:
    """spec with each function in `widths` exported once more under schedules/graphs.width_template
    (an alias of its method on model), its token count (the symbolic first dimension of its
    tensor inputs) named nn/state.RECORDED_WIDTH."""
    from tvm.relax.frontend import nn

    from ..nn.state import RECORDED_WIDTH
    from ..schedules.graphs import width_template

    out = dict(spec)
    for fn in widths:
        tensors = {a: t for a, t in spec.get(fn, {}).items() if isinstance(t, nn.spec.Tensor)}
        counts = {t.shape[0] for t in tensors.values() if t.shape and isinstance(t.shape[0], str)}
        if len(counts) != 1:
            continue
        k = counts.pop()
        renamed = {a: nn.spec.Tensor([RECORDED_WIDTH if d == k else d for d in t.shape], t.dtype)
                   for a, t in tensors.items()}
        out[width_template(fn)] = {**spec[fn], **renamed}
        setattr(model, width_template(fn), getattr(model, fn))
    return out


def _records(tgt_spec, records: Path | None) -> Path | None:
    if records is not None or tgt_spec.device != "cpu":
        return records
    from ..schedules.tuning import records_dir

    return records_dir(tgt_spec.name)


def _applies(records: Path | None) -> bool:
    from ..schedules.tuning import has_records

    return records is not None and has_records(records)


def _compile_module(mod, tgt_spec, records: Path | None = None, report: Path | None = None, functions=(),
                    recorded: list | None = None, widths: dict | None = None):
    """The compiled module; with `report`, ds4-compile --report's JSON of `functions` written there
    (schedules/report.py). recorded: filled with the functions whose arguments are recorded
    (schedules/graphs.py: CUDA; a CPU target given it compiles as the CUDA pipeline does, the GPU
    forms checked here)."""
    import tvm

    from ..schedules.gpu import pipeline as gpu_pipeline
    from ..schedules.llvm import pipeline as cpu_pipeline
    from ..schedules.report import module_report

    tgt = tvm.target.Target(tgt_spec.tvm)
    fatbin = cuda_fatbin(tgt_spec.arches) if tgt_spec.device == "cuda" else contextlib.nullcontext()
    log = {} if report is not None else None   # what scheduled each kernel: only a report reads it
    with tgt, fatbin:
        records = _records(tgt_spec, records)
        relax_pipeline = (cpu_pipeline(tgt, records if _applies(records) else None, log, recorded, widths)
                          if tgt_spec.device == "cpu" else gpu_pipeline(tgt, tgt_spec.device, log, recorded, widths))
        lowered = relax_pipeline(mod)
        if report is not None:
            compiled = {gv.name_hint for gv in lowered.get_global_vars()}
            copies = [width_variant(f, w) for f, ws in (widths or {}).items() for w in ws]
            names = [f for f in [*functions, *copies] if f in compiled]
            Path(report).write_text(json.dumps(module_report(lowered, names, log, tgt_spec.name), indent=1))
        return tvm.compile(lowered, target=tgt, relax_pipeline=None)


def compile_shapes(family: str, out_dir: Path, req: CompileRequest) -> dict:
    """Compiles a family at its published shapes and tensor types (with the drafter its entry
    pairs), without weights; writes the library to out_dir and returns times and sizes."""
    import resource

    tgt_spec, req = _prepared_target(req)
    fam = family_named(family)
    if fam.published is None:
        raise Ds4Error(f"--shapes-only: the {fam.name} family has no published shapes to compile")
    phases = Phases(["build module", "export", "compile", "write library"], req.progress)
    try:
        build_req = load_attr(fam.published)()
        build_req.bounds = req.bounds
        x = _build_and_export(fam.build, build_req, tgt_spec, req, phases)
        phases.next()
        ex = _compile_module(x.mod, tgt_spec, report=req.report, functions=[f.name for f in x.built.functions],
                             widths=x.widths)
        phases.next()
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        ex.export_library(str(out_dir / tgt_spec.library))
        phases.next()
    finally:
        phases.close()
    return {"model": f"{fam.name} + {', '.join(x.built.drafters) or 'no drafter'} (published shapes and types)",
            "target": tgt_spec.name, "n_params_arguments": len(x.named), "seconds": phases.times,
            "total_seconds": round(sum(phases.times.values()), 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "library_mb": round((out_dir / tgt_spec.library).stat().st_size / 2**20, 1)}
