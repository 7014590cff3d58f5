// ortrain CUDA emulator: the part of the CUDA driver API (libcuda.so.1) the engine and cudarc
// call, on the CPU. One device (reported as an sm_90 GPU with 132 SMs, named as an emulator),
// device memory is host memory, streams are queues of deferred work (queues.cpp: it runs when
// the host waits for it, in an order a GPU could choose), stream capture records that work into
// a graph replayed by cuGraphLaunch.
//
// What it checks as a GPU would, so CI catches it: launch configurations (block size, grid,
// dynamic shared memory against the function's limit, the registers and static shared memory
// the kernel's CUBIN says it needs: cubin.cpp), the calls a stream capture forbids on
// the capturing thread (allocation, synchronous copies, synchronising the captured stream),
// memory faults (each allocation ends at an inaccessible page; freed memory is unmapped) and
// uninitialised memory (fresh allocations are filled with 0xff bytes: NaN as floats, -1 as
// integers). Errors inside a kernel are reported at the next synchronising call, as on a GPU,
// but are not sticky (the next test in the process still runs).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "emu_runtime.h"
#include "cubin.h"
#include "queues.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void* CUstream;

namespace ort_emu {
namespace {

constexpr int OK = 0;
constexpr int INVALID_VALUE = 1;
constexpr int OUT_OF_MEMORY = 2;
constexpr int NOT_INITIALIZED = 3;
constexpr int INVALID_DEVICE = 101;
constexpr int INVALID_HANDLE = 400;
constexpr int NOT_READY = 600;
constexpr int NOT_FOUND = 500;
constexpr int ILLEGAL_ADDRESS = 700;
constexpr int LAUNCH_OUT_OF_RESOURCES = 701;
constexpr int LAUNCH_FAILED = 719;
constexpr int NOT_SUPPORTED = 801;
constexpr int CAPTURE_UNSUPPORTED = 900;
constexpr int CAPTURE_INVALIDATED = 901;
constexpr int CAPTURE_WRONG_THREAD = 908;

struct Allocation {
    void* map;
    size_t map_bytes;
    size_t bytes;
    int device;  // the device of the context current when it was allocated
};

// A graph's work is shared with its launches still queued: the driver lets a graph be
// destroyed while a launch of it runs.
struct Graph {
    std::shared_ptr<const std::vector<std::function<int()>>> work;
};

struct State {
    std::map<uintptr_t, Allocation> allocations;  // by start address
    std::map<uintptr_t, size_t> pinned;           // host memory from cuMemAllocHost, by start
    std::map<const Kernel*, int> max_dynamic_shared;
};

State& state() {
    static State* s = new State();
    return *s;
}

// the streams this thread is capturing, and every thread's (under the Lock)
thread_local std::vector<Stream*> captures_on_this_thread;
std::vector<Stream*> captures_anywhere;

// Devices: ORT_EMU_DEVICES of them (1 to 8, default 1), each with one (primary) context. A
// thread's current context is device 0's until it sets another, as the engine's contexts are
// PyTorch's primary ones.
constexpr int MAX_DEVICES = 8;
struct Context {
    int device;
};
Context contexts[MAX_DEVICES] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
thread_local std::vector<Context*> context_stack;  // back(): the current context

int device_count() {
    static const int n = [] {
        const char* v = getenv("ORT_EMU_DEVICES");
        const int k = v ? atoi(v) : 1;
        return k < 1 ? 1 : k > MAX_DEVICES ? MAX_DEVICES : k;
    }();
    return n;
}
Context* current_context() { return context_stack.empty() ? &contexts[0] : context_stack.back(); }
Context* as_context(void* ctx) {
    for (Context& c : contexts)
        if (&c == ctx && c.device < device_count()) return &c;
    return nullptr;
}
int module_marker;

bool is_legacy(CUstream h) { return h == nullptr || h == reinterpret_cast<CUstream>(1); }

// A call a stream capture forbids on the capturing thread (allocation, a synchronous copy, a
// synchronisation): it fails and invalidates the capture, as the driver does.
int forbidden_during_capture(const char* what) {
    if (captures_on_this_thread.empty()) return OK;
    fprintf(stderr, "cuda-emu: %s while this thread captures a stream: not permitted (the capture is invalidated)\n", what);
    for (Stream* st : captures_on_this_thread) st->capture->invalidated = true;
    return CAPTURE_UNSUPPORTED;
}

int copy_now(void* dst, const void* src, size_t bytes) {
    memmove(dst, src, bytes);
    return OK;
}

// Host memory a copy may read or write after the call returns (cuMemAllocHost's): copies with
// other (pageable) host memory are done with it when the call returns, as the driver's are.
bool is_pinned(const void* p, size_t bytes) {
    auto& pinned = state().pinned;
    auto it = pinned.upper_bound(reinterpret_cast<uintptr_t>(p));
    if (it == pinned.begin()) return false;
    --it;
    return reinterpret_cast<uintptr_t>(p) + bytes <= it->first + it->second;
}

// The work of a host-to-device copy: from pinned memory it reads the source when it runs; from
// pageable memory the driver takes the bytes before the call returns, so they are staged now.
std::function<int()> host_to_device(CUdeviceptr dst, const void* src, size_t bytes) {
    void* d = reinterpret_cast<void*>(dst);
    if (is_pinned(src, bytes)) return [=] { return copy_now(d, src, bytes); };
    const unsigned char* s = static_cast<const unsigned char*>(src);
    auto staged = std::make_shared<std::vector<unsigned char>>(s, s + bytes);
    return [=] { return copy_now(d, staged->data(), bytes); };
}

// Queues `work` on the legacy stream and runs the queues until it has run: a synchronous copy
// or memset (ordered with the legacy stream and the blocking ones, not with non-blocking ones).
int run_on_legacy_now(std::function<int()> work) {
    run_until(defer(nullptr, std::move(work)));
    return take_pending_error();
}

int device_attribute(int a) {
    static const int sms = [] {
        const char* v = getenv("ORT_EMU_SMS");
        return v ? atoi(v) : 132;
    }();
    switch (a) {
        case 1: return 1024;                    // max threads per block
        case 2: case 3: return 1024;            // max block dims x, y
        case 4: return 64;                      // max block dim z
        case 5: return 2147483647;              // max grid x
        case 6: case 7: return 65535;           // max grid y, z
        case 8: return 48 * 1024;               // shared memory per block
        case 9: return 64 * 1024;               // constant memory
        case 10: return 32;                     // warp size
        case 12: return 65536;                  // registers per block
        case 13: return 1980000;                // clock rate, kHz
        case 16: return sms;                    // multiprocessors
        case 36: return 2619000;                // memory clock, kHz
        case 37: return 5120;                   // memory bus width
        case 38: return 50 * 1024 * 1024;       // L2
        case 39: return 2048;                   // threads per multiprocessor
        case 41: return 1;                      // unified addressing
        case 75: return 9;                      // compute capability 9.0
        case 76: return 0;
        case 81: return 228 * 1024;             // shared memory per multiprocessor
        case 82: return 65536;                  // registers per multiprocessor
        case 97: return 227 * 1024;             // opt-in shared memory per block
        case 115: return 0;                     // no memory pools: plain allocations
        default: return 0;
    }
}

}  // namespace

std::string describe_address(uintptr_t addr) {
    State& s = state();
    char b[256];
    auto it = s.allocations.upper_bound(addr);
    if (it != s.allocations.begin()) {
        auto prev = std::prev(it);
        const uintptr_t start = prev->first, end = start + prev->second.bytes;
        if (addr >= end) {
            snprintf(b, sizeof b, "0x%lx: %lu bytes past the end of a %lu-byte allocation at 0x%lx", (unsigned long)addr,
                     (unsigned long)(addr - end), (unsigned long)prev->second.bytes, (unsigned long)start);
            return b;
        }
    }
    if (it != s.allocations.end()) {
        snprintf(b, sizeof b, "0x%lx: %lu bytes before a %lu-byte allocation at 0x%lx", (unsigned long)addr,
                 (unsigned long)(it->first - addr), (unsigned long)it->second.bytes, (unsigned long)it->first);
        return b;
    }
    snprintf(b, sizeof b, "0x%lx: in no allocation", (unsigned long)addr);
    return b;
}

int current_device() { return current_context()->device; }

int device_of(uintptr_t addr) {
    auto& allocs = state().allocations;
    auto it = allocs.upper_bound(addr);
    if (it == allocs.begin()) return -1;
    --it;
    return addr < it->first + it->second.bytes ? it->second.device : -1;
}

int foreign_pointer(const char* what, const void* p) {
    const int d = device_of(reinterpret_cast<uintptr_t>(p));
    if (d < 0 || d == current_device()) return 0;
    fprintf(stderr, "cuda-emu: %s reads or writes %p, memory of device %d, from a context of device %d (no peer access: a fault on a GPU)\n",
            what, p, d, current_device());
    return 1;
}

}  // namespace ort_emu

