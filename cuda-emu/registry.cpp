// ortrain CUDA emulator: the table of kernels compiled into the library, filled by the
// generated per-file tables (build.sh) before main, read by cuModuleGetFunction.
#include <stdio.h>
#include <string.h>

#include <map>
#include <string>

#include "emu_runtime.h"

namespace ort_emu {
namespace {
std::map<std::string, const Kernel*>& table() {
    static auto* t = new std::map<std::string, const Kernel*>();
    return *t;
}
}  // namespace

Registrar::Registrar(const Kernel* kernels, int count) {
    for (int i = 0; i < count; ++i) {
        auto [it, added] = table().emplace(kernels[i].name, &kernels[i]);
        if (!added) fprintf(stderr, "cuda-emu: kernel %s is defined in both %s and %s\n", kernels[i].name, it->second->file, kernels[i].file);
    }
}

const Kernel* find_kernel(const char* name) {
    auto it = table().find(name);
    return it == table().end() ? nullptr : it->second;
}

}  // namespace ort_emu
