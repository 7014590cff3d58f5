//! The trial run of a bf16 kernel before a process first uses it (the AMX tile path, which the
//! project's own machines have never run): a few exact products through the whole driver
//! (packing, kernel, stores) in a forked child process, so that an illegal instruction, a fault
//! or a hang ends the child and not the user's training, and a wrong result is seen before any
//! model uses it. The parent reads how the child ended; anything but a pass keeps the kernel
//! off, and `explain` says why.
//!
//! The operands are multiples of 1/8 in [-1, 1] (exact in bf16) and C's start values multiples
//! of 1/8 as well, so every product and partial sum is exact in f32: the kernel must match the
//! f64 reference bit for bit, whatever its accumulation order.

use std::time::Duration;
#[cfg(target_os = "linux")]
use std::time::Instant;

use super::driver::{self, Kernel, Problem};
use super::MatRef;

/// How a trial ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trial {
    Passed,
    /// The trial ran to its end and found a wrong result (what it found).
    WrongResult(String),
    /// The child was killed by this signal (4: an illegal instruction, 11: a fault).
    Crashed(i32),
    /// The child did not finish within the time given (then it was killed).
    TimedOut,
    /// The child could not be started or watched (why).
    NotRun(String),
}

impl Trial {
    /// Why the kernel is not used, for `explain` (None for a pass).
    pub fn failure(&self) -> Option<String> {
        match self {
            Trial::Passed => None,
            Trial::WrongResult(what) => Some(format!("its trial run computed a wrong product ({what})")),
            Trial::Crashed(sig) => Some(format!("its trial run crashed (signal {sig}{})", signal_name(*sig))),
            Trial::TimedOut => Some("its trial run did not finish".into()),
            Trial::NotRun(why) => Some(format!("its trial run could not start ({why})")),
        }
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGILL => ", SIGILL",
        libc::SIGSEGV => ", SIGSEGV",
        libc::SIGBUS => ", SIGBUS",
        libc::SIGFPE => ", SIGFPE",
        libc::SIGABRT => ", SIGABRT",
        _ => "",
    }
}

/// The most a child's message may carry back.
const MESSAGE_BYTES: usize = 512;

/// Runs `check` in a forked child and reports how it ended; `check` returns Err(what was wrong).
/// The child runs only the calling thread's code (no rayon, no Python): `check` must not wait
/// on anything another thread of the parent would provide.
#[cfg(target_os = "linux")]
pub fn in_child(check: impl FnOnce() -> Result<(), String>, timeout: Duration) -> Trial {
    let mut fds = [0i32; 2];
    // SAFETY: fds has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Trial::NotRun(format!("pipe: {}", std::io::Error::last_os_error()));
    }
    let (read_fd, write_fd) = (fds[0], fds[1]);
    // SAFETY: the child only runs `check`, writes to the pipe and leaves with _exit: no
    // destructors, atexit handlers or buffered output of the parent run twice.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: the child's copy of the read end is not used.
        unsafe { libc::close(read_fd) };
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(check));
        let (code, message) = match outcome {
            Ok(Ok(())) => (0, String::new()),
            Ok(Err(what)) => (1, what),
            Err(_) => (1, "the check panicked".to_string()),
        };
        let bytes = &message.as_bytes()[..message.len().min(MESSAGE_BYTES)];
        // SAFETY: writes the message from a live buffer, then ends the child at once.
        unsafe {
            libc::write(write_fd, bytes.as_ptr() as *const libc::c_void, bytes.len());
            libc::_exit(code)
        }
    }
    // SAFETY: the parent's copy of the write end is not used (the child holds its own).
    unsafe { libc::close(write_fd) };
    if pid < 0 {
        let err = std::io::Error::last_os_error();
        // SAFETY: closes the pipe's read end, owned here.
        unsafe { libc::close(read_fd) };
        return Trial::NotRun(format!("fork: {err}"));
    }
    let waited = wait_for(pid, timeout);
    let message = read_all(read_fd);
    // SAFETY: closes the pipe's read end, owned here.
    unsafe { libc::close(read_fd) };
    match waited {
        Waited::Out => Trial::TimedOut,
        Waited::Lost(err) => Trial::NotRun(format!("waitpid: {err}")),
        Waited::Status(s) if libc::WIFSIGNALED(s) => Trial::Crashed(libc::WTERMSIG(s)),
        Waited::Status(s) if libc::WIFEXITED(s) && libc::WEXITSTATUS(s) == 0 => Trial::Passed,
        Waited::Status(_) => Trial::WrongResult(message),
    }
}

