"""The blockwise attention kernel's tile, as plain numbers: the kernel (jaxpar/ops/blockwise_attention.py)
tiles the scores with it and the cost model (jaxpar/cost/program_memory.py) sizes its backward pass's
working tiles with it, without importing JAX."""

BLOCK_Q = 512   # query rows per block: big enough to keep the matmuls efficient on CPU, small against long sequences
BLOCK_K = 512   # keys per block
