// ortrain CUDA emulator: runs a kernel launch on the CPU. Every CUDA thread of a block is a fiber
// with its own stack; the scheduler runs the ready fibers one at a time, each until it reaches a
// collective operation (a block barrier, a warp shuffle, an mma.sync, an ldmatrix) or returns, in an order
// shuffled at every phase, so that a missing barrier shows up as a wrong result rather than
// hiding behind a lucky order. A collective completes when every live thread it involves has
// arrived; if none can complete, the launch fails as a deadlock (threads at different barriers).
// A fault (a read or write of memory no allocation owns: allocations end at a guard page, see
// driver.cpp) or an integer division by zero ends the launch with an error naming the kernel.
#include <dlfcn.h>
#include <signal.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <pthread.h>
#include <unistd.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "emu.h"
#include "emu_runtime.h"

dim3 threadIdx, blockIdx, blockDim, gridDim;

// Saves the callee-saved registers and the FP control words on the current stack, stores the
// stack pointer in *save and continues on the stack `next` (System V x86-64).
extern "C" void ort_emu_switch(void** save, void* next);
asm(R"(
    .text
    .globl ort_emu_switch
    .type ort_emu_switch, @function
ort_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size ort_emu_switch, .-ort_emu_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");

namespace ort_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kDynamicSharedBytes = 256 * 1024;

enum class State { Ready, AtBarrier, AtWarpOp, Done };
enum class WarpOp { None, Shuffle, Ballot, Mma, Ldmatrix };

// A cp.async copy a thread issued and that has not landed yet (ort_emu_cp_async_commit says when
// it lands).
struct AsyncCopy {
    void* dst;
    const void* src;
    int bytes, src_bytes;  // bytes past src_bytes are zero-filled
    int64_t group;         // -1 until committed
};

struct Fiber {
    void* sp = nullptr;
    char* stack = nullptr;  // kStackBytes, with a guard page below
    State state = State::Done;
    // block barrier: this thread's predicate, then the count of arrived threads whose predicate
    // held (pred) and of arrived threads (arrived), for __syncthreads_and/_or/_count
    int pred = 0;
    int arrived = 0;
    // warp operations: what this lane brings and what it gets back
    WarpOp op = WarpOp::None;
    unsigned mask = 0;
    int lane_mask = 0;
    uint64_t value = 0;
    float c[4];
    uint32_t a[4], b[2];
    int mma_f16 = 0;  // mma: operands f16 (1) or bf16 (0)
    // ldmatrix: the row this lane names, whether transposed, and the four registers it gets
    const unsigned char* row = nullptr;
    int trans = 0;
    uint32_t r[4];
    // cp.async: copies not yet performed, and the groups committed so far
    std::vector<AsyncCopy> copies;
    int64_t committed = 0;
};

struct Scheduler {
    std::vector<Fiber> fibers;
    void* scheduler_sp = nullptr;
    int current = -1;
    int threads = 0;
    const Kernel* kernel = nullptr;
    void** params = nullptr;
    // the launch's dynamic shared memory ends at an inaccessible page (shared_end), so a block
    // that reads or writes past the bytes its launch asked for faults as on a GPU
    unsigned char* dynamic_shared = nullptr;
    unsigned char* shared_end = nullptr;
    size_t dynamic_bytes = 0;
    // static __shared__ arrays: the block each was last poisoned in (ort_emu_fresh_shared)
    uint64_t block_epoch = 0;
    std::map<void*, uint64_t> shared_epoch;
    pthread_t kernel_thread;
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    std::string error;
    sigjmp_buf fault_jump;
    volatile sig_atomic_t in_kernel = 0;
    volatile uintptr_t fault_addr = 0;
    volatile int fault_signal = 0;
};

Scheduler* sched() {
    static Scheduler* s = new Scheduler();
    return s;
}

// A first-come, first-served lock: threads calling in at once take turns call by call, as
// their work can interleave on a GPU, instead of one running ahead (std::mutex is not fair).
struct TicketLock {
    std::mutex m;
    std::condition_variable turn;
    uint64_t next = 0, serving = 0;
};

TicketLock& big_lock() {
    static TicketLock* l = new TicketLock();
    return *l;
}

uint64_t next_random(Scheduler& s) { return xorshift(s.rng); }

uint64_t gcd(uint64_t a, uint64_t b) { return b == 0 ? a : gcd(b, a % b); }

// A step through 0..n that visits every index once: a random stride coprime with n.
uint64_t pick_coprime(Scheduler& s, uint64_t n) {
    for (;;) {
        const uint64_t c = 1 + next_random(s) % (n - 1 > 0 ? n - 1 : 1);
        if (gcd(c, n) == 1) return c;
    }
}

void set_thread_index(int t) {
    threadIdx.x = t % blockDim.x;
    threadIdx.y = (t / blockDim.x) % blockDim.y;
    threadIdx.z = t / (blockDim.x * blockDim.y);
}

// Back to the scheduler from the running fiber.
void yield_to_scheduler() {
    Scheduler& s = *sched();
    Fiber& f = s.fibers[s.current];
    ort_emu_switch(&f.sp, s.scheduler_sp);
}

// Lands (in issue order) this fiber's copies that `due` picks; the others stay queued.
template <typename Due> void land_where(Fiber& f, Due due) {
    std::vector<AsyncCopy> left;
    for (const AsyncCopy& c : f.copies) {
        if (!due(c)) {
            left.push_back(c);
            continue;
        }
        memcpy(c.dst, c.src, (size_t)c.src_bytes);
        memset(static_cast<unsigned char*>(c.dst) + c.src_bytes, 0, (size_t)(c.bytes - c.src_bytes));
    }
    f.copies.swap(left);
}

// Lands this fiber's copies of groups older than its `keep` newest committed ones (all,
// uncommitted too, with keep < 0).
void perform_copies(Fiber& f, int64_t keep) {
    land_where(f, [&](const AsyncCopy& c) { return keep < 0 || (c.group >= 0 && c.group < f.committed - keep); });
}

extern "C" void fiber_entry() {
    Scheduler& s = *sched();
    s.kernel->invoke(s.params);
    perform_copies(s.fibers[s.current], -1);  // a GPU completes them after the thread exits too
    s.fibers[s.current].state = State::Done;
    Fiber& f = s.fibers[s.current];
    ort_emu_switch(&f.sp, s.scheduler_sp);
    abort();  // a finished fiber is never resumed
}

void prepare_fiber(Fiber& f) {
    if (!f.stack) {
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        void* m = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) {
            fprintf(stderr, "cuda-emu: out of memory for fiber stacks\n");
            abort();
        }
        mprotect(m, page, PROT_NONE);  // a stack overflow faults instead of corrupting
        f.stack = static_cast<char*>(m) + page;
    }
    uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + kStackBytes) & ~(uintptr_t)15;
    uint64_t* slot = reinterpret_cast<uint64_t*>(top - 16);  // fiber_entry's return address slot
    slot[0] = reinterpret_cast<uint64_t>(&fiber_entry);
    slot[1] = 0;
    uint64_t* regs = slot - 6;  // r15, r14, r13, r12, rbx, rbp
    for (int i = 0; i < 6; ++i) regs[i] = 0;
    uint32_t* control = reinterpret_cast<uint32_t*>(regs - 1);
    control[0] = 0x1F80;  // MXCSR: round to nearest, exceptions masked
    control[1] = 0x037F;  // x87 control word
    f.sp = regs - 1;
    f.state = State::Ready;
    f.op = WarpOp::None;
    f.copies.clear();
    f.committed = 0;
}

uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // NaN, as cvt.rn.bf16.f32
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float bf16_value(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Hands each lane waiting at `op` its result[lane] as its value and lets it run on.
void release_lanes(Scheduler& s, int warp_base, int lanes, WarpOp op, const uint64_t* result) {
    for (int l = 0; l < lanes; ++l) {
        Fiber& f = s.fibers[warp_base + l];
        if (f.op != op) continue;
        f.value = result[l];
        f.op = WarpOp::None;
        f.state = State::Ready;
    }
}

void complete_shuffle(Scheduler& s, int warp_base, int lanes) {
    uint64_t result[32];
    for (int l = 0; l < lanes; ++l) {
        const Fiber& f = s.fibers[warp_base + l];
        if (f.op != WarpOp::Shuffle) continue;
        const int src = l ^ (f.lane_mask & 31);  // PTX uses the low 5 bits
        result[l] = (src < lanes && s.fibers[warp_base + src].op == WarpOp::Shuffle) ? s.fibers[warp_base + src].value : f.value;
    }
    release_lanes(s, warp_base, lanes, WarpOp::Shuffle, result);
}

// __ballot_sync: each lane gets the predicates (its `value`) of the lanes its mask names, lane l
// at bit l.
void complete_ballot(Scheduler& s, int warp_base, int lanes) {
    uint64_t result[32];
    for (int l = 0; l < lanes; ++l) {
        const Fiber& f = s.fibers[warp_base + l];
        if (f.op != WarpOp::Ballot) continue;
        uint32_t bits = 0;
        for (int src = 0; src < lanes; ++src) {
            const Fiber& from = s.fibers[warp_base + src];
            if ((f.mask >> src & 1u) && from.op == WarpOp::Ballot && from.value) bits |= 1u << src;
        }
        result[l] = bits;
    }
    release_lanes(s, warp_base, lanes, WarpOp::Ballot, result);
}

std::string block_name();

// mma.m16n8k16.row.col bf16 or f16 -> f32, with the PTX ISA's fragment layout (g = lane / 4,
// q = lane % 4): A rows g and g + 8 at k = 2q, 2q + 1, 2q + 8, 2q + 9; B column g at the same k;
// C rows g and g + 8 at columns 2q, 2q + 1. Products are summed exactly in double, then rounded
// once (the hardware's order is unspecified; its error is within a few f32 ulps of this). False
// (with s.error) where the lanes disagree on the operand type.
bool complete_mma(Scheduler& s, int warp_base) {
    const int f16 = s.fibers[warp_base].mma_f16;
    float A[16][16], B[16][8], C[16][8];
    for (int lane = 0; lane < 32; ++lane) {
        const Fiber& f = s.fibers[warp_base + lane];
        if (f.mma_f16 != f16) {
            s.error = "mma: lane " + std::to_string(lane) + " of warp " + std::to_string(warp_base / 32) +
                      " differs from lane 0 in the operand type (bf16 or f16) in " + block_name();
            return false;
        }
        const auto value = [f16](uint32_t half) { return f16 ? ort_emu_f16_to_f32((uint16_t)half) : bf16_value((uint16_t)half); };
        const int g = lane / 4, q = lane % 4;
        const int rows[4] = {g, g + 8, g, g + 8}, ks[4] = {2 * q, 2 * q, 2 * q + 8, 2 * q + 8};
        for (int r = 0; r < 4; ++r) {
            A[rows[r]][ks[r]] = value(f.a[r] & 0xffff);
            A[rows[r]][ks[r] + 1] = value(f.a[r] >> 16);
        }
        for (int r = 0; r < 2; ++r) {
            B[2 * q + 8 * r][g] = value(f.b[r] & 0xffff);
            B[2 * q + 8 * r + 1][g] = value(f.b[r] >> 16);
        }
        C[g][2 * q] = f.c[0];
        C[g][2 * q + 1] = f.c[1];
        C[g + 8][2 * q] = f.c[2];
        C[g + 8][2 * q + 1] = f.c[3];
    }
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 8; ++j) {
            double acc = C[i][j];
            for (int k = 0; k < 16; ++k) acc += (double)A[i][k] * (double)B[k][j];
            C[i][j] = (float)acc;
        }
    for (int lane = 0; lane < 32; ++lane) {
        Fiber& f = s.fibers[warp_base + lane];
        const int g = lane / 4, q = lane % 4;
        f.c[0] = C[g][2 * q];
        f.c[1] = C[g][2 * q + 1];
        f.c[2] = C[g + 8][2 * q];
        f.c[3] = C[g + 8][2 * q + 1];
        f.op = WarpOp::None;
        f.state = State::Ready;
    }
    return true;
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i..8i + 7 name the rows (16 bytes
// each) of matrix i; lane l gets, of each matrix i, row l / 4 at columns 2(l % 4), 2(l % 4) + 1
// (register i), or with .trans column l / 4 at rows 2(l % 4), 2(l % 4) + 1. False (with
// s.error) where a row address is not 16-byte aligned, as the PTX ISA requires.
bool complete_ldmatrix(Scheduler& s, int warp_base) {
    const int trans = s.fibers[warp_base].trans;
    for (int lane = 0; lane < 32; ++lane) {
        const Fiber& f = s.fibers[warp_base + lane];
        if ((reinterpret_cast<uintptr_t>(f.row) & 15u) != 0 || f.trans != trans) {
            s.error = "ldmatrix: lane " + std::to_string(lane) + " of warp " + std::to_string(warp_base / 32) +
                      (f.trans != trans ? " differs from lane 0 in .trans" : " names a row address that is not 16-byte aligned") +
                      " in " + block_name();
            return false;
        }
    }
    uint32_t got[32][4];
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, q = lane % 4;
        for (int i = 0; i < 4; ++i) {
            if (!trans) {
                memcpy(&got[lane][i], s.fibers[warp_base + 8 * i + g].row + 4 * q, 4);
            } else {
                uint16_t lo, hi;
                memcpy(&lo, s.fibers[warp_base + 8 * i + 2 * q].row + 2 * g, 2);
                memcpy(&hi, s.fibers[warp_base + 8 * i + 2 * q + 1].row + 2 * g, 2);
                got[lane][i] = (uint32_t)lo | ((uint32_t)hi << 16);
            }
        }
    }
    for (int lane = 0; lane < 32; ++lane) {
        Fiber& f = s.fibers[warp_base + lane];
        memcpy(f.r, got[lane], sizeof f.r);
        f.op = WarpOp::None;
        f.state = State::Ready;
    }
    return true;
}

std::string block_name() {
    char b[128];
    snprintf(b, sizeof b, "block (%u, %u, %u) of a (%u, %u, %u) grid of (%u, %u, %u) threads", blockIdx.x, blockIdx.y, blockIdx.z,
             gridDim.x, gridDim.y, gridDim.z, blockDim.x, blockDim.y, blockDim.z);
    return b;
}

// Completes the warp operations (shuffle, ballot, mma, ldmatrix) every lane of their warp has reached:
// how many, or -1 on an error (s.error says which).
int complete_warp_ops(Scheduler& s) {
    int released = 0;
    // warps: a shuffle or an mma completes when every lane it names has arrived
    for (int base = 0; base < s.threads; base += 32) {
        const int lanes = s.threads - base < 32 ? s.threads - base : 32;
        WarpOp op = WarpOp::None;
        unsigned mask = 0;
        for (int l = 0; l < lanes; ++l) {
            const Fiber& f = s.fibers[base + l];
            if (f.state == State::AtWarpOp) {
                op = f.op;
                mask = f.mask;
            }
        }
        if (op == WarpOp::None) continue;
        bool complete = true;
        for (int l = 0; l < 32; ++l) {
            if (!(mask >> l & 1u)) continue;
            if (l >= lanes) {
                s.error = "a warp-collective operation names lane " + std::to_string(l) + " of a partial warp (" +
                          std::to_string(lanes) + " lanes) in " + block_name();
                return -1;
            }
            const Fiber& f = s.fibers[base + l];
            if (f.state == State::Done) {
                s.error = "lane " + std::to_string(l) + " of warp " + std::to_string(base / 32) +
                          " returned before a warp-collective operation its warp waits at, in " + block_name();
                return -1;
            }
            if (f.state != State::AtWarpOp) complete = false;
            else if (f.op != op) {
                s.error = "lanes of warp " + std::to_string(base / 32) + " wait at different warp operations in " + block_name();
                return -1;
            }
        }
        if (!complete) continue;
        if (op == WarpOp::Shuffle) complete_shuffle(s, base, lanes);
        else if (op == WarpOp::Ballot) complete_ballot(s, base, lanes);
        else if (op == WarpOp::Mma) {
            if (!complete_mma(s, base)) return -1;
        }
        else if (lanes < 32) {
            s.error = "ldmatrix in a partial warp (" + std::to_string(lanes) + " lanes) in " + block_name();
            return -1;
        } else if (!complete_ldmatrix(s, base)) return -1;
        ++released;
    }
    return released;
}

// Completes whatever collective operations every involved thread has reached. False when
// nothing could complete although some threads still wait: a deadlock (with s.error set).
bool complete_collectives(Scheduler& s) {
    int live = 0, at_barrier = 0, waiting = 0;
    for (int t = 0; t < s.threads; ++t) {
        const State st = s.fibers[t].state;
        if (st != State::Done) ++live;
        if (st == State::AtBarrier) ++at_barrier;
        if (st == State::AtBarrier || st == State::AtWarpOp) ++waiting;
    }
    const int warp_ops = complete_warp_ops(s);
    if (warp_ops < 0) return false;
    bool released = warp_ops > 0;
    if (!released && at_barrier > 0 && at_barrier == live) {
        int count = 0;
        for (int t = 0; t < s.threads; ++t)
            if (s.fibers[t].state == State::AtBarrier) count += s.fibers[t].pred;
        for (int t = 0; t < s.threads; ++t)
            if (s.fibers[t].state == State::AtBarrier) {
                s.fibers[t].pred = count;
                s.fibers[t].arrived = at_barrier;
                s.fibers[t].state = State::Ready;
            }
        released = true;
    }
    if (!released && waiting > 0) {
        s.error = std::to_string(at_barrier) + " threads wait at __syncthreads while " + std::to_string(waiting - at_barrier) +
                  " wait at a warp operation (of " + std::to_string(live) + " live) in " + block_name() +
                  ": a barrier inside divergent code";
        return false;
    }
    return true;
}

// Runs one block to its end. False on a deadlock (s.error says which).
bool run_block(Scheduler& s) {
    memset(s.dynamic_shared, 0xff, s.shared_end - s.dynamic_shared);  // shared memory starts as garbage on a GPU
    ++s.block_epoch;
    for (int t = 0; t < s.threads; ++t) prepare_fiber(s.fibers[t]);
    std::vector<int> order(s.threads);
    // one warp of the block lags: it runs only when no other thread can, so the others get as far
    // ahead as their barriers let them (a warp reading a buffer the others refill too early reads
    // the new data)
    const int warps = (s.threads + 31) / 32;
    const int lagging = shuffled_order() && warps > 1 ? (int)(next_random(s) % (uint64_t)warps) : -1;
    for (;;) {
        int ready = 0;
        for (int t = 0; t < s.threads; ++t)
            if (s.fibers[t].state == State::Ready && t / 32 != lagging) order[ready++] = t;
        if (ready == 0 && lagging >= 0) {
            // the others' warp operations first; the lagging warp only when they wait at a barrier
            const int released = complete_warp_ops(s);
            if (released < 0) return false;
            if (released > 0) continue;
            for (int t = 32 * lagging; t < s.threads && t < 32 * lagging + 32; ++t)
                if (s.fibers[t].state == State::Ready) order[ready++] = t;
        }
        if (ready == 0) {
            bool all_done = true;
            for (int t = 0; t < s.threads; ++t) all_done &= s.fibers[t].state == State::Done;
            if (all_done) return true;
            if (!complete_collectives(s)) return false;
            continue;
        }
        if (shuffled_order())
            for (int i = ready - 1; i > 0; --i) {
                const int j = (int)(next_random(s) % (uint64_t)(i + 1));
                std::swap(order[i], order[j]);
            }
        for (int i = 0; i < ready; ++i) {
            const int t = order[i];
            s.current = t;
            set_thread_index(t);
            ort_emu_switch(&s.scheduler_sp, s.fibers[t].sp);
        }
        s.current = -1;
    }
}

// where a trapping instruction is, for `addr2line -e target/cuda-emu/libortemu.so <offset>`
std::string code_address(uintptr_t pc) {
    Dl_info info;
    char text[256];
    if (dladdr(reinterpret_cast<void*>(pc), &info) && info.dli_fname) {
        snprintf(text, sizeof text, "%s+0x%lx", info.dli_fname, (unsigned long)(pc - reinterpret_cast<uintptr_t>(info.dli_fbase)));
    } else {
        snprintf(text, sizeof text, "code address 0x%lx", (unsigned long)pc);
    }
    return text;
}

struct sigaction previous_segv, previous_bus, previous_fpe, previous_ill;

void on_fault(int sig, siginfo_t* info, void* ctx) {
    Scheduler& s = *sched();
    if (s.in_kernel && pthread_equal(s.kernel_thread, pthread_self())) {
        s.fault_addr = reinterpret_cast<uintptr_t>(info->si_addr);
        s.fault_signal = sig;
        s.in_kernel = 0;
        siglongjmp(s.fault_jump, 1);
    }
    const struct sigaction& prev = sig == SIGSEGV ? previous_segv
                                   : sig == SIGBUS ? previous_bus
                                   : sig == SIGILL ? previous_ill
                                                   : previous_fpe;
    if (prev.sa_flags & SA_SIGINFO) {
        if (prev.sa_sigaction) {
            prev.sa_sigaction(sig, info, ctx);
            return;
        }
    } else if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
        prev.sa_handler(sig);
        return;
    }
    signal(sig, SIG_DFL);  // the fault recurs on return and ends the process as it would have
}

