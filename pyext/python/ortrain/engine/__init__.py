"""The bridge between torch tensors and the Rust engine: sessions built from exported graphs,
the autograd.Function that runs forward and backward in the engine, and engine optimizer steps.
Tensors cross as (address, dtype, shape) triples; this package keeps them alive and contiguous."""