#[cfg(not(target_os = "linux"))]
pub fn in_child(_check: impl FnOnce() -> Result<(), String>, _timeout: Duration) -> Trial {
    Trial::NotRun("trial runs need Linux".into())
}

#[cfg(target_os = "linux")]
enum Waited {
    Status(i32),
    /// It outlived the timeout (then it was killed and reaped).
    Out,
    /// Its status could not be read (e.g. SIGCHLD ignored: the kernel reaped it).
    Lost(std::io::Error),
}

/// How the child ended, waiting at most `timeout`.
#[cfg(target_os = "linux")]
fn wait_for(pid: libc::pid_t, timeout: Duration) -> Waited {
    let start = Instant::now();
    let mut pause = Duration::from_micros(200);
    loop {
        let mut status = 0;
        // SAFETY: pid is our child; status is a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return Waited::Status(status);
        }
        if r < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINTR) {
                return Waited::Lost(err);
            }
        }
        if start.elapsed() >= timeout {
            // SAFETY: pid is our child, still running; kill it and reap it.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return Waited::Out;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

#[cfg(target_os = "linux")]
fn read_all(fd: i32) -> String {
    let mut buf = vec![0u8; MESSAGE_BYTES];
    let mut len = 0;
    while len < buf.len() {
        // SAFETY: reads into the unused tail of buf; the write end is closed, so this ends.
        let n = unsafe { libc::read(fd, buf[len..].as_mut_ptr() as *mut libc::c_void, buf.len() - len) };
        if n <= 0 {
            break;
        }
        len += n as usize;
    }
    String::from_utf8_lossy(&buf[..len]).into_owned()
}

/// Multiples of 1/8 in [-1, 1]: exact in bf16, and in f32 through every sum the checks make.
fn eighths(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + seed * 13 + i / 5) % 17) as f32 / 8.0 - 1.0).collect()
}

/// The products the trial makes: both operand layouts, partial tiles, several k steps
/// (k > 256), C overwritten and accumulated, a scaled product.
const CASES: &[(usize, usize, usize, bool, bool, f32, f32)] = &[
    (37, 45, 70, false, false, 1.0, 0.0),
    (33, 17, 300, true, false, 1.0, 1.0),
    (64, 40, 33, false, true, 0.5, 0.0),
    (5, 70, 600, true, true, 1.0, 1.0),
    // whole 32 × 32 blocks, accumulated over k blocks: the AMX kernel's tiles load and store C
    (64, 64, 600, false, false, 1.0, 1.0),
];

