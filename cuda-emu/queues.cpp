// ortrain CUDA emulator: streams as queues of deferred work (queues.h). Work queued on a stream
// does not run when it is queued, as on a GPU: it runs when the host waits for it (a stream,
// event or context synchronisation, a synchronous copy, a free), and then the queues advance in
// an order a GPU could choose: each stream in its own order, a stream's waits for events
// honoured, the legacy stream ordered with the blocking streams, and otherwise the next
// operation taken from a randomly chosen stream (`ORT_EMU_ORDER=forward`: the order they were
// queued in). So work on two streams with no wait between them can run in either order, and a
// missing wait gives wrong results here as it can on a GPU.
#include "queues.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <map>
#include <vector>

#include "emu_runtime.h"

namespace ort_emu {
namespace {

struct Queues {
    Stream legacy;
    std::vector<Stream*> streams;  // every live created stream (and each thread's own)
    uint64_t next_seq = 0;
    uint64_t rng = 0xD1B54A32D192ED03ull;
    std::map<const void*, int> errors;  // per queuing thread: its first unreported error
};

Queues& queues() {
    static Queues* q = [] {
        Queues* q = new Queues();
        q->legacy.legacy = true;
        return q;
    }();
    return *q;
}

// Whether the operation at the head of `st` may run now.
bool ready(const Queues& q, const Stream& st) {
    const Op& op = st.queue.front();
    if (op.waits_for && !op.waits_for->done) return false;
    if (st.legacy) {
        // the legacy stream waits for the work queued before on every blocking stream
        for (const Stream* other : q.streams)
            if (other->blocking && !other->queue.empty() && other->queue.front().seq < op.seq) return false;
        return true;
    }
    // and a blocking stream for the work queued before on the legacy stream
    return !st.blocking || q.legacy.queue.empty() || q.legacy.queue.front().seq > op.seq;
}

// Runs one queued operation; false when nothing is queued.
bool step() {
    Queues& q = queues();
    std::vector<Stream*> candidates;
    bool any = !q.legacy.queue.empty();
    if (any && ready(q, q.legacy)) candidates.push_back(&q.legacy);
    for (Stream* st : q.streams) {
        if (st->queue.empty()) continue;
        any = true;
        if (ready(q, *st)) candidates.push_back(st);
    }
    if (!any) return false;
    if (candidates.empty()) {
        // cannot happen with the driver's rules (a wait names a record queued before it); if
        // the emulator lets it, say so rather than hang
        fprintf(stderr, "cuda-emu: every queued operation waits for another: the queued work is dropped\n");
        for (Stream* st : q.streams) st->queue.clear();
        q.legacy.queue.clear();
        return false;
    }
    Stream* st = candidates[0];
    if (shuffled_order()) {
        st = candidates[xorshift(q.rng) % candidates.size()];
    } else {
        for (Stream* c : candidates)
            if (c->queue.front().seq < st->queue.front().seq) st = c;
    }
    Op op = std::move(st->queue.front());
    st->queue.pop_front();
    if (const int e = op.work()) {
        int& slot = q.errors[op.owner];
        if (slot == 0) slot = e;
    }
    return true;
}

std::shared_ptr<Done> push(Stream* st, std::function<int()> work, std::shared_ptr<Done> waits_for) {
    auto done = std::make_shared<Done>();
    Op op;
    op.work = [work = std::move(work), done] {
        const int e = work ? work() : 0;
        timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        done->seconds = (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
        done->done = true;
        return e;
    };
    op.seq = queues().next_seq++;
    op.owner = this_thread();
    op.waits_for = std::move(waits_for);
    st->queue.push_back(std::move(op));
    st->last = done;
    return done;
}

}  // namespace

const void* this_thread() {
    thread_local char marker;
    return &marker;
}

Stream* stream_of(void* h) {
    Queues& q = queues();
    if (h == nullptr || h == reinterpret_cast<void*>(1)) return &q.legacy;
    if (h == reinterpret_cast<void*>(2)) {
        thread_local Stream* per_thread = new_stream(0);
        return per_thread;
    }
    Stream* st = static_cast<Stream*>(h);
    if (st->destroyed) {
        fprintf(stderr, "cuda-emu: a destroyed stream was used (undefined behaviour on a GPU: the handle may name another stream by then)\n");
        return nullptr;
    }
    return st;
}

Stream* new_stream(unsigned flags) {
    Stream* st = new Stream();
    st->blocking = (flags & 1) == 0;  // CU_STREAM_NON_BLOCKING
    st->device = current_device();
    queues().streams.push_back(st);
    return st;
}

void destroy_stream(Stream* st) {
    // the driver lets queued work finish after cuStreamDestroy returns; running it now is one
    // such order. The Stream stays allocated, so its address is never reused for another.
    run_stream(st);
    st->destroyed = true;
    auto& streams = queues().streams;
    std::erase(streams, st);
}

std::shared_ptr<Done> defer(void* stream, std::function<int()> work) {
    Stream* st = stream_of(stream);
    if (st->capture) {
        if (work) st->capture->work.push_back(std::move(work));
        auto done = std::make_shared<Done>();
        done->done = true;  // nothing runs until the graph is launched
        return done;
    }
    return push(st, std::move(work), nullptr);
}

void defer_wait(void* stream, Event* event) {
    Stream* st = stream_of(stream);
    if (st->capture || !event->last || event->last->done) return;
    push(st, nullptr, event->last);
}

void defer_record(void* stream, Event* event) {
    event->answered_not_ready = false;
    event->last = defer(stream, nullptr);
}

// Between two operations other threads may queue work (or run some themselves), so work of two
// streams interleaves while the host waits, as on a GPU.
void run_until(std::shared_ptr<Done> done) {
    while (done && !done->done && step()) Lock::let_others_in();
}

void run_stream(Stream* st) { run_until(st->last); }

void run_all() {
    Queues& q = queues();
    std::vector<std::shared_ptr<Done>> targets{q.legacy.last};
    for (Stream* st : q.streams) targets.push_back(st->last);
    for (auto& t : targets) run_until(t);
}

int take_pending_error() {
    auto& errors = queues().errors;
    auto it = errors.find(this_thread());
    if (it == errors.end()) return 0;
    const int e = it->second;
    errors.erase(it);
    return e;
}

int enqueue(void* stream, std::function<int()> work) {
    if (!stream_of(stream)) return 400;  // CUDA_ERROR_INVALID_HANDLE: a destroyed stream
    defer(stream, std::move(work));
    return 0;
}

}  // namespace ort_emu