using namespace ort_emu;

#define EXPORT extern "C" __attribute__((visibility("default")))

// ---- initialisation, devices, contexts ---------------------------------------------------

EXPORT CUresult cuInit(unsigned) { return OK; }
EXPORT CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return OK;
}
EXPORT CUresult cuDeviceGetCount(int* n) {
    *n = device_count();
    return OK;
}
EXPORT CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (ordinal < 0 || ordinal >= device_count()) return INVALID_DEVICE;
    *d = ordinal;
    return OK;
}
EXPORT CUresult cuDeviceGetAttribute(int* v, int attribute, CUdevice) {
    *v = device_attribute(attribute);
    return OK;
}
EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice) {
    snprintf(name, (size_t)len, "ortrain cuda-emu (CPU emulation, not a GPU)");
    return OK;
}
EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice) {
    *bytes = (size_t)80 << 30;
    return OK;
}
EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    *free_bytes = (size_t)64 << 30;
    *total = (size_t)80 << 30;
    return OK;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(void** ctx, CUdevice d) {
    if (d < 0 || d >= device_count()) return INVALID_DEVICE;
    *ctx = &contexts[d];
    return OK;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return OK; }
EXPORT CUresult cuCtxSetCurrent(void* ctx) {
    Context* c = ctx ? as_context(ctx) : &contexts[0];
    if (!c) return INVALID_VALUE;
    if (context_stack.empty()) context_stack.push_back(c);
    else context_stack.back() = c;
    return OK;
}
EXPORT CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = current_context();
    return OK;
}
EXPORT CUresult cuCtxPushCurrent_v2(void* ctx) {
    Context* c = as_context(ctx);
    if (!c) return INVALID_VALUE;
    context_stack.push_back(c);
    return OK;
}
EXPORT CUresult cuCtxPopCurrent_v2(void** ctx) {
    if (ctx) *ctx = current_context();
    if (!context_stack.empty()) context_stack.pop_back();
    return OK;
}
EXPORT CUresult cuCtxGetDevice(CUdevice* d) {
    *d = current_context()->device;
    return OK;
}
EXPORT CUresult cuCtxSynchronize() {
    Lock lock;
    if (int e = forbidden_during_capture("cuCtxSynchronize")) return e;
    // a context-wide wait while another thread captures a stream fails and invalidates that
    // capture too, whatever its capture mode (seen on an H200, 2026-11-28)
    if (!captures_anywhere.empty()) {
        fprintf(stderr, "cuda-emu: cuCtxSynchronize while another thread captures a stream: not permitted (that capture is invalidated)\n");
        for (Stream* st : captures_anywhere) st->capture->invalidated = true;
        return CAPTURE_UNSUPPORTED;
    }
    run_all();
    return take_pending_error();
}
EXPORT CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return OK;
}

