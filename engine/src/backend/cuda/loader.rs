//! Loading the kernel files into a device: the CUBIN of every family, compiled for the device's
//! architecture (memo, disk cache or NVRTC), loaded into the device's primary context (the one
//! PyTorch uses; never a context of our own), with every registered kernel resolved; a warm-up
//! still compiling into the disk cache (warm.rs) is waited for first.

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use super::compile::{self, arch_of, Origin};
use super::driver;
use super::launch::{self, Grid, KArg};
use super::nvrtc::Nvrtc;
use super::registry::FAMILIES;
use super::warm;
use crate::error::{Error, Result};

fn driver_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e}"))
}

/// Every kernel family loaded on one device.
pub struct Loaded {
    pub ctx: Arc<CudaContext>,
    /// "sm_90"
    pub arch: String,
    pub modules: Vec<(&'static str, Arc<CudaModule>)>,
    /// Per family: where its CUBIN came from.
    pub origins: Vec<(&'static str, Origin)>,
}

impl Loaded {
    /// A kernel by name (`<op>_<dtype>`); the error names it and its family.
    pub fn function(&self, kernel: &str) -> Result<CudaFunction> {
        let family = super::registry::family_of(kernel).ok_or_else(|| Error::Cuda(format!("no CUDA kernel named {kernel}")))?;
        let (_, m) =
            self.modules.iter().find(|(n, _)| *n == family.name).ok_or_else(|| Error::Cuda(format!("{} not loaded", family.file())))?;
        m.load_function(kernel).map_err(|e| Error::Cuda(format!("{kernel} ({}): {e}", family.file())))
    }
    /// Launches `kernel` on the legacy default stream of this device (tests and one-off work;
    /// the executor launches on PyTorch's current stream).
    pub fn launch(&self, kernel: &str, grid: Grid, args: &[KArg]) -> Result<()> {
        let f = self.function(kernel)?;
        self.ctx.bind_to_thread().map_err(driver_err("binding the context"))?;
        launch::launch(&f, kernel, std::ptr::null_mut(), grid, args)
    }
    /// Waits for all work on the device; a kernel fault surfaces here.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.synchronize().map_err(driver_err("waiting for the device"))
    }
}

/// The longest a first load waits for a kernel-cache warm-up in progress before compiling
/// itself (a cold warm-up takes about a minute on a few cores).
const WARM_UP_PATIENCE: std::time::Duration = std::time::Duration::from_secs(600);

/// Loads every family on device `ordinal` and resolves every registered kernel.
pub fn load_all(ordinal: usize, nv: &Nvrtc, cache_dir: Option<&Path>) -> Result<Loaded> {
    // the probe first: cudarc panics where there is no driver or an old one
    driver::probe()?;
    let ctx = CudaContext::new(ordinal).map_err(driver_err("retaining the primary context"))?;
    let (major, minor) = ctx.compute_capability().map_err(driver_err("compute capability"))?;
    let (min_major, min_minor) = compile::MIN_COMPUTE_CAPABILITY;
    if (major, minor) < (min_major, min_minor) {
        return Err(Error::CudaUnavailable(format!(
            "GPU {ordinal} has compute capability {major}.{minor}; ortrain's CUDA kernels need {min_major}.{min_minor} (Ampere) or newer"
        )));
    }
    let arch = arch_of(major, minor);
    let mut modules = Vec::new();
    let mut origins = Vec::new();
    if let Some(dir) = cache_dir {
        // a warm-up compiling into this cache (a cluster's init script): its CUBINs, not our own
        warm::wait_for_warm_up(dir, &arch, WARM_UP_PATIENCE);
    }
    let cubins = compile::in_parallel(FAMILIES, |f| compile::cubin(nv, f, &arch, cache_dir));
    for (f, c) in FAMILIES.iter().zip(cubins) {
        let c = c?;
        let m =
            ctx.load_module(Ptx::from_binary(c.bytes.to_vec())).map_err(|e| Error::Cuda(format!("loading {} ({arch}): {e}", f.file())))?;
        for k in f.kernel_names() {
            m.load_function(&k).map_err(|e| Error::Cuda(format!("{k} in {}: {e}", f.file())))?;
        }
        modules.push((f.name, m));
        origins.push((f.name, c.origin));
    }
    Ok(Loaded { ctx, arch, modules, origins })
}
