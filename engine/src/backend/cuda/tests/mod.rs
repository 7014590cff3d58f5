//! Kernel parity on a GPU: every kernel of kernels/*.cu launched on random inputs and compared
//! with the CPU backend's kernel for the same op (through `cpu::testutil`, which is why these
//! are unit tests of the crate), or, where the CPU backend has no op of that shape (the fused
//! optimizers' multi-tensor form, bf16/f16 storage), with the CPU computation they mirror.
//! Exact for integer and bit-moving kernels; per-dtype tolerances otherwise.
//!
//! Every test asks [`gpu`] first: without a usable GPU (CI, the development machines) it prints
//! `SKIPPED <test>: <reason>` and returns. On a GPU machine without cargo the test binary is
//! built elsewhere (scripts/gpu_prepare.sh) and run by scripts/gpu_checks.sh.

mod activation;
mod attention_dropout;
mod attention_layout;
mod attention_reference;
mod blas;
mod blas_lt;
mod case_folders;
mod causal_attention;
mod computed_dropout;
mod dropout;
mod dry_target;
mod elementwise;
mod exec;
mod exec_fusions;
mod exec_models;
mod exec_models_norms;
mod exec_models_products;
mod flash_attention;
mod gather;
mod gpu_lock;
mod gpu_run;
mod grad_cases;
mod graphs;
mod key_padding_attention;
mod layernorm;
mod lce;
mod lce_frozen;
mod loss;
mod movement;
mod multi_device;
mod node_cases;
mod onnx_parity;
mod optim;
mod random_draws;
mod recompute_segments;
mod reduce;
mod residual;
mod rms_norm;
mod smoke;
mod softmax;
mod sort;
mod spatial;
mod support;
mod typed_bytes;