EXPORT CUresult cuGetErrorString(CUresult e, const char** s) {
    switch (e) {
        case OK: *s = "no error"; break;
        case INVALID_VALUE: *s = "invalid argument"; break;
        case OUT_OF_MEMORY: *s = "out of memory"; break;
        case INVALID_HANDLE: *s = "invalid resource handle"; break;
        case NOT_FOUND: *s = "named symbol not found"; break;
        case ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered (cuda-emu: see its message above)"; break;
        case LAUNCH_OUT_OF_RESOURCES: *s = "too many resources requested for launch"; break;
        case LAUNCH_FAILED: *s = "unspecified launch failure (cuda-emu: see its message above)"; break;
        case NOT_SUPPORTED: *s = "operation not supported (by cuda-emu)"; break;
        case CAPTURE_UNSUPPORTED: *s = "operation not permitted when stream is capturing"; break;
        case CAPTURE_INVALIDATED: *s = "operation failed due to a previous error during capture"; break;
        default: *s = "cuda-emu error"; break;
    }
    return OK;
}
EXPORT CUresult cuGetErrorName(CUresult e, const char** s) { return cuGetErrorString(e, s); }

// ---- memory ------------------------------------------------------------------------------

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    Lock lock;
    if (int e = forbidden_during_capture("cuMemAlloc")) return e;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t rounded = (bytes + 255) & ~(size_t)255;
    const size_t body = (rounded + page - 1) / page * page;
    const size_t map_bytes = body + page;
    void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return OUT_OF_MEMORY;
    char* guard = static_cast<char*>(m) + body;
    mprotect(guard, page, PROT_NONE);
    char* start = guard - rounded;  // 256-byte aligned, ending at the guard page
    memset(start, 0xff, rounded);
    state().allocations[reinterpret_cast<uintptr_t>(start)] = Allocation{m, map_bytes, bytes, current_context()->device};
    *p = reinterpret_cast<CUdeviceptr>(start);
    return OK;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    Lock lock;
    if (p == 0) return OK;
    if (int e = forbidden_during_capture("cuMemFree")) return e;
    run_all();  // cuMemFree waits for the work queued on the device, as the driver's does
    auto& allocs = state().allocations;
    auto it = allocs.find((uintptr_t)p);
    if (it == allocs.end()) return INVALID_VALUE;
    munmap(it->second.map, it->second.map_bytes);  // a later read of it faults
    allocs.erase(it);
    return OK;
}

