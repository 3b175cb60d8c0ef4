// gguf_avx512.cpp with the AMX tile path for large T (HM_GGUF_AMX): the table hm_kernels_gguf_amx, which
// gguf_api.cpp gives to GGUF layers on the "amx" path.
#define HM_GGUF_AMX 1
#include "gguf_avx512.cpp"