void install_fault_handlers() {
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_fault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &previous_segv);
        sigaction(SIGBUS, &sa, &previous_bus);
        sigaction(SIGFPE, &sa, &previous_fpe);
        // build.sh compiles the kernels with alignment checks that trap (ud2) on a misaligned access
        sigaction(SIGILL, &sa, &previous_ill);
    });
    // the handler must not run on a fiber stack that has just overflowed
    thread_local bool has_alt_stack = false;
    if (!has_alt_stack) {
        stack_t cur;
        if (sigaltstack(nullptr, &cur) == 0 && (cur.ss_flags & SS_DISABLE)) {
            stack_t st;
            st.ss_size = 64 * 1024;
            st.ss_sp = malloc(st.ss_size);
            st.ss_flags = 0;
            sigaltstack(&st, nullptr);
        }
        has_alt_stack = true;
    }
}

}  // namespace

bool shuffled_order() {
    static const bool on = [] {
        const char* v = getenv("ORT_EMU_ORDER");
        return !(v && strcmp(v, "forward") == 0);
    }();
    return on;
}

Lock::Lock() {
    TicketLock& l = big_lock();
    std::unique_lock<std::mutex> g(l.m);
    const uint64_t mine = l.next++;
    l.turn.wait(g, [&] { return l.serving == mine; });
}

