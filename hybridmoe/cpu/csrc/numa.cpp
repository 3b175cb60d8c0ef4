// Places each sub-pool's share of a layer's packed weights in its NUMA node's memory (mbind via
// the raw syscall: no libnuma). Block nb of a matrix with NB blocks belongs to sub-pool
// nb * nsub / NB, the same rule the driver uses to hand GEMM items to sub-pools.
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "common.h"
#include "moe.h"

namespace {

constexpr unsigned long MPOL_BIND_ = 2, MPOL_MF_MOVE_ = 1ul << 1;

int bind_range(const uint8_t* begin, const uint8_t* end, int node) {
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  uintptr_t a = (uintptr_t(begin) + page - 1) / page * page, b = uintptr_t(end) / page * page;
  if (b <= a || node < 0 || node >= 1024) return 0;
  unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {0};
  mask[node / (8 * sizeof(unsigned long))] |= 1ul << (node % (8 * sizeof(unsigned long)));
  long r = syscall(SYS_mbind, reinterpret_cast<void*>(a), b - a, MPOL_BIND_, mask, 1024ul, MPOL_MF_MOVE_);
  return r == 0 ? 0 : -1;
}

int bind_matrix(const hm::PackedMat& m, int E, int64_t block_bytes, const int* nodes, int nsub) {
  int failures = 0;
  const int NB = m.N / 16;
  for (int e = 0; e < E; ++e) {
    const uint8_t* base = m.data + int64_t(e) * m.expert_stride;
    for (int s = 0; s < nsub; ++s) {
      int b0 = (s * NB + nsub - 1) / nsub, b1 = ((s + 1) * NB + nsub - 1) / nsub;  // first nb with nb*nsub/NB == s
      failures += bind_range(base + b0 * block_bytes, base + b1 * block_bytes, nodes[s]) != 0;
    }
  }
  return failures;
}

}  // namespace

extern "C" {

// Returns the number of ranges the kernel refused to move (0 = all placed). Scales stay where
// they are (small). Safe to call on a one-node machine (nothing to do there).
int hm_layer_bind_numa(void* layer, const int* nodes, int nsub) {
  if (nsub <= 1) return 0;
  const hm::LayerDesc& d = static_cast<hm::HmLayer*>(layer)->d;
  auto block_bytes = [&](int Kd) -> int64_t {
    return d.method == hm::M_INT8 ? int64_t(16) * Kd : d.method == hm::M_INT4 ? int64_t(8) * Kd : int64_t(32) * Kd;
  };
  return bind_matrix(d.w13, d.E, block_bytes(d.w13.Kd), nodes, nsub) +
         bind_matrix(d.w2, d.E, block_bytes(d.w2.Kd), nodes, nsub);
}

}  // extern "C"