EXPORT CUresult cuMemAllocHost_v2(void** p, size_t bytes) {
    Lock lock;
    *p = aligned_alloc(4096, (bytes + 4095) & ~(size_t)4095);
    if (!*p) return OUT_OF_MEMORY;
    state().pinned[reinterpret_cast<uintptr_t>(*p)] = bytes;
    return OK;
}
EXPORT CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) { return cuMemAllocHost_v2(p, bytes); }
EXPORT CUresult cuMemFreeHost(void* p) {
    Lock lock;
    run_all();  // a queued copy may still use it
    state().pinned.erase(reinterpret_cast<uintptr_t>(p));
    free(p);
    return OK;
}

// The "synchronous" copies and memsets go on the legacy stream: after the work queued before on
// it and on the blocking streams, not on non-blocking ones. What they leave running when they
// return is what the driver's may leave (its "API synchronization behavior" page): a copy from
// pageable host memory returns once the bytes are staged, a device-to-device copy and a memset
// of device memory do not wait at all; a copy to the host returns when it is done.
EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t bytes) {
    Lock lock;
    if (int e = forbidden_during_capture("cuMemcpyHtoD (synchronous)")) return e;
    if (is_pinned(src, bytes)) return run_on_legacy_now(host_to_device(dst, src, bytes));
    return enqueue(nullptr, host_to_device(dst, src, bytes));
}
EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t bytes) {
    Lock lock;
    if (int e = forbidden_during_capture("cuMemcpyDtoH (synchronous)")) return e;
    return run_on_legacy_now([=] { return copy_now(dst, reinterpret_cast<const void*>(src), bytes); });
}
EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
    Lock lock;
    if (int e = forbidden_during_capture("cuMemcpyDtoD (synchronous)")) return e;
    return enqueue(nullptr, [=] { return copy_now(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes); });
}
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, CUstream s) {
    Lock lock;
    return enqueue(s, host_to_device(dst, src, bytes));
}
// Into pageable host memory the call returns when the copy is done; into pinned memory the
// bytes arrive when the copy runs (after a synchronisation).
EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, CUstream s) {
    Lock lock;
    if (!stream_of(s)) return INVALID_HANDLE;
    auto done = defer(s, [=] { return copy_now(dst, reinterpret_cast<const void*>(src), bytes); });
    if (!is_pinned(dst, bytes) && !stream_of(s)->capture) run_until(done);
    return OK;
}
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s) {
    Lock lock;
    return enqueue(s, [=] { return copy_now(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes); });
}
EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    Lock lock;
    if (int e = forbidden_during_capture("cuMemsetD8 (synchronous)")) return e;
    return enqueue(nullptr, [=] {
        memset(reinterpret_cast<void*>(dst), v, n);
        return OK;
    });
}
EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s) {
    Lock lock;
    return enqueue(s, [=] {
        memset(reinterpret_cast<void*>(dst), v, n);
        return OK;
    });
}
EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, CUstream s) {
    Lock lock;
    return enqueue(s, [=] {
        unsigned* p = reinterpret_cast<unsigned*>(dst);
        for (size_t i = 0; i < n; ++i) p[i] = v;
        return OK;
    });
}
EXPORT CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned v, size_t n) {
    Lock lock;
    if (int e = forbidden_during_capture("cuMemsetD32 (synchronous)")) return e;
    return enqueue(nullptr, [=] {
        unsigned* p = reinterpret_cast<unsigned*>(dst);
        for (size_t i = 0; i < n; ++i) p[i] = v;
        return OK;
    });
}

