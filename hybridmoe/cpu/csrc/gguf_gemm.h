// The GGUF GEMM item (Kernels::gemm of the GGUF tables). Up to kGgufDirectRows activation rows,
// every weight row goes through the unit's direct kernel (direct_rows: blocks unpacked in registers,
// one pass over the file's bytes). More rows: for each 16-row N-block of the item, the rows'
// super-blocks are unpacked once into a thread-local UBlk tile (16 x K/256 x 576 B: 74 KB at
// K = 2048, L2-resident), then every activation row of the item is dotted against it, MR rows at a
// time sharing each weight register (the ISA unit's dot<MR, SIGNED>), or, where the unit defines
// HM_GGUF_TILE_ROWS, its own tile_rows() on the unpacked rows (AVX-512: the step layout). Included inside an
// anonymous namespace after gguf_unpack.h; the unit defines MR, dot_rows() and direct_rows().

struct UBuf {
  UBlk* p = nullptr;
  int64_t cap = 0;
  ~UBuf() { std::free(p); }
  UBlk* get(int64_t n) {
    if (n > cap) {
      std::free(p);
      p = static_cast<UBlk*>(std::aligned_alloc(64, size_t(n) * sizeof(UBlk)));
      if (!p) throw std::bad_alloc();
      cap = n;
    }
    return p;
  }
};
thread_local UBuf tl_ubuf;

int64_t act_row_bytes(int, int Kdp) { return gguf_act_row_bytes(Kdp); }

bool quant_row(int, const void* src, int src_dtype, int K, int Kdp, int, uint8_t* dst, float* scale, int32_t*) {
  if (K != Kdp || K % 256) return false;  // GGUF layers are built with H, I multiples of 256 (no padding)
  if (scale) *scale = 0.0f;
  return quant_act_row(src, src_dtype, K, dst);
}

bool quant_block(const float* src, int Kd, int blk, uint8_t* dst) {
  return quant_act_blk(src + int64_t(blk) * 256, Kd, blk, dst);
}

// N-block nb of W's pair (w13: gate blocks even, up blocks odd) for expert e: its matrix, first row,
// number of rows (0..16) and first byte.
struct NBlock {
  const HmGgufMat* m;
  int r0, nrows;
  const uint8_t* base;
  NBlock(const GgufPair& pr, int e, int nb) {
    m = pr.b ? ((nb & 1) ? pr.b : pr.a) : pr.a;
    r0 = pr.b ? (nb >> 1) * 16 : nb * 16;
    const int left = m->N - r0;
    nrows = left < 0 ? 0 : left > 16 ? 16 : left;
    base = m->data + int64_t(e) * m->expert_stride + int64_t(r0) * m->row_bytes;
  }
  // the first `bytes` of the block (at most all of it) towards L1
  void prefetch_head(int64_t bytes) const {
    const int64_t n = std::min<int64_t>(bytes, int64_t(nrows) * m->row_bytes);
    for (int64_t o = 0; o < n; o += 64) _mm_prefetch(reinterpret_cast<const char*>(base + o), _MM_HINT_T0);
  }
};

void gemm(int, const PackedMat& W, int e, const ActView& A, int M, int nb0, int nb1, float* C, int64_t ldc, int) {
  const GgufPair& pr = *reinterpret_cast<const GgufPair*>(W.data);
  const bool direct = M <= kGgufDirectRows;
  // The direct kernels prefetch A.prefetch bytes ahead inside a block's rows; a block's first
  // bytes (and the next block's, a separate stream for w13) are requested here, before its rows.
  if (direct && A.prefetch) NBlock(pr, e, nb0).prefetch_head(A.prefetch);
  for (int nb = nb0; nb < nb1; ++nb) {
    const NBlock blk(pr, e, nb);
    const HmGgufMat* m = blk.m;
    const int nrows = blk.nrows;
    const int B = m->K / 256;
    float* Cb = C + int64_t(nb - nb0) * 16;
    for (int mm = 0; mm < M; ++mm)
      for (int r = nrows; r < 16; ++r) Cb[mm * ldc + r] = 0.0f;
    if (nrows == 0) continue;
    const uint8_t* base = blk.base;
    if (direct && A.prefetch && pr.b && nb + 1 < nb1) NBlock(pr, e, nb + 1).prefetch_head(A.prefetch);
    if (direct) {  // the rows stay in L1/L2 for the later row groups: prefetch once
      const uint8_t* nxt = nullptr;
      int64_t nrs = 0;
      int nnext = 0;
      if (A.block_prefetch && nb + 1 < nb1) {
        const NBlock nx(pr, e, nb + 1);
        nxt = nx.base, nrs = nx.m->row_bytes, nnext = nx.nrows;
      }
      for (int m0 = 0; m0 < M; m0 += MR)
        direct_rows(m->type, base, m->row_bytes, nrows, B, A, m->K, m0, M - m0 < MR ? M - m0 : MR,
                    Cb + int64_t(m0) * ldc, ldc, m0 == 0 ? A.prefetch : 0, m0 == 0 ? nxt : nullptr, nrs, nnext);
      continue;
    }
    UBlk* U = tl_ubuf.get(int64_t(16) * B);
    for (int r = 0; r < nrows; ++r)
      for (int b = 0; b < B; ++b) unpack_block<kVnni>(m->type, base + r * m->row_bytes, b, U[r * B + b]);
#ifdef HM_GGUF_TILE_ROWS  // the unit's own tile path (gguf_avx512.cpp: the step layout)
    tile_rows(m->type, U, B, nrows, A, m->K, M, Cb, ldc);
    continue;
#endif
    const bool sgn = !kVnni && gguf_signed(m->type);
    for (int m0 = 0; m0 < M; m0 += MR) {
      const int mr = M - m0 < MR ? M - m0 : MR;
      for (int r = 0; r < nrows; ++r) dot_rows(U + r * B, B, A, m->K, m0, mr, sgn, Cb + int64_t(m0) * ldc + r, ldc);
    }
  }
}
