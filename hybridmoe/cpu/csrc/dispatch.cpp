// Run-time ISA detection (cpuid + xgetbv, compiled for baseline x86-64) and kernel-table selection.
// Nothing here executes AVX instructions, so it is safe on any x86-64 CPU.
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common.h"

namespace {

enum Feature : unsigned {
  F_AVX2 = 1u << 0,
  F_FMA = 1u << 1,
  F_AVX512F = 1u << 2,
  F_AVX512BW = 1u << 3,
  F_AVX512VL = 1u << 4,
  F_AVX512VNNI = 1u << 5,
  F_AVX512BF16 = 1u << 6,
  F_AMX_TILE = 1u << 7,
  F_AMX_INT8 = 1u << 8,
  F_AMX_BF16 = 1u << 9,
  F_OS_AVX = 1u << 10,     // XCR0 has SSE+AVX state
  F_OS_AVX512 = 1u << 11,  // XCR0 has opmask + ZMM state
  F_OS_AMX = 1u << 12,     // XCR0 has tile state and Linux granted XTILEDATA
  F_F16C = 1u << 13,
  F_AVX512VBMI = 1u << 14,  // not needed by an ISA level: the AVX-512/AMX FP8 kernels only (api.cpp)
};

uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t(edx) << 32) | eax;
}

bool request_amx_permission() {
  // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); Linux >= 5.16.
  const long ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return false;
  unsigned long bitmask = 0;
  if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bitmask) != 0) return false;
  return (bitmask & (1ul << XFEATURE_XTILEDATA)) != 0;
}

unsigned detect() {
  unsigned f = 0, a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  bool osxsave = c & (1u << 27);
  if (c & (1u << 12)) f |= F_FMA;
  if (c & (1u << 29)) f |= F_F16C;
  uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  if ((xcr0 & 0x6) == 0x6) f |= F_OS_AVX;
  if ((xcr0 & 0xE6) == 0xE6) f |= F_OS_AVX512;
  unsigned maxleaf = __get_cpuid_max(0, nullptr);
  if (maxleaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    if (b & (1u << 5)) f |= F_AVX2;
    if (b & (1u << 16)) f |= F_AVX512F;
    if (b & (1u << 30)) f |= F_AVX512BW;
    if (b & (1u << 31)) f |= F_AVX512VL;
    if (c & (1u << 11)) f |= F_AVX512VNNI;
    if (c & (1u << 1)) f |= F_AVX512VBMI;
    if (d & (1u << 24)) f |= F_AMX_TILE;
    if (d & (1u << 25)) f |= F_AMX_INT8;
    if (d & (1u << 22)) f |= F_AMX_BF16;
    unsigned subleaves = a;
    if (subleaves >= 1) {
      __cpuid_count(7, 1, a, b, c, d);
      if (a & (1u << 5)) f |= F_AVX512BF16;
    }
  }
  if ((f & F_AMX_TILE) && (xcr0 & (3ull << 17)) == (3ull << 17) && request_amx_permission()) f |= F_OS_AMX;
  return f;
}

unsigned features() {
  static unsigned f = detect();  // thread-safe static init
  return f;
}

// What ISA level `isa` needs that this CPU/OS lacks, as text ("" = nothing missing).
std::string missing_hw(int isa) {
  unsigned f = features();
  std::string m;
  auto need = [&](unsigned bit, const char* name) {
    if (!(f & bit)) m += std::string(m.empty() ? "" : ", ") + name;
  };
  need(F_AVX2, "avx2");
  need(F_FMA, "fma");
  need(F_F16C, "f16c");
  need(F_OS_AVX, "OS support for AVX state");
  if (isa >= hm::ISA_AVX512) {
    need(F_AVX512F, "avx512f");
    need(F_AVX512BW, "avx512bw");
    need(F_AVX512VL, "avx512vl");
    need(F_AVX512VNNI, "avx512_vnni");
    need(F_AVX512BF16, "avx512_bf16");
    need(F_OS_AVX512, "OS support for AVX-512 state");
  }
  if (isa >= hm::ISA_AMX) {
    need(F_AMX_TILE, "amx_tile");
    need(F_AMX_INT8, "amx_int8");
    need(F_AMX_BF16, "amx_bf16");
    need(F_OS_AMX, "OS permission for AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)");
  }
  return m;
}

// The "amx" path on amx_tiles.h's software model of the tiles (moe_amx_emu.cpp): only where the CPU
// lacks AMX but has AVX-512, and only when HYBRIDMOE_AMX_EMULATE=1 (read once; the tests set it). It
// tests the AMX kernels' logic on CI machines; it is never the best path (hm_isa_best).
bool amx_emulated() {
  static const bool on = [] {
    const char* v = std::getenv("HYBRIDMOE_AMX_EMULATE");
    return v && std::strcmp(v, "1") == 0 && !missing_hw(hm::ISA_AMX).empty() && missing_hw(hm::ISA_AVX512).empty() &&
           hm_kernels_amx_emu != nullptr;
  }();
  return on;
}

std::string missing(int isa) { return isa == hm::ISA_AMX && amx_emulated() ? std::string() : missing_hw(isa); }

const hm::Kernels* table_for(int isa) {
  switch (isa) {
    case hm::ISA_AVX2: return hm_kernels_avx2 ? hm_kernels_avx2() : nullptr;
    case hm::ISA_AVX512: return hm_kernels_avx512 ? hm_kernels_avx512() : nullptr;
    case hm::ISA_AMX:
      if (amx_emulated()) return hm_kernels_amx_emu();
      return hm_kernels_amx ? hm_kernels_amx() : nullptr;
  }
  return nullptr;
}

}  // namespace

extern "C" {

unsigned hm_cpu_features() { return features(); }

// 1 when the ISA path can run here (CPU + OS + compiled into this library), else 0; the reason
// is written to msg (NUL-terminated, at most len bytes).
int hm_isa_check(int isa, char* msg, int len) {
  std::string why;
  if (isa < hm::ISA_AVX2 || isa > hm::ISA_AMX) {
    why = "unknown ISA id " + std::to_string(isa);
  } else {
    std::string m = missing(isa);
    if (!m.empty())
      why = "this CPU lacks " + m;
    else if (!table_for(isa))
      why = "the library was built without this ISA's kernels (compiler lacked the flags)";
  }
  if (msg && len > 0) std::snprintf(msg, size_t(len), "%s", why.c_str());
  return why.empty() ? 1 : 0;
}

// Best ISA available (AMX > AVX-512 > AVX2), or -1 when not even AVX2 can run. An emulated AMX path
// is never the best one.
int hm_isa_best() {
  for (int isa = amx_emulated() ? hm::ISA_AVX512 : hm::ISA_AMX; isa >= hm::ISA_AVX2; --isa)
    if (hm_isa_check(isa, nullptr, 0)) return isa;
  return -1;
}

// 1 when the "amx" path runs on the software model of the tiles (amx_emulated), else 0.
int hm_amx_emulated() { return amx_emulated() ? 1 : 0; }

}  // extern "C"

namespace hm {
const Kernels* kernels_checked(int isa) { return hm_isa_check(isa, nullptr, 0) ? table_for(isa) : nullptr; }
bool cpu_has_vbmi() { return (features() & F_AVX512VBMI) != 0; }
}  // namespace hm
