/* fuzz_main.h: the main() of a fuzz driver built without libFuzzer (the
 * project's compiler, every `make test`): replays a corpus directory, then
 * feeds ITERATIONS random mutations of its files (bit flips, byte writes,
 * truncations, 0xff runs) from a fixed seed, so a run is reproducible.
 * A driver defines LLVMFuzzerTestOneInput and fuzz_write_corpus (writes its
 * seed files into a directory; 0 or 1), then includes this file once.
 * Usage: DRIVER CORPUS_DIR [ITERATIONS]   DRIVER --write-corpus DIR */
#ifndef CS_FUZZ_MAIN_H
#define CS_FUZZ_MAIN_H
#ifndef CS_LIBFUZZER

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_MAX_SEEDS 64
#define FUZZ_MAX_LEN (1 << 16)

static int fuzz_write_corpus(const char *dir);

static uint64_t fuzz_rng = 0x9e3779b97f4a7c15u;
static uint64_t fuzz_next(void) { /* xorshift64 */
    fuzz_rng ^= fuzz_rng << 13, fuzz_rng ^= fuzz_rng >> 7, fuzz_rng ^= fuzz_rng << 17;
    return fuzz_rng;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--write-corpus")) return fuzz_write_corpus(argv[2]);
    if (argc < 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR [ITERATIONS]\n       %s --write-corpus DIR\n",
                argv[0], argv[0]);
        return 2;
    }
    long iters = argc > 2 ? atol(argv[2]) : 200000;
    uint8_t *seeds[FUZZ_MAX_SEEDS];
    size_t lens[FUZZ_MAX_SEEDS];
    int ns = 0;
    DIR *d = opendir(argv[1]);
    if (!d) {
        fprintf(stderr, "%s: cannot open the corpus %s\n", argv[0], argv[1]);
        return 2;
    }
    struct dirent *de;
    while ((de = readdir(d)) && ns < FUZZ_MAX_SEEDS) {
        if (de->d_name[0] == '.') continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", argv[1], de->d_name);
        FILE *f = fopen(path, "rb");
        if (!f) continue;
        seeds[ns] = malloc(FUZZ_MAX_LEN);
        if (!seeds[ns]) return 2;
        lens[ns] = fread(seeds[ns], 1, FUZZ_MAX_LEN, f);
        fclose(f);
        LLVMFuzzerTestOneInput(seeds[ns], lens[ns]);
        ns++;
    }
    closedir(d);
    if (!ns) {
        fprintf(stderr, "%s: the corpus %s is empty\n", argv[0], argv[1]);
        return 2;
    }
    uint8_t *buf = malloc(FUZZ_MAX_LEN);
    if (!buf) return 2;
    for (long it = 0; it < iters; it++) {
        int s = (int)(fuzz_next() % (uint64_t)ns);
        size_t n = lens[s];
        memcpy(buf, seeds[s], n);
        int muts = 1 + (int)(fuzz_next() % 4);
        for (int m = 0; m < muts && n; m++) {
            size_t pos = fuzz_next() % n;
            switch (fuzz_next() % 4) {
            case 0: buf[pos] ^= (uint8_t)(1u << (fuzz_next() % 8)); break;
            case 1: buf[pos] = (uint8_t)fuzz_next(); break;
            case 2: n = pos; break; /* truncate */
            case 3: memset(buf + pos, 0xff, n - pos < 8 ? n - pos : 8); break;
            }
        }
        LLVMFuzzerTestOneInput(buf, n);
    }
    for (int i = 0; i < ns; i++)
        free(seeds[i]);
    free(buf);
    printf("%s: %ld mutated inputs from %d seeds: no crash\n", argv[0], iters, ns);
    return 0;
}

#endif
#endif
