# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which forward passes are planned steps of an installed stage: decode-only
forward passes of its model whose rows its buffers hold. Host state only,
read once per forward context; a FULL CUDA graph capture gets the answer of
the decode steps that replay it (captures are not dummy runs; breakable
graphs rerun the indexer eagerly at replay, in the step's own context)."""

import weakref

from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadata

# The attention metadata a planned step's layers may carry: the indexer's
# and MLA's. Any other makes the step unplanned (its decodes are unknown).
ACCEPTED_METADATA = (DeepseekV32IndexerMetadata, MLACommonMetadata)


class PlannedSteps:
    """The planned-step test of one stage: ``layer`` is one of its DSA
    layers' indexer cache (its metadata tells the model's forward passes
    from the MTP draft's), ``ignored`` the layers whose metadata does not
    describe the step (the storage-only tail caches split with threshold 1,
    so a speculative decode step reads as prefills there)."""

    def __init__(self, layer: str, max_rows: int, ignored=frozenset()):
        self.layer, self.max_rows = layer, max_rows
        self.ignored = frozenset(ignored)
        self._context = None  # the forward context last answered (weakly)
        self._answer = False

    def covers(self, context) -> bool:
        """Whether ``context`` (a ForwardContext) is a planned step."""
        if self._context is None or self._context() is not context:
            self._context = weakref.ref(context)
            self._answer = self._decide(context)
        return self._answer

    def _decide(self, context) -> bool:
        # Warmup and idle dummy runs are not steps (patch 0004's flag).
        if context.dummy_run:
            return False
        metadata = context.attn_metadata
        # None: a profiling run; a list: micro-batches; no layer of the model:
        # the MTP draft's forward, whose kernels the warmup did not see.
        if not isinstance(metadata, dict) or self.layer not in metadata:
            return False
        decodes = False
        described = (m for name, m in metadata.items() if name not in self.ignored)
        for layer_metadata in {id(m): m for m in described}.values():
            if not isinstance(layer_metadata, ACCEPTED_METADATA):
                return False
            tokens = layer_metadata.num_decode_tokens
            if layer_metadata.num_prefills > 0 or tokens > self.max_rows:
                return False
            decodes = decodes or tokens > 0
        return decodes