Lock::~Lock() {
    TicketLock& l = big_lock();
    {
        std::lock_guard<std::mutex> g(l.m);
        ++l.serving;
    }
    l.turn.notify_all();
}

void Lock::let_others_in() {
    TicketLock& l = big_lock();
    std::unique_lock<std::mutex> g(l.m);
    if (l.next == l.serving + 1) return;  // nobody is waiting
    const uint64_t mine = l.next++;
    ++l.serving;
    l.turn.notify_all();
    l.turn.wait(g, [&] { return l.serving == mine; });
}

int run_kernel(const Kernel& k, Dim grid, Dim block, size_t dynamic_shared, void** params) {
    Scheduler& s = *sched();
    const size_t threads = (size_t)block.x * block.y * block.z;
    auto fail = [&](int code, const std::string& why) {
        fprintf(stderr, "cuda-emu: kernel %s (%s): %s\n", k.name, k.file, why.c_str());
        return code;
    };
    // the launch configuration was checked by cuLaunchKernel; this is the emulator's own buffer
    if (dynamic_shared > kDynamicSharedBytes) return fail(1, "dynamic shared memory " + std::to_string(dynamic_shared) + " bytes");
    install_fault_handlers();
    if (s.fibers.size() < threads) s.fibers.resize(threads);
    s.threads = (int)threads;
    s.kernel = &k;
    s.params = params;
    blockDim = dim3{block.x, block.y, block.z};
    gridDim = dim3{grid.x, grid.y, grid.z};
    s.dynamic_bytes = dynamic_shared;
    if (!s.shared_end) {
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        void* m = mmap(nullptr, kDynamicSharedBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return fail(2, "no memory for the emulated shared memory");
        s.shared_end = static_cast<unsigned char*>(m) + kDynamicSharedBytes;
        mprotect(s.shared_end, page, PROT_NONE);
    }
    s.dynamic_shared = s.shared_end - ((dynamic_shared + 15) & ~(size_t)15);  // 16-byte aligned, as on a GPU
    if (sigsetjmp(s.fault_jump, 1)) {
        const uintptr_t addr = s.fault_addr;
        const int sig = s.fault_signal;
        s.current = -1;
        char where[160];
        snprintf(where, sizeof where, "thread (%u, %u, %u) of block (%u, %u, %u): ", threadIdx.x, threadIdx.y, threadIdx.z, blockIdx.x,
                 blockIdx.y, blockIdx.z);
        if (sig == SIGFPE) return fail(719, std::string(where) + "integer division by zero (a GPU returns garbage; the CPU traps)");
        if (sig == SIGILL) return fail(716, std::string(where) + "misaligned address: a load or store through a pointer not aligned to its type, at " + code_address(addr));
        if (addr >= (uintptr_t)s.shared_end && addr < (uintptr_t)s.shared_end + (uintptr_t)sysconf(_SC_PAGESIZE))
            return fail(700, std::string(where) + "illegal address: " + std::to_string(addr - (uintptr_t)s.shared_end) +
                                 " bytes past the end of the launch's " + std::to_string(s.dynamic_bytes) + " bytes of dynamic shared memory");
        return fail(700, std::string(where) + "illegal address " + describe_address(addr));
    }
    // blocks in a shuffled order too: no kernel may depend on the order blocks run in
    const uint64_t blocks = (uint64_t)grid.x * grid.y * grid.z;
    const uint64_t stride = shuffled_order() && blocks > 1 ? pick_coprime(s, blocks) : 1;
    const uint64_t first = shuffled_order() ? next_random(s) % blocks : 0;
    s.kernel_thread = pthread_self();
    s.in_kernel = 1;
    for (uint64_t i = 0; i < blocks; ++i) {
        const uint64_t b = (first + i * stride) % blocks;
        blockIdx = dim3{(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y), (unsigned)(b / ((uint64_t)grid.x * grid.y))};
        if (!run_block(s)) {
            s.in_kernel = 0;
            return fail(719, s.error);
        }
    }
    s.in_kernel = 0;
    return 0;
}

}  // namespace ort_emu

