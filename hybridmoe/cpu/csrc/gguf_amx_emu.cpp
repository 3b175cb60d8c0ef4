// gguf_amx.cpp on amx_tiles.h's software model of the tiles (AVX-512 flags): hm_kernels_gguf_amx_emu, for the
// "amx" path where the CPU lacks AMX and HYBRIDMOE_AMX_EMULATE=1 (tests; see moe_amx_emu.cpp).
#define HM_GGUF_AMX 1
#define HM_AMX_EMULATE 1
#include "gguf_avx512.cpp"