// ---- streams and events ------------------------------------------------------------------

EXPORT CUresult cuStreamCreate(CUstream* s, unsigned flags) {
    Lock lock;
    *s = new_stream(flags);
    return OK;
}
EXPORT CUresult cuStreamCreateWithPriority(CUstream* s, unsigned flags, int) { return cuStreamCreate(s, flags); }
EXPORT CUresult cuStreamDestroy_v2(CUstream s) {
    Lock lock;
    if (is_legacy(s) || s == reinterpret_cast<CUstream>(2)) return OK;
    Stream* st = stream_of(s);
    if (!st) return INVALID_HANDLE;
    std::erase(captures_on_this_thread, st);
    std::erase(captures_anywhere, st);
    destroy_stream(st);
    return OK;
}
EXPORT CUresult cuStreamSynchronize(CUstream s) {
    Lock lock;
    Stream* st = stream_of(s);
    if (!st) return INVALID_HANDLE;
    if (st->capture) {
        st->capture->invalidated = true;
        fprintf(stderr, "cuda-emu: cuStreamSynchronize on a stream being captured: not permitted (the capture is invalidated)\n");
        return CAPTURE_UNSUPPORTED;
    }
    if (int e = forbidden_during_capture("cuStreamSynchronize")) return e;
    run_stream(st);
    return take_pending_error();
}
EXPORT CUresult cuStreamQuery(CUstream s) {
    Lock lock;
    Stream* st = stream_of(s);
    if (!st) return INVALID_HANDLE;
    if (!st->queue.empty()) {
        run_stream(st);  // as if the device had been at it meanwhile; the caller asks again
        return NOT_READY;
    }
    return take_pending_error();
}
EXPORT CUresult cuStreamWaitEvent(CUstream s, void* e, unsigned) {
    Lock lock;
    if (!stream_of(s) || !e) return INVALID_HANDLE;
    defer_wait(s, static_cast<Event*>(e));
    return OK;
}
EXPORT CUresult cuStreamIsCapturing(CUstream s, int* status) {
    Lock lock;
    Stream* st = stream_of(s);
    if (!st) return INVALID_HANDLE;
    *status = st->capture ? (st->capture->invalidated ? 2 : 1) : 0;
    return OK;
}

EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, int /*mode*/) {
    Lock lock;
    if (is_legacy(s)) return CAPTURE_UNSUPPORTED;  // the legacy stream cannot be captured
    Stream* st = stream_of(s);
    if (!st) return INVALID_HANDLE;
    if (st->capture) return CAPTURE_UNSUPPORTED;
    st->capture.reset(new Capture());
    st->capture->thread = this_thread();
    captures_on_this_thread.push_back(st);
    captures_anywhere.push_back(st);
    return OK;
}

EXPORT CUresult cuStreamEndCapture(CUstream s, void** graph) {
    Lock lock;
    Stream* st = stream_of(s);
    if (!st) return INVALID_HANDLE;
    if (!st->capture) return INVALID_VALUE;
    if (st->capture->thread != this_thread()) return CAPTURE_WRONG_THREAD;
    std::unique_ptr<Capture> c = std::move(st->capture);
    std::erase(captures_on_this_thread, st);
    std::erase(captures_anywhere, st);
    if (c->invalidated) {
        *graph = nullptr;
        return CAPTURE_INVALIDATED;
    }
    Graph* g = new Graph();
    g->work = std::make_shared<const std::vector<std::function<int()>>>(std::move(c->work));
    *graph = g;
    return OK;
}

EXPORT CUresult cuGraphGetNodes(void* graph, void** nodes, size_t* count) {
    Graph* g = static_cast<Graph*>(graph);
    if (!g) return INVALID_VALUE;
    if (nodes)
        for (size_t i = 0; i < *count && i < g->work->size(); ++i) nodes[i] = const_cast<std::function<int()>*>(&(*g->work)[i]);
    *count = g->work->size();
    return OK;
}
EXPORT CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    Graph* g = static_cast<Graph*>(graph);
    if (!g) return INVALID_VALUE;
    *exec = new Graph(*g);
    return OK;
}
EXPORT CUresult cuGraphUpload(void*, CUstream) { return OK; }
EXPORT CUresult cuGraphLaunch(void* exec, CUstream s) {
    Lock lock;
    Graph* g = static_cast<Graph*>(exec);
    if (!g) return INVALID_VALUE;
    return enqueue(s, [work = g->work] {
        for (auto& w : *work)
            if (int e = w()) return e;
        return OK;
    });
}
EXPORT CUresult cuGraphExecDestroy(void* exec) {
    delete static_cast<Graph*>(exec);
    return OK;
}
EXPORT CUresult cuGraphDestroy(void* graph) {
    delete static_cast<Graph*>(graph);
    return OK;
}

