"""The DeepSeek-V4 module goes through TVM's default GPU pipelines (fusion + dlight) for CUDA and
Metal on this GPU-less machine: code generation only (CUDA source without nvcc, Metal MSL), the
starting point of the GPU-targets issue. Slow (about 40 s): `python -m pytest -m slow`."""

import pytest

tvm = pytest.importorskip("tvm")
pytestmark = pytest.mark.slow

TARGETS = {
    "cuda-sm_90": {"kind": "cuda", "arch": "sm_90", "host": {"kind": "llvm"}},
    "metal": {"kind": "metal", "max_threads_per_block": 256, "thread_warp_size": 1,
              "host": {"kind": "llvm", "mtriple": "arm64-apple-macos"}},
}


@pytest.mark.parametrize("name", list(TARGETS))
def test_tiny_deepseek4_generates_gpu_code(name, tmp_path):
    from ds4tvm.families import load_model
    from ds4tvm.families.deepseek4.model import Bounds, DeepSeekV4, tensor_types
    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4
    from ds4tvm.gguf import open_gguf

    f = open_gguf(write_random_deepseek4(tmp_path / "m.gguf", tiny_config(), seed=1))
    m = load_model(f)
    model = DeepSeekV4(m.config, tensor_types(f), Bounds(512, 8, 256))
    mod, _ = model.export_tvm(spec=model.spec())
    target = tvm.target.Target(TARGETS[name])
    with target:
        ex = tvm.compile(mod, target=target)
    if name.startswith("cuda"):  # without nvcc and a driver TVM keeps CUDA C++ source in the module
        def sources(mod):
            for sub in mod.imports:
                yield sub.inspect_source()
                yield from sources(sub)

        assert any("__global__" in src for src in sources(ex.mod))
    else:  # Metal: MSL source plus arm64 host objects, exported as a tarball to link on the Mac
        import tarfile

        ex.export_library(str(tmp_path / "lib.tar"))
        assert tarfile.open(tmp_path / "lib.tar").getnames()
