/* amx_unit_micro.c: the AMX K-quant kernel's unit of work alone (one
 * super-block x 16 tokens: 12 tile products over 3 byte planes, 16 tile
 * loads, 3 tile stores), with and without epilogue-like vector work, and
 * where that work sits. The figures in docs/perf.md ("Step buffers aligned
 * ...; where the AMX K-quant kernel's time goes") come from it. Not a test;
 * data is random, nothing is checked. Needs a CPU with AMX-INT8 and Linux.
 *
 *   cc -O2 -march=native -mamx-tile -mamx-int8 bench/amx_unit_micro.c -o /tmp/amx_unit_micro
 *   /tmp/amx_unit_micro [COLS]      (the activations' row stride; default 1536)
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

static const tile_config cfg = {.palette = 1,
                                .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                .rows = {16, 16, 16, 16, 16, 16, 16, 16}};
static uint8_t pl[3][4][16][64] __attribute__((aligned(64)));
static int32_t cb[2][3][256] __attribute__((aligned(64)));
static float acc[16][16] __attribute__((aligned(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* one 64-column chunk: A, then the three planes' products (as qmat_amx.c) */
#define CHUNK(TA, a_ptr, xs, c)                                                                    \
    do {                                                                                           \
        _tile_loadd(TA, a_ptr, xs);                                                                \
        _tile_loadd(2, pl[0][c], 64);                                                              \
        _tile_dpbsud(4, TA, 2);                                                                    \
        _tile_loadd(3, pl[1][c], 64);                                                              \
        _tile_dpbsud(5, TA, 3);                                                                    \
        _tile_loadd(7, pl[2][c], 64);                                                              \
        _tile_dpbsud(6, TA, 7);                                                                    \
    } while (0)

/* 16 tokens' epilogue-like work on a unit's sums: S = lo + hi << 8, two
 * fma with converted sums (about the kernel's per-token work) */
static inline __attribute__((always_inline)) void work(int32_t (*c)[256]) {
    for (int r = 0; r < 16; r++) {
        __m512i s = _mm512_add_epi32(_mm512_load_si512(c[0] + 16 * r),
                                     _mm512_slli_epi32(_mm512_load_si512(c[1] + 16 * r), 8));
        __m512 a = _mm512_load_ps(acc[r]), dx = _mm512_set1_ps(0.5f + (float)r);
        a = _mm512_fmadd_ps(_mm512_mul_ps(dx, dx), _mm512_cvtepi32_ps(s), a);
        a = _mm512_fnmadd_ps(_mm512_mul_ps(dx, a),
                             _mm512_cvtepi32_ps(_mm512_load_si512(c[2] + 16 * r)), a);
        _mm512_store_ps(acc[r], a);
    }
}

int main(int argc, char **argv) {
    const int cols = argc > 1 ? atoi(argv[1]) : 1536, tokens = 512;
    if (cols < 256 || cols % 256) return fprintf(stderr, "COLS: a multiple of 256\n"), 2;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */))
        return fprintf(stderr, "no AMX tile state granted here\n"), 1;
    int8_t *A = aligned_alloc(64, (size_t)cols * tokens);
    if (!A) return 1;
    for (size_t i = 0; i < (size_t)cols * tokens; i++)
        A[i] = (int8_t)(i * 2654435761u >> 13);
    for (size_t i = 0; i < sizeof pl; i++)
        ((uint8_t *)pl)[i] = (uint8_t)(i * 2246822519u >> 11);
    _tile_loadconfig(&cfg);
    static const char *names[] = {"tiles only (activations strided)",
                                  "tiles only (activations in L1)", "work after the tile stores",
                                  "work after the products, before the stores",
                                  "work between the products' halves"};
    const long units = 200000;
    for (int round = 0; round < 2; round++)
        for (int mode = 0; mode < 5; mode++) {
            double t = now();
            for (long u = 0; u < units; u++) {
                /* the kernel's walk: token tiles down the activations */
                const int8_t *x = A + (mode == 0 ? (size_t)(u % (tokens / 16)) * 16 * cols : 0) +
                                  (size_t)(u % (cols / 256)) * 256;
                int32_t(*c)[256] = cb[u & 1], (*o)[256] = cb[(u + 1) & 1];
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                CHUNK(0, x, cols, 0);
                CHUNK(1, x + 64, cols, 1);
                if (mode == 4) work(o);
                CHUNK(0, x + 128, cols, 2);
                CHUNK(1, x + 192, cols, 3);
                if (mode == 3) work(o);
                _tile_stored(4, c[0], 64);
                _tile_stored(5, c[1], 64);
                _tile_stored(6, c[2], 64);
                if (mode == 2) work(o);
            }
            printf("%-44s %6.1f ns a unit\n", names[mode], (now() - t) / units * 1e9);
        }
    _tile_release();
    printf("(checksum %g)\n", (double)acc[3][5]);
    free(A);
    return 0;
}
