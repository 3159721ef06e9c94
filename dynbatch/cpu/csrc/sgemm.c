/* dynbatch's float32 GEMM for x86-64 (NOTE [dynbatch's own GEMM] in dynbatch/native_gemm.py).
 * C = A @ B with any strides for A and B, C row-major.  One source, built twice: with
 * -mavx2 -mfma (6 x 16 micro-kernel, 8-float vectors) and with -mavx512f (12 x 32,
 * 16-float vectors); everything but the micro-kernel's vector type and the block sizes
 * is shared.
 *
 * The layout is BLIS's (Van Zee & van de Geijn, "BLIS: A Framework for Rapidly
 * Instantiating BLAS Functionality", 2015): B is packed in blocks of KC rows x NC
 * columns into panels of NR columns, A in blocks of MC rows x KC into panels of MR
 * rows, and an MR x NR micro-kernel keeps its accumulators in registers while it
 * walks one A panel (from L2) against one B panel (from L1).  Two departures, for the
 * shapes where packing costs more than it saves: a narrow product reads a row-major A
 * in place, and a single block of rows packs B a panel at a time (block_streaming_b).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __AVX512F__
/* 24 of the 32 zmm registers accumulate; one B row is two vectors.  Block sizes measured
   on an Intel Xeon (Sapphire Rapids: 48 KiB L1, 2 MiB L2): the B panel, 256 x 32
   floats, is 32 KiB of L1; the A block, 240 x 256, 240 KiB of L2. */
typedef __m512 vec;
#define VLEN 16
#define MR 12
#define NR 32
#define MC 240
#define KC 256
#define NC 2048
#define vload _mm512_load_ps
#define vloadu _mm512_loadu_ps
#define vstoreu _mm512_storeu_ps
#define vstream _mm512_stream_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vfmadd _mm512_fmadd_ps
#define vadd _mm512_add_ps
#else
/* 12 of the 16 ymm registers accumulate.  Block sizes measured on a Zen 3 core (32 KiB
   L1, 512 KiB L2): the micro-kernel alone runs at 0.95 of the core's FMA peak. */
typedef __m256 vec;
#define VLEN 8
#define MR 6
#define NR 16
#define MC 72   /* A block 72 x 512 floats: 144 KiB, in L2 */
#define KC 512
#define NC 1024 /* B block 512 x 1024 floats: 2 MiB; 4096 ran wide products 3-7 % slower */
#define vload _mm256_load_ps
#define vloadu _mm256_loadu_ps
#define vstoreu _mm256_storeu_ps
#define vstream _mm256_stream_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vfmadd _mm256_fmadd_ps
#define vadd _mm256_add_ps
#endif
#define NV (NR / VLEN) /* vectors in a row of the tile */
#define EDGE_MR (MR * 2 / 3) /* the rows of a last tile that has its own kernel (M = 128: 10 x 12 + 8) */
#ifndef STREAM_MIN_BYTES
#define STREAM_MIN_BYTES (8 << 20)
#endif
#define A_IN_PLACE_MAX_N 256 /* a row-major A is read in place for products this narrow */

/* How a tile's result reaches c: written, added to c, or written around the caches. */
enum { OVERWRITE = 0, ACCUMULATE = 1, STREAM = 2 };

/* c[rows x NR] (+)= a[rows x k] @ bp[k x NR] (packed); c row stride ldc; a's element (r, p)
   at a[r * ars + p * aps].  The loops over the tile have constant bounds: unrolled, the
   accumulators live in registers; inlined, each caller's strides and rows are constants. */
