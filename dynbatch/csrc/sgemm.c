/* dynbatch's float32 GEMM for x86-64 with AVX2 and FMA (NOTE [dynbatch's own GEMM] in
 * dynbatch/native_gemm.py).  C = A @ B with any strides for A and B, C row-major.
 *
 * The layout is BLIS's (Van Zee & van de Geijn, "BLIS: A Framework for Rapidly
 * Instantiating BLAS Functionality", 2015): B is packed in blocks of KC rows x NC
 * columns into panels of NR columns, A in blocks of MC rows x KC into panels of MR
 * rows, and a 6 x 16 micro-kernel keeps its 12 accumulators in registers while it
 * walks one A panel (from L2) against one B panel (from L1).  The block sizes were
 * measured on a Zen 3 core (32 KiB L1, 512 KiB L2): the micro-kernel alone runs at
 * 0.95 of the core's FMA peak; packing and the edges cost the rest.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MR 6
#define NR 16
#define MC 72   /* A block 72 x 512 floats: 144 KiB, in L2 */
#define KC 512
#define NC 1024 /* B block 512 x 1024 floats: 2 MiB; 4096 ran wide products 3-7 % slower */

/* c[6 x 16] (+)= ap[k x 6] (packed) @ bp[k x 16] (packed); c row stride ldc. */
static inline void micro_kernel(long k, const float *ap, const float *bp, float *c, long ldc, int accumulate) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
  __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (long p = 0; p < k; ++p, ap += MR, bp += NR) {
    __m256 b0 = _mm256_load_ps(bp), b1 = _mm256_load_ps(bp + 8), x;
    x = _mm256_broadcast_ss(ap + 0); c00 = _mm256_fmadd_ps(x, b0, c00); c01 = _mm256_fmadd_ps(x, b1, c01);
    x = _mm256_broadcast_ss(ap + 1); c10 = _mm256_fmadd_ps(x, b0, c10); c11 = _mm256_fmadd_ps(x, b1, c11);
    x = _mm256_broadcast_ss(ap + 2); c20 = _mm256_fmadd_ps(x, b0, c20); c21 = _mm256_fmadd_ps(x, b1, c21);
    x = _mm256_broadcast_ss(ap + 3); c30 = _mm256_fmadd_ps(x, b0, c30); c31 = _mm256_fmadd_ps(x, b1, c31);
    x = _mm256_broadcast_ss(ap + 4); c40 = _mm256_fmadd_ps(x, b0, c40); c41 = _mm256_fmadd_ps(x, b1, c41);
    x = _mm256_broadcast_ss(ap + 5); c50 = _mm256_fmadd_ps(x, b0, c50); c51 = _mm256_fmadd_ps(x, b1, c51);
  }
#define STORE_ROW(r, v0, v1)                                         \
  if (accumulate) {                                                  \
    v0 = _mm256_add_ps(v0, _mm256_loadu_ps(c + (r) * ldc));           \
    v1 = _mm256_add_ps(v1, _mm256_loadu_ps(c + (r) * ldc + 8));       \
  }                                                                  \
  _mm256_storeu_ps(c + (r) * ldc, v0);                               \
  _mm256_storeu_ps(c + (r) * ldc + 8, v1);
  STORE_ROW(0, c00, c01) STORE_ROW(1, c10, c11) STORE_ROW(2, c20, c21)
  STORE_ROW(3, c30, c31) STORE_ROW(4, c40, c41) STORE_ROW(5, c50, c51)
#undef STORE_ROW
}

