// The direct GGUF kernels' row loop, shared by the ISA units (included inside their anonymous
// namespace after gguf_dot512.h / gguf_dot256.h, which define direct_row<R>; MR is the unit's
// activation rows per register block).

// nrows weight rows against R activation rows, one row after the other: the rows of a GGUF matrix
// are contiguous, so that reads one linear stream. Several rows side by side (4 streams 1-5 KB
// apart, each row's super-block in turn) read 2.5-4x slower from DRAM on the 2-core Zen 4 (one
// thread, Q4_K / Q8_0, K = 2048) though equal from L2: the hardware prefetchers follow one stream
// well, four interleaved ones badly. pf: software prefetch at least pf bytes ahead, at the same
// place of a later row (whole rows ahead: the super-block layout of every row is the same).
// nxt (may be null): the rows (stride nrs, nnext of them) of the N-block computed next, row r requested while row r
// of this one is computed (ActView::block_prefetch: 1 towards L2, 2 towards L1).
template <int R>
void direct_m(int type, const uint8_t* row, int64_t rs, int nrows, int B, const ActView& A, int K, int m0, float* out,
              int64_t ldc, int pf, const uint8_t* nxt, int64_t nrs, int nnext) {
  const ActRows<R> a(A, K, m0);
  const int64_t lead = pf ? (pf + rs - 1) / rs * rs : 0;
  for (int r = 0; r < nrows; ++r) {
    if (nxt && r < nnext) {
      const char* q = reinterpret_cast<const char*>(nxt + r * nrs);
      if (A.block_prefetch == 1)
        for (int64_t o = 0; o < nrs; o += 64) _mm_prefetch(q + o, _MM_HINT_T1);
      else
        for (int64_t o = 0; o < nrs; o += 64) _mm_prefetch(q + o, _MM_HINT_T0);
    }
    direct_row<R>(type, row + r * rs, B, a, out + r, ldc, lead);
  }
}

// nrows weight rows (B super-blocks of `type`, stride rs bytes) against activation rows
// m0 .. m0 + mr - 1 (1 <= mr <= MR): out[t * ldc + r] = the dots. pf: prefetch distance (0: none).
template <int R = MR>
void direct_rows(int type, const uint8_t* row, int64_t rs, int nrows, int B, const ActView& A, int K, int m0, int mr,
                 float* out, int64_t ldc, int pf, const uint8_t* nxt = nullptr, int64_t nrs = 0, int nnext = 0) {
  if constexpr (R > 1) {
    if (mr < R) return direct_rows<R - 1>(type, row, rs, nrows, B, A, K, m0, mr, out, ldc, pf, nxt, nrs, nnext);
  }
  direct_m<R>(type, row, rs, nrows, B, A, K, m0, out, ldc, pf, nxt, nrs, nnext);
}
