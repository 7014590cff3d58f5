// ortrain CUDA emulator: streams as queues of deferred work, events, and the runner that
// executes queued work in an order a GPU could choose (queues.cpp). driver.cpp's stream,
// event, copy and launch calls and cublas.cpp's products go through here. Every function here
// is called with the emulator's Lock held.
#pragma once

#include <stdint.h>

#include <deque>
#include <functional>
#include <memory>
#include <vector>

namespace ort_emu {

// The work a stream capture records, replayed by cuGraphLaunch.
struct Capture {
    std::vector<std::function<int()>> work;
    bool invalidated = false;
    const void* thread = nullptr;
};

// Set when one queued operation (an event record, a synchronous copy) has run, with the time
// it ran at (what cuEventElapsedTime subtracts).
struct Done {
    bool done = false;
    double seconds = 0;
};

// One queued operation: its work (0 or a CUDA error code, kept for the thread that queued it),
// its place in the order operations were queued in, and the event record it waits for.
struct Op {
    std::function<int()> work;
    uint64_t seq = 0;
    const void* owner = nullptr;
    std::shared_ptr<Done> waits_for;
};

struct Stream {
    std::unique_ptr<Capture> capture;
    std::deque<Op> queue;
    std::shared_ptr<Done> last;  // the completion of the last operation queued
    bool legacy = false;     // the legacy default stream (handle 0 or 1)
    bool blocking = true;    // ordered with the legacy stream (created without CU_STREAM_NON_BLOCKING)
    bool destroyed = false;  // kept, so a handle used after cuStreamDestroy is refused, not reused
    int device = 0;          // the device of the context it was created in
};

struct Event {
    std::shared_ptr<Done> last;    // the latest record's completion (none: never recorded)
    bool answered_not_ready = false;
    bool timing = true;            // not created with CU_EVENT_DISABLE_TIMING
};

// The stream a handle names: the legacy stream for 0 and 1, the calling thread's own
// (blocking) stream for 2 (CU_STREAM_PER_THREAD); null, with a message, for a destroyed one
// (undefined behaviour on a GPU, where the handle may already name another stream).
Stream* stream_of(void* handle);
// Registers a created stream with its flags.
Stream* new_stream(unsigned flags);
// Runs what is queued on `st`, then refuses the handle from now on.
void destroy_stream(Stream* st);

// An address that stands for the calling thread.
const void* this_thread();

// Queues `work` on `stream` (records it while the stream is captured). Returns its completion.
// `stream` must name a live stream (stream_of not null).
std::shared_ptr<Done> defer(void* stream, std::function<int()> work);
// Queues, on `stream`, a wait for `event`'s latest record (nothing when it has none or it ran).
void defer_wait(void* stream, Event* event);
// Queues a record of `event` on `stream`.
void defer_record(void* stream, Event* event);

// Runs queued work, in an order a GPU could choose, until `done` has run / what `st` had
// queued has run / what every stream had queued has run (work queued meanwhile by other
// threads may run too, but is not waited for).
void run_until(std::shared_ptr<Done> done);
void run_stream(Stream* st);
void run_all();

// The first error of work this thread queued, since the last call (then cleared).
int take_pending_error();

}  // namespace ort_emu
