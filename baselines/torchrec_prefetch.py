"""fbgemm's prefetch pipeline, driven through embbench's hooks the way torchrec drives it.

torchrec's ``PrefetchTrainPipelineSparseDist`` (train_pipeline/train_pipelines.py, 1.6 and
1.8 alike) runs one training step as: forward of batch i, then, on a side stream, the
sharded module's ``prefetch()`` of batch i+1 (which calls each fbgemm TBE's ``prefetch()``),
then backward of batch i. The TBEs are built with ``prefetch_pipeline=True``, so that:

- a prefetch locks the cache slots of its batch (``lxu_cache_locking_counter``) until that
  batch's backward: prefetching batch i+1 cannot evict a row batch i still trains;
- the TBE's forward does not prefetch again when a prefetch is queued
  (``timesteps_prefetched``), and uses the queued cache locations;
- the TBE's backward pre-hook makes the training stream wait for the prefetch stream
  (``prefetch_stream``, the stream ``prefetch()`` was called on, which must differ from the
  ``forward_stream`` it is given), and refreshes batch i's cache locations after batch i+1's
  prefetch moved rows.

:class:`PrefetchPipeline` does the same with embbench's hooks for one sharded module: the
runner's ``prefetch`` hook comes after the forward of batch i and before its backward, which
is where torchrec prefetches. The input distribution of batch i+1 runs inside that prefetch,
on the side stream (torchrec runs it one step earlier on a third stream: with one rank it is
a local split). One difference on purpose: torchrec hands fbgemm a stream of its own as
``forward_stream`` (a new ``Stream()``); here it is the stream forward and backward really
run on, which is what fbgemm records the prefetched tensors on.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from embbench.plugin import SparseFeatures

__all__ = ["PrefetchPipeline"]


class PrefetchPipeline:
    """Prefetches one batch ahead through a torchrec sharded module (``create_context``,
    ``input_dist``, ``prefetch``, ``compute_and_output_dist``: torchrec's ShardedModule API).

    On the CPU there are no streams: the same calls run in order on the host (fbgemm's cache
    kernels need CUDA, so only the plumbing runs there, in tests)."""

    def __init__(self, sharded: Any, device: torch.device):
        self.sharded = sharded
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        #: the batch prefetched and not yet trained: (features, torchrec context, distributed input)
        self._queued: tuple[SparseFeatures, Any, Any] | None = None

    def _on_side_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def inputs_ready(self) -> None:
        """Called before batch i's forward is issued: the side stream may read every batch the
        harness made so far (batch i+1 included), without waiting for batch i's forward."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())

    def prefetch(self, features: SparseFeatures, kjt: Any) -> None:
        """Distribute batch ``features`` (as ``kjt``) and prefetch its rows on the side stream."""
        if self._queued is not None:
            raise RuntimeError("prefetch pipeline: a second batch prefetched before the first was trained "
                               "(fbgemm keeps one queue of cache locations per TBE)")
        forward_stream = torch.cuda.current_stream() if self.stream is not None else None
        with self._on_side_stream():
            ctx = self.sharded.create_context()
            dist_input = self.sharded.input_dist(ctx, kjt).wait().wait()
            self.sharded.prefetch(dist_input=dist_input, forward_stream=forward_stream, ctx=ctx)
        self._queued = (features, ctx, dist_input)

    def forward(self, features: SparseFeatures, kjt: Any):
        """The pooled embeddings of batch ``features`` (a KeyedTensor) from its prefetched state;
        a batch nobody prefetched (the first) is prefetched first, as torchrec's
        ``fill_pipeline`` does."""
        if self._queued is None or self._queued[0] is not features:
            self.drain()
            self.inputs_ready()
            self.prefetch(features, kjt)
        _, ctx, dist_input = self._queued
        self._queued = None
        if self.stream is not None:
            current = torch.cuda.current_stream()
            current.wait_stream(self.stream)
            dist_input.record_stream(current)
            ctx.record_stream(current)
        return self.sharded.compute_and_output_dist(ctx, dist_input).wait()

    def drain(self) -> None:
        """Consume a queued prefetch whose batch will not be trained (the run's last one, before
        evaluation): its forward runs without gradients and is dropped, so that fbgemm hands
        its queued cache locations to no other batch. (Its slots stay locked: no backward
        releases them; only evaluation follows.)"""
        if self._queued is not None:
            with torch.no_grad():
                self.forward(self._queued[0], None)

    def wait(self) -> None:
        """Make the current stream wait for the side stream (before reading what it wrote)."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
