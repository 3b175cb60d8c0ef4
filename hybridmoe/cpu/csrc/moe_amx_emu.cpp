// moe_amx.cpp compiled against amx_tiles.h's software model of the tile ops (AVX-512 flags, no AMX):
// the table hm_kernels_amx_emu, which dispatch.cpp gives for the "amx" path where the CPU lacks AMX and
// HYBRIDMOE_AMX_EMULATE=1 (tests; never picked as the best path).
#define HM_AMX_EMULATE 1
#include "moe_amx.cpp"
