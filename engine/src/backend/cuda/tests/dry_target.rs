//! Where a parity test runs: on the GPU, or dry (launch arguments and CPU references only) where
//! there is none.

use super::support::{assert_close_t, assert_same, dev, gpu, host, run, zeros};
use crate::backend::cuda::abi::Strides;
use crate::backend::cuda::launch::{DeviceBuffer, Grid, KArg};
use crate::backend::cuda::loader::Loaded;

/// Where a parity-a test runs: on the GPU, or dry where there is none: every launch's argument
/// list is checked against the registry and its geometry for sanity, the CPU references run and
/// output sizes are compared with them, values are not. A mistake on a test's host side (a CPU
/// op's attributes, a shape, a size in bytes) then fails without a GPU.
#[derive(Clone, Copy)]
pub enum Target {
    Gpu(&'static Loaded),
    Dry,
}

/// A device buffer, or its size in a dry run (address 0).
pub enum Buf {
    Dev(DeviceBuffer),
    Dry(usize),
}

impl Buf {
    pub fn ptr(&self) -> u64 {
        match self {
            Buf::Dev(b) => b.ptr(),
            Buf::Dry(_) => 0,
        }
    }
    pub fn bytes(&self) -> usize {
        match self {
            Buf::Dev(b) => b.bytes(),
            Buf::Dry(n) => *n,
        }
    }
}

impl Target {
    /// The GPU for `test`, or a dry run (after `gpu` printed SKIPPED).
    pub fn of(test: &str) -> Target {
        match gpu(test) {
            Some(g) => Target::Gpu(g),
            None => {
                eprintln!("{test}: dry run (launch arguments and CPU references only)");
                Target::Dry
            }
        }
    }
    /// Uploads raw bytes.
    pub fn up(&self, b: &[u8]) -> Buf {
        match self {
            Target::Gpu(g) => Buf::Dev(dev(g, b)),
            Target::Dry => Buf::Dry(b.len()),
        }
    }
    /// A zeroed buffer of `bytes` bytes.
    pub fn zeros(&self, bytes: usize) -> Buf {
        match self {
            Target::Gpu(g) => Buf::Dev(zeros::<u8>(g, bytes)),
            Target::Dry => Buf::Dry(bytes),
        }
    }
    /// Launches and waits (dry: checks the arguments and the geometry).
    pub fn run(&self, kernel: &str, grid: Grid, args: &[KArg]) {
        match self {
            Target::Gpu(g) => run(g, kernel, grid, args),
            Target::Dry => {
                crate::backend::cuda::launch::check_args(kernel, args).unwrap_or_else(|e| panic!("{e}"));
                assert!(grid.blocks > 0 && grid.threads > 0 && grid.threads <= 1024, "{kernel}: bad geometry {grid:?}");
            }
        }
    }
    /// The buffer's bytes (None in a dry run).
    pub fn down(&self, b: &Buf) -> Option<Vec<u8>> {
        match b {
            Buf::Dev(d) => Some(host::<u8>(d)),
            Buf::Dry(_) => None,
        }
    }
    /// `assert_same` of the buffer with `want` (dry: the sizes only).
    pub fn same(&self, what: &str, t: &str, b: &Buf, want: &[u8]) {
        match self.down(b) {
            Some(got) => assert_same(what, t, &got, want),
            None => assert_eq!(b.bytes(), want.len(), "{what}: output of {} bytes, the reference has {}", b.bytes(), want.len()),
        }
    }
    /// `assert_close_t` of the buffer with `want` (dry: the sizes only).
    pub fn close(&self, what: &str, t: &str, b: &Buf, want: &[u8], atol: f64) {
        match self.down(b) {
            Some(got) => assert_close_t(what, t, &got, want, atol),
            None => assert_eq!(b.bytes(), want.len(), "{what}: output of {} bytes, the reference has {}", b.bytes(), want.len()),
        }
    }
}

/// Host mirror of prelude.cuh `strided_offsets` (abi.rs `Strides::offsets`): the offsets of
/// index-space element `i` in operands 0..3. Dry runs emulate the bit-moving kernels with it,
/// so the `Strides` a test builds are checked against the CPU reference without a GPU.
pub fn offsets(s: &Strides, i: i64) -> [i64; 3] {
    s.offsets(i)
}

impl Target {
    pub fn is_dry(&self) -> bool {
        matches!(self, Target::Dry)
    }
}