using namespace ort_emu;

// ---- what emu.h declares for the kernels ---------------------------------------------------

void ort_emu_syncthreads() { (void)ort_emu_syncthreads_count(0, nullptr); }

int ort_emu_syncthreads_count(int pred, int* arrived) {
    Scheduler& s = *sched();
    Fiber& f = s.fibers[s.current];
    f.pred = pred;
    f.state = State::AtBarrier;
    yield_to_scheduler();
    if (arrived) *arrived = f.arrived;
    return f.pred;
}

uint64_t ort_emu_shfl_xor(unsigned mask, uint64_t bits, int lane_mask) {
    Scheduler& s = *sched();
    Fiber& f = s.fibers[s.current];
    f.op = WarpOp::Shuffle;
    f.mask = mask;
    f.lane_mask = lane_mask;
    f.value = bits;
    f.state = State::AtWarpOp;
    yield_to_scheduler();
    return f.value;
}

unsigned ort_emu_ballot(unsigned mask, int pred) {
    Scheduler& s = *sched();
    Fiber& f = s.fibers[s.current];
    f.op = WarpOp::Ballot;
    f.mask = mask;
    f.value = pred != 0;
    f.state = State::AtWarpOp;
    yield_to_scheduler();
    return (unsigned)f.value;
}

void ort_emu_mma_m16n8k16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, int f16) {
    Scheduler& s = *sched();
    Fiber& f = s.fibers[s.current];
    f.op = WarpOp::Mma;
    f.mma_f16 = f16;
    f.mask = 0xffffffffu;
    for (int i = 0; i < 4; ++i) {
        f.c[i] = c[i];
        f.a[i] = a[i];
    }
    f.b[0] = b0;
    f.b[1] = b1;
    f.state = State::AtWarpOp;
    yield_to_scheduler();
    for (int i = 0; i < 4; ++i) c[i] = f.c[i];
}

