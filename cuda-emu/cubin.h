// ortrain CUDA emulator: per-kernel facts read from the CUBIN the engine loads (cubin.cpp).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <vector>

namespace ort_emu {

struct CompiledKernel {
    int registers = 0;         // per thread (0: not in the CUBIN)
    size_t static_shared = 0;  // bytes of `__shared__` data
};

// Records the kernels' registers and static shared memory of a CUBIN image (anything else is
// ignored). Called with the emulator's Lock held.
void read_cubin(const void* image);
// What the last CUBIN that had `name` said of it; null if none did.
const CompiledKernel* compiled_kernel(const char* name);
// Registers a block of `threads` threads of `registers` each takes from the register file.
int registers_for_block(int registers, size_t threads);

}  // namespace ort_emu