EXPORT CUresult cuEventCreate(void** e, unsigned flags) {
    Event* ev = new Event();
    ev->timing = (flags & 2) == 0;  // CU_EVENT_DISABLE_TIMING
    *e = ev;
    return OK;
}
EXPORT CUresult cuEventDestroy_v2(void* e) {
    Lock lock;
    // a record or a wait still queued holds the record's completion, not the event
    delete static_cast<Event*>(e);
    return OK;
}
EXPORT CUresult cuEventRecord(void* e, CUstream s) {
    Lock lock;
    if (!stream_of(s) || !e) return INVALID_HANDLE;
    defer_record(s, static_cast<Event*>(e));
    return OK;
}
EXPORT CUresult cuEventRecordWithFlags(void* e, CUstream s, unsigned) { return cuEventRecord(e, s); }
// The first query of a record that has not run answers "not ready" without running anything
// (work on a GPU takes time), so callers' not-ready paths run too; the next runs the queues
// up to it.
EXPORT CUresult cuEventQuery(void* e) {
    Lock lock;
    Event* ev = static_cast<Event*>(e);
    if (ev->last && !ev->last->done) {
        if (!ev->answered_not_ready) {
            ev->answered_not_ready = true;
            return NOT_READY;
        }
        run_until(ev->last);  // a copy: the event may be recorded again or destroyed meanwhile
    }
    return take_pending_error();
}
EXPORT CUresult cuEventSynchronize(void* e) {
    Lock lock;
    run_until(static_cast<Event*>(e)->last);
    return take_pending_error();
}
EXPORT CUresult cuEventElapsedTime(float* ms, void* start, void* end) {
    Lock lock;
    Event *a = static_cast<Event*>(start), *b = static_cast<Event*>(end);
    if (!a->timing || !b->timing || !a->last || !b->last) return INVALID_HANDLE;
    if (!a->last->done || !b->last->done) return NOT_READY;
    *ms = (float)((b->last->seconds - a->last->seconds) * 1e3);
    return OK;
}
EXPORT CUresult cuEventElapsedTime_v2(float* ms, void* start, void* end) { return cuEventElapsedTime(ms, start, end); }

// ---- modules and launches ----------------------------------------------------------------

EXPORT CUresult cuModuleLoadData(void** module, const void* image) {
    Lock lock;
    if (!image) return INVALID_VALUE;
    read_cubin(image);  // what the GPU would take from it: registers, static shared memory
    *module = &module_marker;  // the kernels that run are the ones compiled into this library
    return OK;
}
EXPORT CUresult cuModuleLoadDataEx(void** module, const void* image, unsigned, void*, void*) { return cuModuleLoadData(module, image); }
EXPORT CUresult cuModuleUnload(void*) { return OK; }
EXPORT CUresult cuModuleGetFunction(void** f, void*, const char* name) {
    const Kernel* k = find_kernel(name);
    if (!k) return NOT_FOUND;
    *f = const_cast<Kernel*>(k);
    return OK;
}

EXPORT CUresult cuFuncSetAttribute(void* f, int attribute, int value) {
    Lock lock;
    if (attribute == 8) {  // max dynamic shared memory
        if (value < 0 || value > device_attribute(97)) return INVALID_VALUE;
        state().max_dynamic_shared[static_cast<Kernel*>(f)] = value;
    }
    return OK;
}
EXPORT CUresult cuFuncGetAttribute(int* v, int attribute, void* f) {
    Lock lock;
    const Kernel* k = static_cast<const Kernel*>(f);
    const CompiledKernel* c = compiled_kernel(k->name);
    switch (attribute) {
        case 0: {  // max threads per block: the launch bounds, and what the register file holds
            int most = k->max_threads > 0 ? k->max_threads : 1024;
            while (c && c->registers > 0 && most > 32 && registers_for_block(c->registers, (size_t)most) > device_attribute(12)) most -= 32;
            *v = most;
            break;
        }
        case 1: *v = c ? (int)c->static_shared : 0; break;
        case 4: *v = c && c->registers > 0 ? c->registers : 32; break;
        case 8: {
            auto& m = state().max_dynamic_shared;
            auto it = m.find(static_cast<Kernel*>(f));
            *v = it == m.end() ? 48 * 1024 : it->second;
            break;
        }
        default: *v = 0;
    }
    return OK;
}

