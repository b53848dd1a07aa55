"""Family registry, configs and tensor tables, the DSpark support file, random-block GGUFs."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from conftest import run_ds4
from ds4tvm.errors import Ds4Error
from ds4tvm.families import REGISTRY, load_model
from ds4tvm.families.deepseek4.config import Config
from ds4tvm.families.deepseek4.random_model import (k_quant_config, published_recipe_type, tiny_config,
                                                   write_random_deepseek4)
from ds4tvm.families.dspark.config import Config as DSparkConfig
from ds4tvm.families.dspark.config import paired_with
from ds4tvm.families.dspark.random_model import write_random_dspark
from ds4tvm.gguf import open_gguf
from ds4tvm.gguf.quant import to_planes
from ds4tvm.gguf.writer import write_gguf


def test_registry_keys():
    assert REGISTRY["deepseek4"].role == "target" and REGISTRY["deepseek4-dspark"].role == "draft"


def test_config_round_trips_through_gguf(tmp_path):
    cfg = tiny_config()
    f = open_gguf(write_random_deepseek4(tmp_path / "m.gguf", cfg))
    got = Config.from_gguf(f)
    for field in cfg.__dataclass_fields__:
        a, b = getattr(got, field), getattr(cfg, field)
        # GGUF stores floats as f32, as the reference engine reads them
        assert (np.float32(a) == np.float32(b)) if isinstance(b, float) else a == b, field


def test_real_size_tensor_table():
    """The real DeepSeek-V4-Flash shapes of ds4-spec §1.1."""
    n = 43
    cfg = tiny_config(n_layers=n, n_embd=4096, n_vocab=129280, n_head=64, head_dim=512, n_rot=64,
                      q_lora_rank=1024, o_lora_rank=1024, o_groups=8, n_expert=256, n_expert_used=6,
                      n_ff_exp=2048, n_hash_layers=3, sliding_window=128, idx_n_head=64, idx_head_dim=128,
                      idx_top_k=512, compress_ratios=(0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(2, n)))
    specs = {s.name: s for s in REGISTRY["deepseek4"].tensor_specs(cfg)}
    assert specs["blk.5.attn_output_a.weight"].shape == (4096, 8192)
    assert specs["blk.5.hc_attn_fn.weight"].shape == (16384, 24)
    assert specs["blk.4.attn_compressor_ape.weight"].shape == (1024, 4)
    assert specs["blk.5.attn_compressor_kv.weight"].shape == (4096, 512)
    assert specs["blk.4.indexer_compressor_kv.weight"].shape == (4096, 256)
    assert specs["blk.4.indexer.attn_q_b.weight"].shape == (1024, 8192)
    assert specs["blk.9.ffn_down_exps.weight"].shape == (2048, 4096, 256)
    assert specs["blk.2.ffn_gate_tid2eid.weight"].shape == (6, 129280)
    assert "blk.3.ffn_gate_tid2eid.weight" not in specs and "blk.5.indexer.proj.weight" not in specs
    assert specs["output_hc_fn.weight"].shape == (16384, 4)


def test_random_block_gguf_planes(tmp_path):
    """GGUFs whose expert and dense tensors are random valid Q4_K / Q2_K / IQ2_XXS blocks: every
    tensor read back through planes equals gguf's dequantizer on the file bytes."""
    path = write_random_deepseek4(tmp_path / "blocks.gguf", k_quant_config(), type_of=published_recipe_type)
    m = load_model(open_gguf(path))
    seen = set()
    for t in m.gguf.tensors.values():
        if t.ggml_type in (QT.F32, QT.F16, QT.I32):
            continue
        seen.add(t.ggml_type)
        shape = tuple(reversed(t.shape))
        planes = to_planes(t.data, t.ggml_type, shape)
        assert np.array_equal(planes.dequantize(), quants.dequantize(np.asarray(t.data), t.ggml_type)), t.name
    assert {QT.Q4_K, QT.Q2_K, QT.IQ2_XXS} <= seen
    r = run_ds4("inspect", path, "--json")
    assert r.returncode == 0 and '"IQ2_XXS"' in r.stdout


def test_dspark_support_file(tmp_path):
    target = tiny_config()
    path = write_random_dspark(tmp_path / "support.gguf", target)
    m = load_model(open_gguf(path))
    assert m.family.role == "draft" and len(m.gguf.tensors) == 81 and not m.unused_tensors
    assert m.config.target_layer_ids == (2, 3, 4) and m.config.n_stages == 3
    paired = paired_with(m.config, target)
    assert paired.block.n_expert_used == target.n_expert_used
    with pytest.raises(Ds4Error, match="support file does not match this model"):
        paired_with(m.config, tiny_config(n_layers=3, compress_ratios=(0, 4, 128)))
    with pytest.raises(Ds4Error, match="support file does not match this model"):
        paired_with(m.config, tiny_config(n_vocab=1024))