/* r[0..7] <- its transpose (8 x 8). */
static inline void transpose8(__m256 *r) {
  __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* bp <- b[k x n] (strides sbk, sbn) as panels bp[n / NR][k][NR], the last zero-padded. */
static void pack_b(long k, long n, const float *b, long sbk, long sbn, float *bp) {
  long full = n / NR * NR;
  if (sbn == 1) {
    /* Row by row: each row of b is read once, in order. */
    for (long p = 0; p < k; ++p) {
      const float *src = b + p * sbk;
      float *dst = bp + p * NR;
      for (long j = 0; j < full; j += NR, src += NR, dst += NR * k) {
        _mm256_store_ps(dst, _mm256_loadu_ps(src));
        _mm256_store_ps(dst + 8, _mm256_loadu_ps(src + 8));
      }
    }
  } else if (sbk == 1) {
    /* b is a transposed row-major matrix: 8 of its columns are 8 contiguous rows. */
    long k8 = k / 8 * 8;
    for (long j = 0; j < full; j += 8) {
      float *dst = bp + (j / NR) * NR * k + (j % NR);
      for (long p = 0; p < k8; p += 8) {
        __m256 r[8];
        for (int q = 0; q < 8; ++q) r[q] = _mm256_loadu_ps(b + (j + q) * sbn + p);
        transpose8(r);
        for (int q = 0; q < 8; ++q) _mm256_storeu_ps(dst + (p + q) * NR, r[q]);
      }
      for (long p = k8; p < k; ++p)
        for (int q = 0; q < 8; ++q) dst[p * NR + q] = b[(j + q) * sbn + p];
    }
  } else {
    for (long j = 0; j < full; j += NR)
      for (long p = 0; p < k; ++p)
        for (long q = 0; q < NR; ++q) bp[j * k + p * NR + q] = b[p * sbk + (j + q) * sbn];
  }
  if (full < n) {
    long nr = n - full;
    for (long p = 0; p < k; ++p) {
      float *dst = bp + full * k + p * NR;
      long q = 0;
      for (; q < nr; ++q) dst[q] = b[p * sbk + (full + q) * sbn];
      for (; q < NR; ++q) dst[q] = 0.f;
    }
  }
}

/* ap <- a[m x k] (strides sam, sak) as panels ap[m / MR][k][MR], the last zero-padded.
 * ap has 8 floats of slack past its end (the row-major path's stores overlap). */
static void pack_a(long m, long k, const float *a, long sam, long sak, float *ap) {
  for (long i = 0; i < m; i += MR) {
    long mr = m - i < MR ? m - i : MR;
    float *dst = ap + i * k;
    const float *rows = a + i * sam;
    if (mr == MR && sak == 1) {
      /* 6 rows x 8 columns -> 8 runs of 6, transposed as 8 x 8 with two rows unused: each
         8-wide store's last two lanes are overwritten by the next store. */
      long p = 0;
      for (; p + 8 <= k; p += 8) {
        __m256 r[8];
        for (int q = 0; q < MR; ++q) r[q] = _mm256_loadu_ps(rows + q * sam + p);
        r[6] = r[7] = _mm256_setzero_ps();
        transpose8(r);
        for (int q = 0; q < 8; ++q) _mm256_storeu_ps(dst + (p + q) * MR, r[q]);
      }
      for (; p < k; ++p)
        for (int q = 0; q < MR; ++q) dst[p * MR + q] = rows[q * sam + p];
    } else if (mr == MR && sam == 1) {
      for (long p = 0; p < k; ++p) memcpy(dst + p * MR, rows + p * sak, MR * sizeof(float));
    } else {
      for (long p = 0; p < k; ++p) {
        long q = 0;
        for (; q < mr; ++q) dst[p * MR + q] = rows[q * sam + p * sak];
        for (; q < MR; ++q) dst[p * MR + q] = 0.f;
      }
    }
  }
}

/* One packed block: c[mc x nc] (+)= ap[mc x kc] @ bp[kc x nc]. */
static void block(long mc, long nc, long kc, const float *ap, const float *bp, float *c, long ldc, int accumulate) {
  float edge[MR * NR] __attribute__((aligned(32)));
  for (long j = 0; j < nc; j += NR) {
    long nr = nc - j < NR ? nc - j : NR;
    const float *panel = bp + j * kc;
    for (long i = 0; i < mc; i += MR) {
      long mr = mc - i < MR ? mc - i : MR;
      float *cij = c + i * ldc + j;
      if (mr == MR && nr == NR) {
        micro_kernel(kc, ap + i * kc, panel, cij, ldc, accumulate);
      } else {
        /* An edge tile: the whole tile into a buffer (the packing padded it with
           zeros), then the part that exists. */
        micro_kernel(kc, ap + i * kc, panel, edge, NR, 0);
        for (long q = 0; q < mr; ++q)
          for (long s = 0; s < nr; ++s)
            cij[q * ldc + s] = (accumulate ? cij[q * ldc + s] : 0.f) + edge[q * NR + s];
      }
    }
  }
}

/* c[m x n] (row stride ldc) = a[m x k] (strides sam, sak) @ b[k x n] (strides sbk, sbn),
 * on up to `threads` OpenMP threads (blocks of rows).  Returns 0, or -1 if out of memory. */
int dynbatch_sgemm(long m, long n, long k, const float *a, long sam, long sak,
                   const float *b, long sbk, long sbn, float *c, long ldc, int threads) {
  if (k == 0) {
    for (long i = 0; i < m; ++i) memset(c + i * ldc, 0, n * sizeof(float));
    return 0;
  }
  long nmax = n < NC ? n : NC, kmax = k < KC ? k : KC;
  long blocks = (m + MC - 1) / MC;
  if (threads > blocks) threads = (int)blocks;
  if (threads < 1) threads = 1;
  size_t b_bytes = ((nmax + NR - 1) / NR * NR * kmax * sizeof(float) + 63) / 64 * 64;
  size_t a_floats = ((MC * kmax + 8) + 15) / 16 * 16;
  float *bp = aligned_alloc(64, b_bytes);
  float *aps = aligned_alloc(64, threads * a_floats * sizeof(float));
  if (!bp || !aps) {
    free(bp);
    free(aps);
    return -1;
  }
  for (long jc = 0; jc < n; jc += NC) {
    long nc = n - jc < NC ? n - jc : NC;
    for (long pc = 0; pc < k; pc += KC) {
      long kc = k - pc < KC ? k - pc : KC;
      pack_b(kc, nc, b + pc * sbk + jc * sbn, sbk, sbn, bp);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
      for (long ib = 0; ib < blocks; ++ib) {
#ifdef _OPENMP
        float *ap = aps + omp_get_thread_num() * a_floats;
#else
        float *ap = aps;
#endif
        long ic = ib * MC, mc = m - ic < MC ? m - ic : MC;
        pack_a(mc, kc, a + ic * sam + pc * sak, sam, sak, ap);
        block(mc, nc, kc, ap, bp, c + ic * ldc + jc, ldc, pc > 0);
      }
    }
  }
  free(bp);
  free(aps);
  return 0;
}
