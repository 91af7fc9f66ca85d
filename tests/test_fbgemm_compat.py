"""The fbgemm_gpu / torchrec names the CUDA paths use import from the installed release,
and baselines/ takes them from one place (baselines/_fbgemm.py) only."""

import ast
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_every_name_the_baselines_use_imports_from_the_installed_release():
    from baselines import _fbgemm as fb

    for name in fb.__all__:
        assert getattr(fb, name) is not None, name
    # the members the strategies select
    assert {fb.CacheAlgorithm.LRU, fb.CacheAlgorithm.LFU}
    assert {fb.EmbOptimType.EXACT_SGD, fb.EmbOptimType.EXACT_ROWWISE_ADAGRAD}
    assert {fb.EmbeddingLocation.HOST, fb.EmbeddingLocation.MANAGED, fb.EmbeddingLocation.MANAGED_CACHING}
    assert {fb.ComputeDevice.CPU, fb.ComputeDevice.CUDA} and fb.PoolingMode.SUM is not None
    # the row precisions (run.row_precision): fbgemm's and torchrec's names of each
    for name in ("FP32", "FP16", "BF16", "NFP8"):
        assert getattr(fb.SparseType, name) is not None and getattr(fb.DataType, name) is not None


def test_the_fbgemm_and_torchrec_names_used_outside_baselines_resolve():
    """freqcache allocates host-mapped memory with fbgemm's op; the batch converts to torchrec's KJT."""
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: F401

    assert hasattr(torch.ops.fbgemm, "new_unified_tensor")


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def test_baselines_import_fbgemm_and_torchrec_only_through_the_compat_module():
    for path in sorted((ROOT / "baselines").glob("*.py")):
        if path.name == "_fbgemm.py":
            continue
        direct = {m for m in _imported_modules(path) if m.split(".")[0] in ("fbgemm_gpu", "torchrec")}
        assert not direct, f"{path.name} imports {sorted(direct)}: take them from baselines._fbgemm"