@pytest.mark.parametrize("style", ["deepseek4.dspark.{}", "deepseek4.dspark_{}", "dspark.{}"])
def test_dspark_key_spellings(tmp_path, style):
    src = open_gguf(write_random_dspark(tmp_path / "s.gguf", tiny_config()))
    meta = {"general.architecture": "deepseek4-dspark", style.format("block_size"): 4,
            style.format("markov_rank"): 32, style.format("noise_token_id"): 7,
            style.format("target_layers"): [3, 4], style.format("n_layers"): 3}
    from ds4tvm.gguf.writer import TensorOut
    tensors = [TensorOut(t.name, t.ggml_type, tuple(reversed(t.shape)), lambda t=t: np.asarray(t.data))
               for t in src.tensors.values() if t.name != "mtp.0.main_proj.weight"]
    tensors.append(TensorOut("mtp.0.main_proj.weight", QT.F16, (64, 128), lambda: np.zeros((64, 128), np.float16)))
    cfg = DSparkConfig.from_gguf(open_gguf(write_gguf(tmp_path / "k.gguf", "deepseek4-dspark", meta, tensors)))
    assert (cfg.block_size, cfg.markov_rank, cfg.noise_token_id, cfg.target_layer_ids, cfg.n_stages) == \
        (4, 32, 7, (3, 4), 3)


def test_legacy_mtp_and_dspark_files_are_told_apart_by_their_tensors(tmp_path):
    """ds4's rule: main_proj makes a support file DSpark; e_proj without it, the legacy MTP file
    (whatever its architecture key says)."""
    from ds4tvm.families import family_for
    from ds4tvm.families.deepseek4_mtp.random_model import write_random_mtp

    cfg = tiny_config()
    mtp = write_random_mtp(tmp_path / "mtp.gguf", cfg, seed=1)
    assert load_model(open_gguf(mtp)).family.name == "deepseek4_mtp"
    assert family_for(open_gguf(write_random_dspark(tmp_path / "ds.gguf", cfg))).name == "dspark"
    relabelled = write_random_mtp(tmp_path / "relabelled.gguf", cfg, seed=1)
    data = relabelled.read_bytes().replace(b"deepseek4-mtp", b"deepseek4-xyz")   # same length: a valid file
    relabelled.write_bytes(data)
    assert open_gguf(relabelled).architecture == "deepseek4-xyz"
    assert family_for(open_gguf(relabelled)).name == "deepseek4_mtp"


def test_chat_template_fallback_of_the_family(tmp_path):
    from ds4tvm.compile.driver import _tokenizer_data
    from ds4tvm.gguf.vocab import CHAT_TEMPLATE

    fam = REGISTRY["deepseek4"]
    plain = open_gguf(write_random_deepseek4(tmp_path / "m.gguf", tiny_config(),
                                             metadata={"tokenizer.chat_template": None}))
    assert _tokenizer_data(plain, fam)["tokenizer.chat_template"] == CHAT_TEMPLATE
    own = open_gguf(write_random_deepseek4(tmp_path / "own.gguf", tiny_config(),
                                           metadata={"tokenizer.chat_template": "{{ messages }}"}))
    assert _tokenizer_data(own, fam)["tokenizer.chat_template"] == "{{ messages }}"


def test_the_pipeline_names_no_family():
    """compile/, schedules/, server/, runtime/ (outside drafters/), artifact.py and package.py name
    no family or drafter in code (comments, docstrings and message strings aside): a new family
    adds files under families/ and runtime/drafters/ only."""
    import ast
    import io
    import re
    import tokenize
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "ds4tvm"
    names = re.compile(r"deepseek|dspark|glm|qwen", re.I)
    files = [root / "artifact.py", root / "package.py"] + [
        f for d in ("compile", "schedules", "server", "runtime") for f in sorted((root / d).rglob("*.py"))
        if "drafters" not in f.parts]
    hits = []
    for f in files:
        src = f.read_text()
        docs = set()
        for node in ast.walk(ast.parse(src)):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                    isinstance(getattr(body[0], "value", None), ast.Constant):
                docs.update(range(body[0].lineno, body[0].end_lineno + 1))
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type != tokenize.COMMENT and tok.start[0] not in docs and names.search(tok.string):
                hits.append(f"{f.relative_to(root)}:{tok.start[0]}: {tok.string[:40]}")
    assert not hits, hits


