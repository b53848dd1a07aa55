"""llama.cpp's `deepseek4` (an independent reader of the same GGUFs as ds4) loads what `ds4 convert`
writes and computes the same logits as transformers: names, shapes and metadata keys match.

Needs llama-cpp-python 0.3.36 (builds llama.cpp from source, ~6 minutes), so it is kept out of the
default run: `pip install llama-cpp-python==0.3.36 && python -m pytest -m slow`.
Measured 2026-11-29: max |delta| 1.45e-5 over 300 tokens (logits up to 4.6)."""

import numpy as np
import pytest

from conftest import run_ds4

pytestmark = [pytest.mark.slow, pytest.mark.oracle]


def test_llamacpp_matches_transformers_on_converted_gguf(tiny_hf_dir, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python==0.3.36")
    import torch
    from transformers import DeepseekV4ForCausalLM

    gguf = tmp_path / "tiny.gguf"
    assert run_ds4("convert", tiny_hf_dir, gguf, "--type", "f32", "--quiet").returncode == 0
    ids = np.random.default_rng(0).integers(0, 512, 300).tolist()
    with torch.no_grad():
        ref = DeepseekV4ForCausalLM.from_pretrained(tiny_hf_dir).eval()(torch.tensor([ids])).logits[0].numpy()
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=512, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(ids)
    got = np.array(llm.scores[:len(ids)])
    assert np.abs(got - ref).max() <= 1e-4
