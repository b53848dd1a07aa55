"""`ds4-compile`: read and validate a GGUF, build the family's module, compile it for a target
and write the artifact directory."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict
from pathlib import Path

from ..artifact import Manifest, file_identity
from ..errors import Ds4Error
from ..families import load_model
from ..gguf import open_gguf
from .targets import resolve
from .toolchains import cuda_fatbin, prepare

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id", "tokenizer.ggml.add_bos_token",
                  "tokenizer.ggml.add_eos_token", "tokenizer.chat_template")


class Phases:
    """A progress bar over the compile phases (on stderr)."""

    def __init__(self, names: list[str], enabled: bool):
        self.names, self.p = names, None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
            self.p = Progress(TextColumn("ds4-compile"), BarColumn(), TextColumn("{task.description}"),
                              TimeElapsedColumn(), console=Console(stderr=True), transient=True)
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


def _tokenizer_data(f) -> dict:
    out = {}
    for key in TOKENIZER_KEYS:
        field = f._reader.get_field(key)
        if field is not None:
            value = field.contents()
            out[key] = value
    return out


def compile_gguf(gguf_path: Path, target: str, out_dir: Path, bounds, kv_rounding: bool = True,
                 progress: bool = False, capture_layers: tuple[int, ...] = (), support: Path | None = None,
                 tune_trials: int = 0, records: Path | None = None) -> Path:
    """records: the tuning database to apply (and, with tune_trials > 0, to tune into); by default
    the one shipped for the target (schedules/tuning.py)."""
    tgt_spec = resolve(target)
    if tune_trials and tgt_spec.device != "cpu":
        raise Ds4Error(f"--tune: {tgt_spec.name} kernels can only be tuned on their device; tune cpu targets here "
                       f"(schedules/tuning.py), or compile without --tune")
    prepare(tgt_spec.device)   # for CUDA, before TVM is imported (toolchains.py)
    import tvm

    from ..families.deepseek4.model import parameter_sources, state_shapes, tensor_types

    f = open_gguf(gguf_path)
    m = load_model(f)
    if m.family.role != "target":
        raise Ds4Error(f"{gguf_path}: is a {m.family.name} {m.family.role} file; compile its target model "
                       f"and pass it with --mtp")
    if m.family.name != "deepseek4":
        raise Ds4Error(f"{gguf_path}: compiling the {m.family.name} family is not supported yet")
    if bounds.max_context % 128 or bounds.max_context <= 0:
        raise Ds4Error(f"--max-context {bounds.max_context}: expected a positive multiple of 128")
    if not 1 <= bounds.max_verify <= 64:
        raise Ds4Error(f"--max-verify {bounds.max_verify}: expected 1..64")
    if not 1 <= bounds.prefill_chunk <= bounds.max_context:
        raise Ds4Error(f"--prefill-chunk {bounds.prefill_chunk}: expected 1..max-context")
    draft = None
    if support is not None:
        from ..families.dspark.config import paired_with

        sf = open_gguf(support)
        dm = load_model(sf)
        if dm.family.name != "dspark":
            raise Ds4Error(f"{support}: --mtp expects a DSpark support file (deepseek4-dspark), got "
                           f"{dm.family.name} ({sf.architecture})")
        draft = (sf, paired_with(dm.config, m.config))
        capture_layers = draft[1].target_layer_ids
    bad = [i for i in capture_layers if not 0 <= i < m.config.n_layers]
    if bad:
        raise Ds4Error(f"capture layers {bad} are outside 0..{m.config.n_layers - 1}")
    records = _records(tgt_spec, records)
    phases = Phases(["validate", "build module", "export", *(["tune"] if tune_trials else []), "compile",
                     "write artifact"], progress and not tune_trials)
    tuning = None
    try:
        phases.next()
        model = _build_model(m.config, tensor_types(f), bounds, kv_rounding, capture_layers,
                             draft[1] if draft else None, tensor_types(draft[0]) if draft else None)
        phases.next()
        mod, named = _export(model, tgt_spec)
        sources = parameter_sources(model)
        # [argument, GGUF tensor, plane field, file]: drafter tensors ("mtp.*") live in the support file
        params = [[name, *sources[id(p)], "draft" if sources[id(p)][0].startswith("mtp.") else "target"]
                  for name, p in named]
        phases.next()
        if tune_trials:
            from ..schedules.tuning import tune

            tuning = tune(mod, tvm.target.Target(tgt_spec.tvm), records, tune_trials, progress)
            phases.next()
        ex = _compile_module(mod, tgt_spec, records)
        phases.next()
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        lib = tgt_spec.library
        ex.export_library(str(out_dir / lib))
        (out_dir / "tokenizer.json").write_text(json.dumps(_tokenizer_data(f)))
        manifest = Manifest(
            family=m.family.name, architecture=f.architecture, target=tgt_spec.tvm, target_name=tgt_spec.name,
            device=tgt_spec.device, arches=list(tgt_spec.arches),
            **file_identity(gguf_path), bounds=asdict(bounds),
            kv_rounding=kv_rounding, extra={"capture_layers": list(capture_layers)}, functions=["prefill", "prefill_all", "decode", "verify"], params=params,
            states=[[n, list(s)] for n, s in state_shapes(m.config, bounds)], library=lib,
            tvm_version=tvm.__version__)
        phases.next()
        manifest.extra["compile_seconds"] = phases.times
        if _applies(records):
            manifest.extra["tuning_records"] = str(records)
        if tuning is not None:
            manifest.extra["tuning"] = tuning
        if draft is not None:
            from ..families.dspark.model import ring_shapes

            dc = draft[1]
            manifest.extra["draft"] = {
                "family": "dspark", **file_identity(support),
                "block_size": dc.block_size, "markov_rank": dc.markov_rank, "noise_token_id": dc.noise_token_id,
                "target_layer_ids": list(dc.target_layer_ids), "n_stages": dc.n_stages,
                "rings": [[n, list(s)] for n, s in ring_shapes(dc)],
                "functions": ["dspark_observe", "dspark_observe_direct", "dspark_block", "dspark_logits",
                              "dspark_markov"]}
        manifest.write(out_dir)
        return out_dir
    finally:
        phases.close()


def _build_model(cfg, types: dict, bounds, kv_rounding: bool, capture_layers, draft_cfg=None, draft_types=None):
    from ..families.deepseek4.model import DeepSeekV4

    if draft_cfg is None:
        return DeepSeekV4(cfg, types, bounds, kv_rounding=kv_rounding, capture_layers=capture_layers)
    from ..families.dspark.model import with_dspark

    return with_dspark(DeepSeekV4)(cfg, types, bounds, kv_rounding, draft_cfg, draft_types)


def _export(model, tgt_spec):
    """The Relax module and its parameters; CPU targets get the hand-written linear kernels."""
    from ..nn.qweight import for_cpu

    cpu = tgt_spec.device == "cpu"
    with for_cpu(int(tgt_spec.tvm.get("num-cores", 1))) if cpu else contextlib.nullcontext():
        return model.export_tvm(spec=model.spec())


def _records(tgt_spec, records: Path | None) -> Path | None:
    if records is not None or tgt_spec.device != "cpu":
        return records
    from ..schedules.tuning import records_dir

    return records_dir(tgt_spec.name)


def _applies(records: Path | None) -> bool:
    from ..schedules.tuning import has_records

    return records is not None and has_records(records)


def _compile_module(mod, tgt_spec, records: Path | None = None):
    import tvm

    from ..schedules.gpu import pipeline as gpu_pipeline
    from ..schedules.llvm import pipeline as cpu_pipeline

    tgt = tvm.target.Target(tgt_spec.tvm)
    fatbin = cuda_fatbin(tgt_spec.arches) if tgt_spec.device == "cuda" else contextlib.nullcontext()
    with tgt, fatbin:
        records = _records(tgt_spec, records)
        relax_pipeline = (cpu_pipeline(tgt, records if _applies(records) else None) if tgt_spec.device == "cpu"
                          else gpu_pipeline(tgt, tgt_spec.device))
        return tvm.compile(mod, target=tgt, relax_pipeline=relax_pipeline)


def compile_shapes(target: str, bounds, out_dir: Path, progress: bool = False) -> dict:
    """Compiles DeepSeek-V4-Flash with its DSpark drafter at the published shapes and Q2 recipe
    types, without weights; writes the library to out_dir and returns times and sizes."""
    import resource

    tgt_spec = resolve(target)
    prepare(tgt_spec.device)
    from ..families.deepseek4.published import flash_config, flash_dspark_config, q2_recipe_type
    from ..families.deepseek4.tensors import tensor_specs
    from ..families.dspark.tensors import tensor_specs as dspark_specs

    cfg = flash_config()
    dcfg = flash_dspark_config(cfg)
    phases = Phases(["build module", "export", "compile", "write library"], progress)
    try:
        model = _build_model(cfg, {s.name: q2_recipe_type(s) for s in tensor_specs(cfg)}, bounds, True, (),
                             dcfg, {s.name: q2_recipe_type(s) for s in dspark_specs(dcfg)})
        phases.next()
        mod, named = _export(model, tgt_spec)
        phases.next()
        ex = _compile_module(mod, tgt_spec)
        phases.next()
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        ex.export_library(str(out_dir / tgt_spec.library))
        phases.next()
    finally:
        phases.close()
    return {"model": "DeepSeek-V4-Flash + DSpark (published shapes, Q2 recipe types)", "target": tgt_spec.name,
            "n_params_arguments": len(named), "seconds": phases.times, "total_seconds": round(sum(phases.times.values()), 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "library_mb": round((out_dir / tgt_spec.library).stat().st_size / 2**20, 1)}