void ort_emu_ldmatrix_x4(uint32_t r[4], const void* row, int trans) {
    Scheduler& s = *sched();
    Fiber& f = s.fibers[s.current];
    f.op = WarpOp::Ldmatrix;
    f.mask = 0xffffffffu;
    f.row = static_cast<const unsigned char*>(row);
    f.trans = trans;
    f.state = State::AtWarpOp;
    yield_to_scheduler();
    for (int i = 0; i < 4; ++i) r[i] = f.r[i];
}

void ort_emu_cp_async(void* dst, const void* src, int bytes, int src_bytes) {
    Scheduler& s = *sched();
    const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
    if ((bytes != 4 && bytes != 8 && bytes != 16) || src_bytes < 0 || src_bytes > bytes || (a & (uintptr_t)(bytes - 1)) != 0) {
        // as the GPU's misaligned-address fault: the launch ends with an error naming the kernel
        fprintf(stderr, "cuda-emu: cp.async of %d bytes (%d from the source) at %p <- %p: not a size of 4, 8, 16 or not aligned to it\n",
                bytes, src_bytes, dst, src);
        raise(SIGILL);
    }
    s.fibers[s.current].copies.push_back(AsyncCopy{dst, src, bytes, src_bytes, -1});
}

// A GPU may land a group's copies any time between their issue and the wait for the group: the
// even groups of a thread land at once (a buffer refilled while another warp still reads it shows
// as wrong data), the odd ones at the wait (a tile read before its wait shows the garbage it
// replaced). Kernels that double-buffer meet both kinds within three tiles.
void ort_emu_cp_async_commit() {
    Fiber& f = sched()->fibers[sched()->current];
    for (AsyncCopy& c : f.copies)
        if (c.group < 0) c.group = f.committed;
    if (f.committed % 2 == 0) land_where(f, [&](const AsyncCopy& c) { return c.group == f.committed; });
    ++f.committed;
}

