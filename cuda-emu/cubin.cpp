// ortrain CUDA emulator: what a GPU would take from the CUBIN NVRTC built for a kernel and
// the g++ build cannot know: its registers per thread (the `.nv.info` attribute
// EIATTR_REGCOUNT) and its static shared memory (the size of its `.nv.shared.<kernel>`
// section). cuModuleLoadData reads them from the image the engine loads; cuLaunchKernel then
// refuses a block the register file cannot hold, as a GPU does.
#include "cubin.h"

#include <string.h>

#include <map>
#include <string>

namespace ort_emu {
namespace {

constexpr uint16_t EM_CUDA = 190;
constexpr uint32_t SHT_SYMTAB = 2;
constexpr uint8_t EIFMT_SVAL = 4;
constexpr uint8_t EIATTR_REGCOUNT = 0x2f;

std::map<std::string, CompiledKernel>& compiled() {
    static auto* m = new std::map<std::string, CompiledKernel>();
    return *m;
}

template <typename T> T at(const unsigned char* b, uint64_t off) {
    T v;
    memcpy(&v, b + off, sizeof v);
    return v;
}

struct Section {
    uint32_t name_offset, type, link;
    uint64_t offset, size;
    std::string name;
};

}  // namespace

void read_cubin(const void* image) {
    const unsigned char* b = static_cast<const unsigned char*>(image);
    if (memcmp(b, "\x7f" "ELF", 4) != 0 || b[4] != 2 || at<uint16_t>(b, 0x12) != EM_CUDA) return;  // not a 64-bit CUBIN
    const uint64_t shoff = at<uint64_t>(b, 0x28);
    const uint16_t shentsize = at<uint16_t>(b, 0x3a), shnum = at<uint16_t>(b, 0x3c), shstrndx = at<uint16_t>(b, 0x3e);
    if (shentsize < 64 || shstrndx >= shnum) return;
    std::vector<Section> secs(shnum);
    for (uint16_t i = 0; i < shnum; ++i) {
        const uint64_t h = shoff + (uint64_t)i * shentsize;
        secs[i] = Section{at<uint32_t>(b, h), at<uint32_t>(b, h + 4), at<uint32_t>(b, h + 40), at<uint64_t>(b, h + 24), at<uint64_t>(b, h + 32), {}};
    }
    const uint64_t names = secs[shstrndx].offset;
    for (Section& s : secs) s.name = reinterpret_cast<const char*>(b + names + s.name_offset);
    // symbol names by index, for the attributes that name a kernel by its symbol
    std::vector<std::string> symbols;
    for (const Section& s : secs) {
        if (s.type != SHT_SYMTAB || s.link >= shnum) continue;
        const uint64_t strs = secs[s.link].offset;
        for (uint64_t off = 0; off + 24 <= s.size; off += 24)
            symbols.push_back(reinterpret_cast<const char*>(b + strs + at<uint32_t>(b, s.offset + off)));
    }
    auto& out = compiled();
    for (const Section& s : secs) {
        if (s.name.rfind(".nv.shared.", 0) == 0) out[s.name.substr(11)].static_shared = s.size;
        if (s.name != ".nv.info") continue;
        for (uint64_t i = s.offset, end = s.offset + s.size; i + 4 <= end;) {
            const uint8_t fmt = b[i], attr = b[i + 1];
            if (fmt != EIFMT_SVAL) {
                i += 4;
                continue;
            }
            const uint16_t size = at<uint16_t>(b, i + 2);
            if (attr == EIATTR_REGCOUNT && size == 8) {
                const uint32_t sym = at<uint32_t>(b, i + 4), regs = at<uint32_t>(b, i + 8);
                if (sym < symbols.size()) out[symbols[sym]].registers = (int)regs;
            }
            i += 4 + size;
        }
    }
}

const CompiledKernel* compiled_kernel(const char* name) {
    auto& m = compiled();
    auto it = m.find(name);
    return it == m.end() ? nullptr : &it->second;
}

int registers_for_block(int registers, size_t threads) {
    // registers are given to warps in units of 256; a block needs them for all its warps
    const size_t per_warp = ((size_t)registers * 32 + 255) / 256 * 256;
    return (int)(((threads + 31) / 32) * per_warp);
}

}  // namespace ort_emu
