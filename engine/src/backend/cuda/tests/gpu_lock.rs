//! The lock that keeps a GPU test recording a CUDA graph apart from the others (support.rs's
//! `gpu` holds it shared, `gpu_alone` exclusively).

/// Held by every GPU test for as long as its thread lives: shared by most, exclusive by a test
/// that records a CUDA graph. While a stream of the context is capturing, a context-wide
/// synchronize on another thread (`DeviceBuffer::to_vec`, `Loaded::synchronize`) fails with
/// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture (first seen on an H200).
static GPU_TESTS: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// This test thread's hold on GPU_TESTS (libtest runs each test on a thread of its own, so the
/// hold ends with the test).
enum Hold {
    Shared(#[allow(dead_code)] std::sync::RwLockReadGuard<'static, ()>),
    Exclusive(#[allow(dead_code)] std::sync::RwLockWriteGuard<'static, ()>),
}

thread_local! {
    static HOLD: std::cell::RefCell<Option<Hold>> = const { std::cell::RefCell::new(None) };
}

/// Holds GPU_TESTS on this thread until it ends: exclusively, or shared (a thread already holding
/// it exclusively keeps that).
pub fn hold(exclusive: bool) {
    HOLD.with(|h| {
        let mut h = h.borrow_mut();
        match (&*h, exclusive) {
            (Some(Hold::Exclusive(_)), _) | (Some(Hold::Shared(_)), false) => {}
            _ => {
                // a shared hold is let go before waiting for the exclusive one
                *h = None;
                // a test that panicked while holding the lock poisons it; the device is still usable
                *h = Some(if exclusive {
                    Hold::Exclusive(GPU_TESTS.write().unwrap_or_else(|e| e.into_inner()))
                } else {
                    Hold::Shared(GPU_TESTS.read().unwrap_or_else(|e| e.into_inner()))
                });
            }
        }
    });
}