def test_published_q2_recipe_types_follow_the_spec():
    """ds4-spec §1.1's Q2 recipe: routed gate/up IQ2_XXS, down Q2_K, attention projections, shared
    experts and output Q8_0, the indexer's q_b and proj F16, norms F32."""
    from ds4tvm.families.deepseek4.published import flash_config, q2_recipe_type
    from ds4tvm.families.deepseek4.tensors import tensor_specs

    types = {s.name: q2_recipe_type(s) for s in tensor_specs(flash_config())}
    indexed = [n for n in types if ".indexer." in n]
    assert indexed and all(types[n] == QT.F16 for n in indexed if not n.endswith("norm.weight"))
    assert types["blk.2.indexer.attn_q_b.weight"] == QT.F16 and types["blk.2.attn_q_b.weight"] == QT.Q8_0
    assert types["blk.5.ffn_gate_exps.weight"] == QT.IQ2_XXS and types["blk.5.ffn_down_exps.weight"] == QT.Q2_K
    assert types["output.weight"] == QT.Q8_0 and types["blk.5.ffn_up_shexp.weight"] == QT.Q8_0


def test_dspark_default_theta_is_the_support_files_calibrated_one(tmp_path):
    """A support file's deepseek4.dspark.confidence_threshold (written by scripts/train_demo.py) is
    θ when --dspark-confidence is not given; exact sampling raises it to ds4's 0.8; a file without
    it keeps ds4's defaults; a value outside [0, 1] is a one-line error naming the key."""
    from types import SimpleNamespace

    from ds4tvm.families.dspark.random_model import support_metadata
    from ds4tvm.gguf.writer import TensorOut
    from ds4tvm.runtime.drafters.dspark import default_theta

    plain = open_gguf(write_random_dspark(tmp_path / "plain.gguf", tiny_config(), n_stages=1))
    cfg = DSparkConfig.from_gguf(plain)
    assert cfg.confidence_threshold is None
    tensors = [TensorOut(n, t.ggml_type, tuple(reversed(t.shape)), lambda t=t: np.asarray(t.data))
               for n, t in plain.tensors.items()]
    for theta in (0.6, 1.5):
        meta = {**support_metadata(cfg, "t"), "deepseek4.dspark.confidence_threshold": theta}
        out = open_gguf(write_gguf(tmp_path / f"theta{theta}.gguf", meta["general.architecture"], meta, tensors))
        if theta > 1:
            with pytest.raises(Ds4Error, match="confidence_threshold 1.5"):
                DSparkConfig.from_gguf(out)
        else:
            assert DSparkConfig.from_gguf(out).confidence_threshold == theta
    engine = lambda theta: SimpleNamespace(drafters={"dspark": {"confidence_threshold": theta}})  # noqa: E731
    assert default_theta(engine(0.6), exact=False) == 0.6 and default_theta(engine(0.6), exact=True) == 0.8
    assert default_theta(engine(0.9), exact=True) == 0.9
    assert default_theta(engine(None), exact=False) == 0.7 and default_theta(engine(None), exact=True) == 0.8


def test_a_window_longer_than_the_context_sizes_rings_by_the_context():
    """sliding_window 2^24 in a file compiled for 256 positions: the rings are those of a window of
    256 (which reads every position just the same), not 8 GiB."""
    from dataclasses import replace

    from ds4tvm.artifact import Bounds
    from ds4tvm.families import BuildRequest
    from ds4tvm.families.deepseek4.build import build
    from ds4tvm.families.deepseek4.random_model import default_type, tiny_config
    from ds4tvm.families.deepseek4.tensors import tensor_specs

    bounds = Bounds(256, 4, 64)

    def states(window):
        cfg = replace(tiny_config(), sliding_window=window)
        types = {s.name: default_type(s) for s in tensor_specs(cfg)}
        return [(s.name, s.shape) for s in build(BuildRequest(cfg, types, bounds)).states]

    assert states(1 << 24) == states(256)


def test_families_name_their_drafters_and_import_no_runtime():
    """A family names each drafter by its module in runtime/drafters/ (which builds it with
    from_options); nothing under families/ refers to the runtime, which is the layer above."""
    import importlib
    import re
    from pathlib import Path

    from ds4tvm.families import _registry
    from ds4tvm.runtime.drafters import _generic

    specs = [d for fam in _registry().values() for d in fam.drafters] + list(_generic())
    assert {d.drafter for d in specs} >= {"dspark", "mtp", "glm_mtp", "qwen_mtp", "onnx"}
    for d in specs:
        assert callable(importlib.import_module(f"ds4tvm.runtime.drafters.{d.drafter}").from_options), d
    root = Path(__file__).resolve().parents[2] / "ds4tvm" / "families"
    upward = re.compile(r"^\s*(from|import)\s+(\.\.\.?runtime|ds4tvm\.runtime)|ds4tvm\.runtime\.", re.M)
    assert not [str(f) for f in root.rglob("*.py") if upward.search(f.read_text())]
