//! Compile-only checks of the CUDA kernels (no GPU needed): every kernels/*.cu file is compiled
//! by NVRTC to an sm_90 CUBIN, and the CUBIN's symbol table must list exactly the kernels the
//! registry names; the CUBIN cache round-trips and rejects corrupt entries; compile errors carry
//! NVRTC's log and the file name.
//!
//! NVRTC comes from the pinned CUDA 13.0 wheels that scripts/bootstrap.sh installs into
//! `.cuda-wheels/` (requirements-cuda.txt), or from ORTRAIN_NVRTC_LIB. Without NVRTC these
//! tests fail, so that CI cannot pass without compiling the kernels; on a machine where that is
//! wanted, ORTRAIN_SKIP_NVRTC=1 turns the failure into a skip that says so.
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use ortrain_engine::backend::cuda::abi::{self, Arg};
use ortrain_engine::backend::cuda::compile::{self, Origin};
use ortrain_engine::backend::cuda::elf;
use ortrain_engine::backend::cuda::nvrtc::{self, Nvrtc};
use ortrain_engine::backend::cuda::registry::{types, Family, Group, FAMILIES};
use ortrain_engine::Error;

const ARCH: &str = "sm_90";

fn nvrtc_or_skip(test: &str) -> Option<&'static Nvrtc> {
    let wheels = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cuda-wheels/nvidia/cu13/lib");
    match nvrtc::load(&[wheels]) {
        Ok(n) => Some(n),
        Err(e) if std::env::var("ORTRAIN_SKIP_NVRTC").as_deref() == Ok("1") => {
            eprintln!("SKIPPED {test}: ORTRAIN_SKIP_NVRTC=1 and {e}");
            None
        }
        Err(e) => panic!(
            "{e}\nInstall the pinned NVRTC with `bash scripts/bootstrap.sh` (it fills .cuda-wheels/ from requirements-cuda.txt), \
             or set ORTRAIN_NVRTC_LIB, or ORTRAIN_SKIP_NVRTC=1 to skip these tests"
        ),
    }
}