EXPORT CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared,
                               CUstream s, void** params, void** extra) {
    Lock lock;
    const Kernel* k = static_cast<const Kernel*>(f);
    if (!k || extra) return INVALID_VALUE;
    const size_t threads = (size_t)bx * by * bz;
    if (threads == 0 || threads > 1024 || bx > 1024 || by > 1024 || bz > 64 || gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535 ||
        gx > 2147483647u)
        return INVALID_VALUE;
    int limit = 48 * 1024;
    auto it = state().max_dynamic_shared.find(k);
    if (it != state().max_dynamic_shared.end()) limit = it->second;
    if (k->max_threads > 0 && threads > (size_t)k->max_threads) {
        fprintf(stderr, "cuda-emu: kernel %s launched with %zu threads a block, over its __launch_bounds__ of %d\n", k->name, threads,
                k->max_threads);
        return LAUNCH_OUT_OF_RESOURCES;
    }
    if ((int)shared > limit) {
        fprintf(stderr, "cuda-emu: kernel %s launched with %u bytes of dynamic shared memory, over its limit of %d\n", k->name, shared, limit);
        return INVALID_VALUE;
    }
    // what NVRTC's CUBIN of the kernel says: its registers for the whole block must fit the
    // register file, its static shared memory beside the dynamic one in a block's maximum
    if (const CompiledKernel* c = compiled_kernel(k->name)) {
        const int need = c->registers > 0 ? registers_for_block(c->registers, threads) : 0;
        if (need > device_attribute(12)) {
            fprintf(stderr, "cuda-emu: kernel %s launched with %zu threads a block at %d registers each (its CUBIN): %d registers, over the %d a block has\n",
                    k->name, threads, c->registers, need, device_attribute(12));
            return LAUNCH_OUT_OF_RESOURCES;
        }
        // 48 KiB in all unless cuFuncSetAttribute opted the kernel into more
        const size_t most = it != state().max_dynamic_shared.end() ? (size_t)device_attribute(97) : 48 * 1024;
        if (c->static_shared + shared > most) {
            fprintf(stderr, "cuda-emu: kernel %s: %zu bytes of static and %u of dynamic shared memory, over the %zu a block may have\n",
                    k->name, c->static_shared, shared, most);
            return INVALID_VALUE;
        }
    }
    // the parameters are copied now (the caller's may be gone when a captured graph runs)
    auto copies = std::make_shared<std::vector<std::vector<unsigned char>>>();
    for (int i = 0; i < k->param_count; ++i) {
        const unsigned char* p = static_cast<const unsigned char*>(params[i]);
        copies->emplace_back(p, p + k->param_sizes[i]);
        void* as_pointer = nullptr;
        if (k->param_sizes[i] == sizeof as_pointer) memcpy(&as_pointer, p, sizeof as_pointer);
        if (as_pointer && foreign_pointer(k->name, as_pointer)) return ILLEGAL_ADDRESS;
    }
    if (!is_legacy(s) && s != reinterpret_cast<CUstream>(2)) {
        const Stream* st = stream_of(s);
        if (st && st->device != current_device()) {
            fprintf(stderr, "cuda-emu: kernel %s launched on a stream of device %d from a context of device %d\n", k->name, st->device,
                    current_device());
            return INVALID_HANDLE;
        }
    }
    const Dim grid{gx, gy, gz}, block{bx, by, bz};
    return enqueue(s, [k, grid, block, shared, copies] {
        std::vector<void*> ptrs;
        for (auto& c : *copies) ptrs.push_back(c.data());
        // a fault shows at the next synchronising call of the thread that queued it
        return run_kernel(*k, grid, block, shared, ptrs.data());
    });
}

EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* n, void*, int block, size_t) {
    *n = block > 0 ? 2048 / block : 0;
    return OK;
}

// The driver's private tables (NVRTC asks for them when libcuda is loaded): there are none here.
EXPORT CUresult cuGetExportTable(const void** table, const void*) {
    *table = nullptr;
    return NOT_FOUND;
}
