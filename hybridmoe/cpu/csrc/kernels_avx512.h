// AVX-512 kernels shared by the AVX-512 and AMX tables (the AMX unit calls these for int4 and for
// small row counts). Only call after dispatch.cpp confirmed AVX-512 F/BW/VL/VNNI/BF16 (FP8: and VBMI).
#pragma once
#include "common.h"

namespace hm {
namespace avx512 {
int64_t act_row_bytes(int method, int Kdp);
bool quant_row(int method, const void* src, int dt, int K, int Kdp, int G, uint8_t* dst, float* scale, int32_t* gsum);
void gemm(int method, const PackedMat& W, int e, const ActView& A, int M, int nb0, int nb1, float* C, int64_t ldc, int G);
// `steps` (even) packed 32-byte fp8 steps -> the same steps as bf16 (64 bytes each; exact), e.g. one
// packed block into the AMX B-tile layout. Needs AVX512-VBMI (dispatch.cpp hm_has_vbmi).
void fp8_to_bf16(const uint8_t* src, uint16_t* dst, int64_t steps);
}  // namespace avx512
}  // namespace hm
