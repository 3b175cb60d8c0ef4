// The row walk shared by the dense kernel units (dense_avx512.cpp, dense_avx2.cpp): each unit
// defines kRows, kTT, block<R, TT>(t, n, tok0, pf) (rows n..n+R-1 for tokens tok0..tok0+TT-1) and
// row1_<PF>(t, n, pf) (one row, one token; PF: pf > 0) and includes this inside its anonymous namespace. One token
// (decode): row1 row after row, one linear stream. More: rows in blocks of kRows (a row tail one at
// a time); for each block, tokens go in tiles of kTT, so the block's weights come from memory
// once and from cache for the further tiles.
#pragma once

template <int R, int TT>
void token_tail(const HmDenseTask& t, int n, int64_t tok, int64_t rem, int pf) {
  if constexpr (TT >= 1) {
    if (rem == TT) return block<R, TT>(t, n, tok, pf);
    token_tail<R, TT - 1>(t, n, tok, rem, pf);
  }
}

template <int R>
void row_block(const HmDenseTask& t, int n, int pf) {
  int64_t tok = 0;
  for (; tok + kTT <= t.T; tok += kTT) block<R, kTT>(t, n, tok, tok == 0 ? pf : 0);
  if (tok < t.T) token_tail<R, kTT - 1>(t, n, tok, t.T - tok, tok == 0 ? pf : 0);
}

void rows(const HmDenseTask& t, int n0, int n1, int pf) {
  if (t.T <= 0) return;
  if (t.T == 1) {
    if (pf)
      for (int n = n0; n < n1; ++n) row1_<true>(t, n, pf);
    else
      for (int n = n0; n < n1; ++n) row1_<false>(t, n, pf);
    return;
  }
  int n = n0;
  for (; n + kRows <= n1; n += kRows) row_block<kRows>(t, n, pf);
  for (; n < n1; ++n) row_block<1>(t, n, pf);
}
