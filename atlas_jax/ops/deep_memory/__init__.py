"""The deep memories' sequential chunk pass (the dual form's θ-carrying part) as one op.

`mlp_state_pass` carries a depth-2 MLP memory's weights (and momentum) from chunk to chunk of the
chunk-start-gradient form: per chunk a forward pass of the chunk's gradient sources at the chunk's
start θ, the output residual's cotangents, and the chunk-end update, one outer-product sum per
weight. impl="chunk" is a lax.scan in XLA (the reference); impl="pallas" the Pallas kernel
(`atlas_jax.kernels.deep_memory`, interpret mode on CPU). `atlas_jax.forms.dual` builds its
operands (the chunk-parallel coefficients) and reads every chunk from the states it returns;
`mlp_reads` is those reads for this memory (reference and GPU kernel). `dual_chain_reference` is
the chain of a super-chunk for a depth-2 MLP memory whose first layer reads a wide input (φ of
omeganet, dla), which the dual form runs between its products with θ. `chunk_step_memory` is
titans-pytorch's schedule (one step per chunk, gradients at a segment's start, lagged reads).
"""

from atlas_jax.ops.deep_memory.state_pass import (
    IMPLS,
    MLPSources,
    MLPStates,
    kernel_covers,
    mlp_chunk_sources,
    mlp_chunk_step,
    mlp_sources_from_starts,
    mlp_state_pass,
    mlp_state_pass_reference,
)
from atlas_jax.ops.deep_memory.chunk_steps import ChunkStepState, chunk_step_memory
from atlas_jax.ops.deep_memory.dual_chain import ChainOutputs, chain_weights, dual_chain_reference
from atlas_jax.ops.deep_memory.reads import (mlp_chunk_read, mlp_reads, mlp_reads_reference,
                                              mlp_state_pass_and_reads)

__all__ = ["ChainOutputs", "ChunkStepState", "chunk_step_memory", "IMPLS", "MLPSources", "MLPStates", "chain_weights", "dual_chain_reference", "kernel_covers",
           "mlp_chunk_read", "mlp_chunk_sources", "mlp_chunk_step", "mlp_reads", "mlp_reads_reference",
           "mlp_sources_from_starts", "mlp_state_pass", "mlp_state_pass_and_reads", "mlp_state_pass_reference"]