#[test]
fn every_kernel_file_compiles_for_sm_90_with_exactly_the_registered_kernels() {
    let Some(nv) = nvrtc_or_skip("kernel compile") else { return };
    println!("NVRTC {} ({})", nv.version_string(), nv.path.as_ref().map_or("found by name".into(), |p| p.display().to_string()));
    let mut failures = Vec::new();
    let mut total = 0.0;
    let start = std::time::Instant::now();
    let compiled = compile::in_parallel(FAMILIES, |f| compile::compile_checked(nv, f, ARCH));
    let wall = start.elapsed().as_secs_f64() * 1e3;
    for (f, c) in FAMILIES.iter().zip(compiled) {
        match c {
            Ok((cubin, log, ms)) => {
                total += ms;
                let sm = elf::header(&cubin).map(|h| h.sm()).unwrap_or(0);
                println!("{:<26} {:>7.0} ms  {:>4} kernels  {:>8} bytes  sm_{sm}", f.file(), ms, f.kernel_names().len(), cubin.len());
                if sm != 90 {
                    failures.push(format!("{}: CUBIN is for sm_{sm}, not sm_90", f.file()));
                }
                if !log.is_empty() {
                    failures.push(format!("{}: NVRTC warnings (kernels must compile cleanly):\n{log}", f.file()));
                }
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    println!("all kernel files: {total:.0} ms of compiles in {wall:.0} ms on {} threads", compile::compile_threads());
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

static TINY: Family = Family {
    name: "tiny_test",
    source: "#include \"prelude.cuh\"\nextern \"C\" __global__ void k_f32(float* x) { x[threadIdx.x] = 1.f; }\n",
    groups: &[Group { ops: &["k"], dtypes: types::F32, args: &[Arg::Ptr] }],
};

#[test]
fn the_disk_cache_round_trips_and_recompiles_corrupt_entries() {
    let Some(nv) = nvrtc_or_skip("cubin cache") else { return };
    let dir = std::env::temp_dir().join(format!("ortrain-cuda-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let first = compile::load_or_compile(nv, &TINY, ARCH, Some(&dir)).unwrap();
    assert!(matches!(first.origin, Origin::Compiled { stored: true, .. }), "{:?}", first.origin);
    let second = compile::load_or_compile(nv, &TINY, ARCH, Some(&dir)).unwrap();
    assert_eq!(second.origin, Origin::Disk);
    assert_eq!(first.bytes, second.bytes);
    let entries: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).collect();
    assert_eq!(entries.len(), 1, "one entry, no temporary files left: {entries:?}");
    std::fs::write(&entries[0], b"\x7fELF garbage").unwrap();
    let third = compile::load_or_compile(nv, &TINY, ARCH, Some(&dir)).unwrap();
    assert!(matches!(third.origin, Origin::Compiled { .. }), "{:?}", third.origin);
    // the process memo answers the second call without the disk
    assert!(matches!(compile::cubin(nv, &TINY, ARCH, None).unwrap().origin, Origin::Compiled { stored: false, .. }));
    assert_eq!(compile::cubin(nv, &TINY, ARCH, None).unwrap().origin, Origin::Memo);
    let _ = std::fs::remove_dir_all(&dir);
}

static BROKEN: Family = Family {
    name: "broken_test",
    source: "#include \"prelude.cuh\"\nextern \"C\" __global__ void k_f32(float* x) { x[0] = undefined_name; }\n",
    groups: &[Group { ops: &["k"], dtypes: types::F32, args: &[Arg::Ptr] }],
};

static UNREGISTERED: Family = Family {
    name: "unregistered_test",
    source:
        "#include \"prelude.cuh\"\nextern \"C\" __global__ void k_f32(float* x) {}\nextern \"C\" __global__ void extra_f32(float* x) {}\n",
    groups: &[Group { ops: &["k", "missing"], dtypes: types::F32, args: &[Arg::Ptr] }],
};

#[test]
fn compile_errors_name_the_file_and_carry_the_nvrtc_log() {
    let Some(nv) = nvrtc_or_skip("compile errors") else { return };
    match compile::compile_checked(nv, &BROKEN, ARCH) {
        Err(Error::KernelCompile { file, arch, log, .. }) => {
            assert_eq!((file.as_str(), arch.as_str()), ("kernels/broken_test.cu", ARCH));
            assert!(log.contains("undefined_name") && log.contains("broken_test.cu(2)"), "{log}");
        }
        other => panic!("expected a KernelCompile error, got {other:?}"),
    }
    let e = compile::compile_checked(nv, &UNREGISTERED, ARCH).unwrap_err().to_string();
    assert!(e.contains("missing [\"missing_f32\"]") && e.contains("not registered [\"extra_f32\"]"), "{e}");
}

static WRONG_SIGNATURE: Family = Family {
    name: "wrong_signature_test",
    source: "#include \"prelude.cuh\"\nextern \"C\" __global__ void k_f32(float* x, int n) { if (n) x[0] = 0.f; }\n",
    groups: &[Group { ops: &["k"], dtypes: types::F32, args: &[Arg::Ptr, Arg::I64] }],
};

#[test]
fn a_signature_that_differs_from_the_kernel_is_caught_without_a_gpu() {
    let Some(nv) = nvrtc_or_skip("launch ABI") else { return };
    let e = compile::compile_checked(nv, &WRONG_SIGNATURE, ARCH).unwrap_err().to_string();
    assert!(e.contains("launch ABI") && e.contains("k_f32: the CUBIN has (offset, size) [(0, 8), (8, 4)]"), "{e}");
    assert_eq!(abi::layout(&[Arg::Ptr, Arg::I64]), vec![(0, 8), (8, 8)]);
}
