//! GPU checks of the CUDA backend: they run where the driver probe finds a usable GPU and skip,
//! saying why, everywhere else (CI and the development machines have no GPU). What they check:
//! every kernel file is compiled for the device's architecture (through the disk cache) and
//! loaded into the primary context, and every registered kernel resolves (run cold, it times the
//! NVRTC compile of every file; warm, the disk cache). Kernel launches and the executor are tested
//! by the crate's unit tests (engine/src/backend/cuda/tests).
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use ortrain_engine::backend::cuda::{cache, loader, nvrtc, probe};

#[test]
fn gpu_every_kernel_loads_into_the_primary_context() {
    let info = match probe() {
        Ok(i) => i,
        Err(e) => {
            eprintln!("SKIPPED gpu_every_kernel_loads_into_the_primary_context: {e}");
            return;
        }
    };
    let wheels = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cuda-wheels/nvidia/cu13/lib");
    let nv = nvrtc::load(&[wheels]).expect("a GPU machine for these tests needs NVRTC (bash scripts/bootstrap.sh)");
    let dir = cache::default_dir();
    let loaded = loader::load_all(0, nv, dir.as_deref()).unwrap_or_else(|e| panic!("{e}"));
    println!("CUDA {} ({} device(s)), {}, NVRTC {}", info.version_string(), info.devices, loaded.arch, nv.version_string());
    for (family, origin) in &loaded.origins {
        println!("{family:<12} {origin:?}");
    }
    assert!(loaded.function("softmax_f32").is_ok());
    assert!(loaded.function("no_such_kernel_f32").unwrap_err().to_string().contains("no CUDA kernel named"));
}
