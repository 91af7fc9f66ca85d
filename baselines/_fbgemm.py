"""Every fbgemm_gpu and torchrec name the baselines use, imported from the one path that
works across the releases scripts/setup_env.sh installs (fbgemm-gpu / fbgemm-gpu-cpu and
torchrec 1.6 to 1.9).

fbgemm moves its enums between modules from release to release; the legacy module
``split_table_batched_embeddings_ops_common`` re-exports them in every release we support
(``CacheAlgorithm`` lives there in 1.6, while ``split_embedding_configs`` only re-exports it
from 1.8 on). Import these names from here, lazily (inside ``build``), so that a missing
package or a moved name fails in one obvious place, and tests/test_fbgemm_compat.py checks
exactly this list.
"""

from __future__ import annotations

from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (CacheAlgorithm, ComputeDevice, EmbeddingLocation,
                                                                  PoolingMode)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
from torchrec import DataType, EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import CacheParams, ShardingEnv

__all__ = [
    # fbgemm_gpu
    "CacheAlgorithm", "ComputeDevice", "EmbOptimType", "EmbeddingLocation", "PoolingMode", "SparseType",
    "SplitTableBatchedEmbeddingBagsCodegen",
    # torchrec
    "CacheParams", "DataType", "DistributedModelParallel", "EmbeddingBagCollection", "EmbeddingBagCollectionSharder",
    "EmbeddingBagConfig", "EmbeddingShardingPlanner", "ParameterConstraints", "PoolingType", "ShardingEnv",
    "Topology",
    # fbgemm's SSD TBE, on demand
    "load_ssd_operators", "ssd_tbe",
]


def ssd_tbe():
    """fbgemm's SSD TBE: ``(ASSOC, SSDTableBatchedEmbeddingBags, UVMCacheStatsIndex)``, imported
    on demand (the module is in every wheel; its operators only in builds that have them)."""
    from fbgemm_gpu.tbe.ssd.common import ASSOC
    from fbgemm_gpu.tbe.ssd.training import SSDTableBatchedEmbeddingBags, UVMCacheStatsIndex

    return ASSOC, SSDTableBatchedEmbeddingBags, UVMCacheStatsIndex


def load_ssd_operators() -> None:
    """Import fbgemm's SSD package, which loads its operator library where a build ships one."""
    import fbgemm_gpu.tbe.ssd  # noqa: F401
