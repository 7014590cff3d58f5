// ortrain CUDA emulator: checks of the emulator itself, through the driver API as the engine
// calls it (build.sh builds it, scripts/test.sh runs it): that work on two non-blocking
// streams with nothing ordering them can run in either order, that an event wait orders
// them, that the legacy stream orders itself with blocking streams, that the pageable
// "synchronous" copies and memsets leave their work queued, that a misaligned store traps, and
// that a context-wide synchronize while another thread captures a stream fails and invalidates
// that capture.
// Exits 0 when every check holds, else prints what did not and exits 1.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <thread>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
extern "C" {
CUresult cuInit(unsigned);
CUresult cuMemAlloc_v2(CUdeviceptr*, size_t);
CUresult cuMemcpyDtoH_v2(void*, CUdeviceptr, size_t);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void*, size_t);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, size_t, void*);
CUresult cuMemsetD32_v2(CUdeviceptr, unsigned, size_t);
CUresult cuStreamCreate(void**, unsigned);
CUresult cuStreamSynchronize(void*);
CUresult cuCtxSynchronize();
CUresult cuEventCreate(void**, unsigned);
CUresult cuEventRecord(void*, void*);
CUresult cuStreamWaitEvent(void*, void*, unsigned);
CUresult cuModuleLoadData(void**, const void*);
CUresult cuModuleGetFunction(void**, void*, const char*);
CUresult cuStreamBeginCapture_v2(void*, int);
CUresult cuStreamEndCapture(void*, void**);
CUresult cuLaunchKernel(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**, void**);
}

namespace {

int failures = 0;

void check(bool ok, const char* what) {
    if (!ok) {
        fprintf(stderr, "cuda-emu selftest: FAILED: %s\n", what);
        ++failures;
    }
}

void* fill_u32;

// queues fill_u32(y, 1, bits) on `stream`
CUresult fill(void* stream, CUdeviceptr y, unsigned bits) {
    long long n = 1;
    unsigned long long b = bits;
    void* params[] = {&y, &n, &b};
    return cuLaunchKernel(fill_u32, 1, 1, 1, 32, 1, 1, 0, stream, params, nullptr);
}

unsigned read(CUdeviceptr p) {
    unsigned v = 0;
    cuMemcpyDtoH_v2(&v, p, 4);
    return v;
}

}  // namespace

int main() {
    cuInit(0);
    void* module;
    const char not_a_cubin[] = "selftest";
    cuModuleLoadData(&module, not_a_cubin);
    if (cuModuleGetFunction(&fill_u32, module, "fill_u32") != 0) {
        fprintf(stderr, "cuda-emu selftest: no fill_u32 kernel\n");
        return 1;
    }
    CUdeviceptr x, y;
    cuMemAlloc_v2(&x, 64);
    cuMemAlloc_v2(&y, 64);
    void *a, *b, *blocking, *done;
    cuStreamCreate(&a, 1);  // CU_STREAM_NON_BLOCKING
    cuStreamCreate(&b, 1);
    cuStreamCreate(&blocking, 0);
    cuEventCreate(&done, 2);

    // x is written on a, then copied to y on b: with nothing ordering b after a, the copy
    // sometimes runs first (over 200 tries); with an event wait, never
    int stale = 0, stale_with_wait = 0;
    for (unsigned t = 1; t <= 200; ++t) {
        cuMemsetD32_v2(x, 0, 1);
        cuCtxSynchronize();
        fill(a, x, t);
        cuMemcpyDtoDAsync_v2(y, x, 4, b);
        cuCtxSynchronize();
        stale += read(y) != t;
        cuMemsetD32_v2(x, 0, 1);
        cuCtxSynchronize();
        fill(a, x, t);
        cuEventRecord(done, a);
        cuStreamWaitEvent(b, done, 0);
        cuMemcpyDtoDAsync_v2(y, x, 4, b);
        cuCtxSynchronize();
        stale_with_wait += read(y) != t;
    }
    // ORT_EMU_ORDER=forward runs everything in queue order, on purpose
    const char* order = getenv("ORT_EMU_ORDER");
    const bool shuffled = !(order && strcmp(order, "forward") == 0);
    check(!shuffled || stale > 0, "two non-blocking streams with no wait between them always ran in queue order");
    check(stale_with_wait == 0, "a copy after cuStreamWaitEvent read the value from before the recorded work");

    // the legacy stream is ordered with blocking streams: a fill on it, then a copy on a
    // blocking stream with no event, always sees the fill
    int unordered = 0;
    for (unsigned t = 1; t <= 50; ++t) {
        fill(nullptr, x, t);
        cuMemcpyDtoDAsync_v2(y, x, 4, blocking);
        cuCtxSynchronize();
        unordered += read(y) != t;
    }
    check(unordered == 0, "a blocking stream ran before work queued earlier on the legacy stream");

    // a "synchronous" copy from pageable memory goes on the legacy stream and may still be
    // queued when it returns: a non-blocking stream's copy right after it sometimes misses it
    int missed = 0;
    for (unsigned t = 1; t <= 200; ++t) {
        cuMemsetD32_v2(x, 0, 1);
        cuCtxSynchronize();
        cuMemcpyHtoD_v2(x, &t, 4);
        cuMemcpyDtoDAsync_v2(y, x, 4, a);
        cuCtxSynchronize();
        missed += read(y) != t;
    }
    check(!shuffled || missed > 0, "a pageable cuMemcpyHtoD was always done before a non-blocking stream's next copy");

    // a store to a u32 at an address that is not a multiple of 4 traps, as a GPU's does
    fprintf(stderr, "cuda-emu selftest: a misaligned store (the error it prints next is expected):\n");
    check(fill(a, x + 2, 7) == 0, "the misaligned launch was refused at launch (it should fail when it runs)");
    check(cuStreamSynchronize(a) == 716, "a misaligned u32 store was not reported as CUDA_ERROR_MISALIGNED_ADDRESS");

    // cuCtxSynchronize while another thread captures a stream (thread-local mode, as the
    // engine's): 900 (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED), and that capture ends with 901
    // (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED), as on an H200
    void* captured;
    cuStreamCreate(&captured, 1);
    std::atomic<int> phase{0};
    int began = -1, ended = -1;
    std::thread capturer([&] {
        began = cuStreamBeginCapture_v2(captured, 1);
        phase = 1;
        while (phase != 2) std::this_thread::yield();
        void* graph = nullptr;
        ended = cuStreamEndCapture(captured, &graph);
    });
    while (phase != 1) std::this_thread::yield();
    fprintf(stderr, "cuda-emu selftest: a synchronize during another thread's capture (the error it prints next is expected):\n");
    const int synced = cuCtxSynchronize();
    phase = 2;
    capturer.join();
    check(began == 0, "the stream capture did not begin");
    check(synced == 900, "cuCtxSynchronize during another thread's capture was not CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED");
    check(ended == 901, "the capture a synchronize interrupted did not end as CUDA_ERROR_STREAM_CAPTURE_INVALIDATED");

    if (failures) return 1;
    printf("cuda-emu selftest: %d of 200 unordered copies and %d of 200 copies after a pageable cuMemcpyHtoD read the old value; ", stale, missed);
    printf("streams, the legacy stream, pageable copies, misaligned stores and a synchronize during a capture behave as on a GPU\n");
    return 0;
}