static inline __attribute__((always_inline)) void tile(long k, const float *a, long ars, long aps, const float *bp,
                                                       float *c, long ldc, int accumulate, const int rows) {
  vec acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < rows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
#pragma GCC unroll 4
  for (long p = 0; p < k; ++p, a += aps, bp += NR) {
    vec b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = vload(bp + v * VLEN);
#pragma GCC unroll 16
    for (int r = 0; r < rows; ++r) {
      vec x = vset1(a[r * ars]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = vfmadd(x, b[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < rows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float *dst = c + r * ldc + v * VLEN;
      if (accumulate == STREAM)
        vstream(dst, acc[r][v]);
      else
        vstoreu(dst, accumulate == ACCUMULATE ? vadd(acc[r][v], vloadu(dst)) : acc[r][v]);
    }
}

/* A tile from a packed A panel, ap[k][MR]. */
static void micro_kernel(long k, const float *ap, const float *bp, float *c, long ldc, int accumulate) {
  tile(k, ap, 1, MR, bp, c, ldc, accumulate, MR);
}

/* The first EDGE_MR rows of a tile from a packed A panel: a last tile of few rows
   computes no rows it does not have ([128, K] @ [K, N]: 3 % of the time went to them). */
static void micro_kernel_edge(long k, const float *ap, const float *bp, float *c, long ldc, int accumulate) {
  tile(k, ap, 1, MR, bp, c, ldc, accumulate, EDGE_MR);
}

/* A tile from MR rows of a row-major a in place (row stride lda). */
static void micro_kernel_rows(long k, const float *a, long lda, const float *bp, float *c, long ldc, int accumulate) {
  tile(k, a, lda, 1, bp, c, ldc, accumulate, MR);
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
      for (long j = 0; j < full; j += NR, src += NR, dst += NR * k)
        for (int q = 0; q < NR; q += 8) _mm256_store_ps(dst + q, _mm256_loadu_ps(src + q));
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
      /* MR rows x 8 columns -> 8 runs of MR, transposed 8 rows at a time (rows past MR
         zero): each 8-wide store's lanes past its run are overwritten by the next store. */
      long p = 0;
      for (; p + 8 <= k; p += 8) {
        __m256 r[(MR + 7) / 8][8];
        for (int h = 0; h < (MR + 7) / 8; ++h) {
          for (int q = 0; q < 8; ++q)
            r[h][q] = 8 * h + q < MR ? _mm256_loadu_ps(rows + (8 * h + q) * sam + p) : _mm256_setzero_ps();
          transpose8(r[h]);
        }
        for (int q = 0; q < 8; ++q)
          for (int h = 0; h < (MR + 7) / 8; ++h) _mm256_storeu_ps(dst + (p + q) * MR + 8 * h, r[h][q]);
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

/* The A block tiles read: packed panels, ap[mc / MR][kc][MR]; or, with `rows`, a's rows in
 * place (row stride lda, unit column stride) and only a last, partial tile's rows packed,
 * ap[kc][MR]. */
struct a_block {
  const float *ap, *rows;
  long lda;
};

/* c[mc x nr] (+)= a[mc x kc] @ panel[kc x NR] (packed; nr <= NR of its columns exist),
 * tile by tile.  With `next`, each tile also prefetches into L2 its share of the rows of
 * the next panel of b (row stride sbk, NR floats each): a panel packed just before its
 * use then copies from L2, not from memory. */
static void panel_tiles(long mc, long nr, long kc, struct a_block a, const float *panel, float *c, long ldc,
                        int accumulate, const float *next, long sbk) {
  float edge[MR * NR] __attribute__((aligned(64)));
  long tiles = (mc + MR - 1) / MR, share = (kc + tiles - 1) / tiles;
  for (long i = 0, t = 0; i < mc; i += MR, ++t) {
    if (next)
      for (long p = t * share; p < (t + 1) * share && p < kc; ++p) {
        for (long q = 0; q < NR; q += 16) _mm_prefetch((const char *)(next + p * sbk + q), _MM_HINT_T1);
        _mm_prefetch((const char *)(next + p * sbk + NR - 1), _MM_HINT_T1);
      }
    long mr = mc - i < MR ? mc - i : MR;
    float *ci = c + i * ldc;
    const float *ap = a.rows ? a.ap : a.ap + i * kc;
    if (mr == MR && nr == NR) {
      if (a.rows)
        micro_kernel_rows(kc, a.rows + i * a.lda, a.lda, panel, ci, ldc, accumulate);
      else
        micro_kernel(kc, ap, panel, ci, ldc, accumulate);
    } else if (mr == EDGE_MR && nr == NR) {
      micro_kernel_edge(kc, ap, panel, ci, ldc, accumulate);
    } else {
      /* An edge tile: the whole tile into a buffer (the packing padded it with
         zeros), then the part that exists. */
      if (a.rows && mr == MR)
        micro_kernel_rows(kc, a.rows + i * a.lda, a.lda, panel, edge, NR, 0);
      else
        micro_kernel(kc, ap, panel, edge, NR, 0);
      for (long q = 0; q < mr; ++q)
        for (long s = 0; s < nr; ++s) ci[q * ldc + s] = (accumulate == ACCUMULATE ? ci[q * ldc + s] : 0.f) + edge[q * NR + s];
    }
  }
}

/* One block: c[mc x nc] (+)= a[mc x kc] @ bp[kc x nc] (packed). */
static void block(long mc, long nc, long kc, struct a_block a, const float *bp, float *c, long ldc, int accumulate) {
  for (long j = 0; j < nc; j += NR)
    panel_tiles(mc, nc - j < NR ? nc - j : NR, kc, a, bp + j * kc, c + j, ldc, accumulate, NULL, 0);
}

/* The same with b (row-major, row stride sbk) packed a panel at a time into bp, just
 * before the panel's use, the next one prefetched meanwhile.  For a single block of
 * rows: a block of b packed whole is used by only mc rows, and where b is larger than
 * L2 that packing, a pass over memory, cost a quarter of the product's time
 * ([128, 2048] @ [2048, 2048]); streamed, it overlaps the arithmetic. */
static void block_streaming_b(long mc, long nc, long kc, const float *ap, const float *b, long sbk, float *bp,
                              float *c, long ldc, int accumulate) {
  struct a_block a = {ap, NULL, 0};
  for (long j = 0; j < nc; j += NR) {
    long nr = nc - j < NR ? nc - j : NR;
    pack_b(kc, nr, b + j, sbk, 1, bp);
    panel_tiles(mc, nr, kc, a, bp, c + j, ldc, accumulate, j + NR < nc ? b + j + NR : NULL, sbk);
  }
}

/* Whether the page holding byte p is in memory (mincore's answer; unknown reads as no). */
static int resident(const void *p) {
  long page = sysconf(_SC_PAGESIZE);
  unsigned char in_core = 0;
  return page > 0 && mincore((void *)((uintptr_t)p & ~(uintptr_t)(page - 1)), 1, &in_core) == 0 && (in_core & 1);
}

/* Whether c is written around the caches (NOTE [Streamed stores] in native_gemm.py): a large
 * output written once (one block of k), aligned for the stores, its pages already in memory. */
static int streams(long m, long k, const float *c, long ldc) {
  size_t bytes = (size_t)m * ldc * sizeof(float);
  return k <= KC && (uintptr_t)c % 64 == 0 && ldc % 16 == 0 && bytes >= STREAM_MIN_BYTES && resident(c) &&
         resident((const char *)c + bytes - 1);
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
  /* A narrow product reuses each packed A block for few B panels: read a row-major A in
     place instead (AVX-512 on the Xeon: [4096, 512] @ [512, 128] 140 -> 155 GFLOP/s,
     [1024, 512] @ [512, 128] 141 -> 159; N = 512 a tie; from N = 1024 packing wins). */
  int in_place = sak == 1 && n <= A_IN_PLACE_MAX_N;
  int first = streams(m, k, c, ldc) ? STREAM : OVERWRITE;
  for (long jc = 0; jc < n; jc += NC) {
    long nc = n - jc < NC ? n - jc : NC;
    for (long pc = 0; pc < k; pc += KC) {
      long kc = k - pc < KC ? k - pc : KC;
      if (blocks == 1 && sbn == 1) {
        pack_a(m, kc, a + pc * sak, sam, sak, aps);
        block_streaming_b(m, nc, kc, aps, b + pc * sbk + jc, sbk, bp, c + jc, ldc, pc > 0 ? ACCUMULATE : first);
        _mm_sfence();
        continue;
      }
      pack_b(kc, nc, b + pc * sbk + jc * sbn, sbk, sbn, bp);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
      for (long ib = 0; ib < blocks; ++ib) {
#ifdef _OPENMP
        float *ap = aps + omp_get_thread_num() * a_floats;
#else
        float *ap = aps;
#endif
        long ic = ib * MC, mc = m - ic < MC ? m - ic : MC;
        const float *rows = a + ic * sam + pc * sak;
        struct a_block block_a = {ap, NULL, 0};
        if (in_place) {
          long whole = mc / MR * MR;
          if (whole < mc) pack_a(mc - whole, kc, rows + whole * sam, sam, sak, ap);
          block_a.rows = rows;
          block_a.lda = sam;
        } else {
          pack_a(mc, kc, rows, sam, sak, ap);
        }
        block(mc, nc, kc, block_a, bp, c + ic * ldc + jc, ldc, pc > 0 ? ACCUMULATE : first);
        _mm_sfence(); /* this thread's streamed stores, visible before the threads join */
      }
    }
  }
  free(bp);
  free(aps);
  return 0;
}