void ort_emu_cp_async_wait(int pending) { perform_copies(sched()->fibers[sched()->current], pending); }

void* ort_emu_dynamic_shared() { return sched()->dynamic_shared; }

void ort_emu_fresh_shared(void* p, size_t bytes) {
    Scheduler& s = *sched();
    uint64_t& e = s.shared_epoch[p];
    if (e != s.block_epoch) {
        memset(p, 0xff, bytes);  // garbage at the start of every block, as on a GPU
        e = s.block_epoch;
    }
}

uint16_t ort_emu_f32_to_bf16(float f) { return bf16_bits(f); }

uint16_t ort_emu_f32_to_f16(float f) {
    // round to nearest even, as cvt.rn.f16.f32: overflow to inf, subnormals, NaN kept quiet
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return 0x7fffu;  // the canonical NaN, as cvt.rn.f16.f32
    if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to 65520 or more: inf
    if (abs < 0x38800000u) {                                      // below f16's smallest normal
        if (abs < 0x33000000u) return (uint16_t)sign;             // under half the smallest subnormal
        const int e = (int)(abs >> 23);
        const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
        const int shift = 126 - e;  // to units of 2^-24
        uint32_t q = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) ++q;
        return (uint16_t)(sign | q);
    }
    uint32_t v = abs - 0x38000000u;  // rebias the exponent from 127 to 15
    const uint32_t rem = v & 0x1fffu;
    v >>= 13;
    if (rem > 0x1000u || (rem == 0x1000u && (v & 1u))) ++v;
    return (uint16_t)(sign | v);
}

float ort_emu_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0x1f) u = sign | 0x7f800000u | (m << 13);
    else if (e != 0) u = sign | ((e + 112) << 23) | (m << 13);
    else if (m == 0) u = sign;
    else {
        float v = (float)m * (1.0f / 16777216.0f);  // m * 2^-24, exact
        memcpy(&u, &v, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
