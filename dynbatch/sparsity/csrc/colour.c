/* Greedy colourings for compressed derivatives (dynbatch/sparsity/colouring.py).
 *
 * star: a distance-1 colouring of a symmetric pattern's adjacency graph in which no
 * path on four vertices is bicoloured (Gebremedhin, Manne & Pothen, SIAM Review 2005),
 * so each entry of a symmetric matrix is read from one product: H S.  Colouring v, a
 * new bicoloured path v-w-x-y or y-v-w-x would need colour(v) = colour(x) with
 * colour(w) repeated at x's other neighbours (y) or at v's (y): those colours of x are
 * forbidden.  cnt[c * n + u] counts (saturating at 2) u's coloured neighbours of colour c.
 *
 * rows: a partial distance-2 colouring of a Jacobian's rows: two rows that share a
 * column never share a colour, so each entry is read from one product: S^T J.
 * Both return the number of colours, or -1 when out of memory. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int grow(uint8_t **cnt, int64_t *cap, int64_t need, int64_t n) {
    if (need < *cap) return 0;
    int64_t new_cap = *cap * 2 > need + 1 ? *cap * 2 : need + 1;
    uint8_t *p = realloc(*cnt, (size_t)new_cap * (size_t)n);
    if (!p) return -1;
    memset(p + (size_t)(*cap) * (size_t)n, 0, (size_t)(new_cap - *cap) * (size_t)n);
    *cnt = p;
    *cap = new_cap;
    return 0;
}

int64_t dynbatch_star_colouring(int64_t n, const int64_t *ptr, const int64_t *adj, const int64_t *order,
                                int64_t *colour) {
    int64_t cap = 64, ncolours = 0;
    uint8_t *cnt = calloc((size_t)cap * (size_t)n, 1);
    int64_t *forbidden = malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!cnt || !forbidden) { free(cnt); free(forbidden); return -1; }
    for (int64_t i = 0; i <= n; i++) forbidden[i] = -1;
    for (int64_t i = 0; i < n; i++) colour[i] = -1;
    for (int64_t k = 0; k < n; k++) {
        int64_t v = order[k];
        for (int64_t e = ptr[v]; e < ptr[v + 1]; e++) {
            int64_t w = adj[e];
            if (colour[w] >= 0) forbidden[colour[w]] = v;
        }
        for (int64_t e = ptr[v]; e < ptr[v + 1]; e++) {
            int64_t w = adj[e], cw = colour[w];
            if (cw < 0) continue;
            int repeated_at_v = cnt[cw * n + v] >= 2;
            for (int64_t f = ptr[w]; f < ptr[w + 1]; f++) {
                int64_t x = adj[f], cx = colour[x];
                if (x == v || cx < 0 || forbidden[cx] == v) continue;
                if (repeated_at_v || cnt[cw * n + x] >= 2) forbidden[cx] = v;
            }
        }
        int64_t c = 0;
        while (forbidden[c] == v) c++;
        colour[v] = c;
        if (c + 1 > ncolours) ncolours = c + 1;
        if (grow(&cnt, &cap, c, n)) { free(cnt); free(forbidden); return -1; }
        for (int64_t e = ptr[v]; e < ptr[v + 1]; e++) {
            uint8_t *u = &cnt[c * n + adj[e]];
            if (*u < 2) (*u)++;
        }
    }
    free(cnt);
    free(forbidden);
    return ncolours;
}

int64_t dynbatch_row_colouring(int64_t m, int64_t n, const int64_t *row_ptr, const int64_t *row_col,
                               const int64_t *col_ptr, const int64_t *col_row, const int64_t *order,
                               int64_t *colour) {
    int64_t ncolours = 0;
    int64_t *forbidden = malloc(sizeof(int64_t) * (size_t)(m + 1));
    if (!forbidden) return -1;
    (void)n;
    for (int64_t i = 0; i <= m; i++) forbidden[i] = -1;
    for (int64_t i = 0; i < m; i++) colour[i] = -1;
    for (int64_t k = 0; k < m; k++) {
        int64_t r = order[k];
        for (int64_t e = row_ptr[r]; e < row_ptr[r + 1]; e++) {
            int64_t j = row_col[e];
            for (int64_t f = col_ptr[j]; f < col_ptr[j + 1]; f++) {
                int64_t q = col_row[f];
                if (colour[q] >= 0) forbidden[colour[q]] = r;
            }
        }
        int64_t c = 0;
        while (forbidden[c] == r) c++;
        colour[r] = c;
        if (c + 1 > ncolours) ncolours = c + 1;
    }
    free(forbidden);
    return ncolours;
}