/// Every case through `kern` (one thread) against its f64 reference, bit for bit.
///
/// # Safety
/// The CPU has avx512f, avx512bw, avx512bf16 (the packers) and what `kern` needs.
pub unsafe fn exact_products<K: Kernel>(kern: &K) -> Result<(), String> {
    for (case, &(m, n, k, ta, tb, alpha, beta)) in CASES.iter().enumerate() {
        let (a, b) = (eighths(m * k, case), eighths(k * n, case + 7));
        let view = |v: &[f32], rows: usize, cols: usize, t: bool| {
            let (rs, cs) = if t { (1, rows as isize) } else { (cols as isize, 1) };
            (MatRef { ptr: v.as_ptr(), rs, cs }, rs, cs)
        };
        let ((av, ars, acs), (bv, brs, bcs)) = (view(&a, m, k, ta), view(&b, k, n, tb));
        let ldc = n + 1;
        let c0 = eighths(m * ldc, case + 3);
        let mut c = c0.clone();
        let g = Problem { m, n, k, alpha, a: av, b: bv, beta, c: c.as_mut_ptr(), ldc };
        // SAFETY: the views cover a and b; C holds m rows of ldc ≥ n floats; the caller's
        // contract covers the CPU features.
        unsafe { driver::run(kern, &g, false) };
        for i in 0..m {
            for j in 0..ldc {
                let want = if j < n {
                    let dot: f64 = (0..k)
                        .map(|kk| {
                            a[(i as isize * ars + kk as isize * acs) as usize] as f64
                                * b[(kk as isize * brs + j as isize * bcs) as usize] as f64
                        })
                        .sum();
                    alpha as f64 * dot + if beta == 0.0 { 0.0 } else { beta as f64 * c0[i * ldc + j] as f64 }
                } else {
                    c0[i * ldc + j] as f64 // past n: untouched
                };
                let got = c[i * ldc + j];
                if got as f64 != want {
                    return Err(format!("{m}x{n}x{k} case {case}: C[{i},{j}] = {got}, exact {want}"));
                }
            }
        }
    }
    Ok(())
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use crate::backend::cpu::bf16::amx::{Amx, Emu, TileOps};
    use crate::backend::cpu::bf16::avx512::Avx512Bf16;

    const SECOND: Duration = Duration::from_secs(1);

    fn have_bf16() -> bool {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512bf16")
    }

    #[test]
    fn a_trial_reports_each_way_a_child_can_end() {
        assert_eq!(in_child(|| Ok(()), SECOND * 10), Trial::Passed);
        assert_eq!(in_child(|| Err("C[1,2] = 3".into()), SECOND * 10), Trial::WrongResult("C[1,2] = 3".into()));
        let killed = in_child(
            || {
                // SAFETY: raising a signal in the child: what an illegal instruction does to it.
                unsafe { libc::raise(libc::SIGILL) };
                Ok(())
            },
            SECOND * 10,
        );
        assert_eq!(killed, Trial::Crashed(libc::SIGILL));
        assert!(killed.failure().is_some_and(|w| w.contains("SIGILL")), "{killed:?}");
        let t0 = Instant::now();
        let hung = in_child(
            || {
                std::thread::sleep(SECOND * 30);
                Ok(())
            },
            Duration::from_millis(300),
        );
        assert_eq!(hung, Trial::TimedOut);
        assert!(t0.elapsed() < SECOND * 10, "the hung child was not killed at its timeout");
    }

    #[test]
    fn the_exact_products_pass_on_good_kernels_in_a_child() {
        if !have_bf16() {
            eprintln!("skipped: this CPU has no avx512_bf16 (the packers need it)");
            return;
        }
        // SAFETY: the CPU has the packers' features (checked); Emu needs nothing more.
        assert_eq!(in_child(|| unsafe { exact_products(&Avx512Bf16) }, SECOND * 20), Trial::Passed);
        // SAFETY: as above.
        assert_eq!(in_child(|| unsafe { exact_products(&Amx::<Emu>::new()) }, SECOND * 20), Trial::Passed);
    }

    /// The tile model with A and B swapped in its products: the kind of operand-order mistake
    /// the trial exists to catch on real tiles.
    struct Swapped(Emu);

    impl TileOps for Swapped {
        unsafe fn begin() -> Self {
            // SAFETY: the model needs nothing of the CPU.
            Swapped(unsafe { Emu::begin() })
        }
        unsafe fn zero(&mut self) {
            // SAFETY: forwarded contract.
            unsafe { self.0.zero() }
        }
        unsafe fn step(&mut self, a0: *const u32, a1: *const u32, a_stride: usize, b0: *const u32, b1: *const u32, b_stride: usize) {
            // SAFETY: forwarded contract: both pairs cover 16 rows of 64 bytes at their strides.
            unsafe { self.0.step(b0, b1, b_stride, a0, a1, a_stride) }
        }
        unsafe fn load(&mut self, c: *const f32, stride: usize) {
            // SAFETY: forwarded contract.
            unsafe { self.0.load(c, stride) }
        }
        unsafe fn store(&mut self, out: *mut f32, stride: usize) {
            // SAFETY: forwarded contract.
            unsafe { self.0.store(out, stride) }
        }
    }

    #[test]
    fn a_kernel_with_its_operands_swapped_fails_the_trial() {
        if !have_bf16() {
            eprintln!("skipped: this CPU has no avx512_bf16 (the packers need it)");
            return;
        }
        // SAFETY: the CPU has the packers' features (checked).
        let trial = in_child(|| unsafe { exact_products(&Amx::<Swapped>::new()) }, SECOND * 20);
        assert!(matches!(&trial, Trial::WrongResult(what) if what.contains("exact")), "{trial:?}");
    }
}
