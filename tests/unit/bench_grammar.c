/* bench_grammar.c: the cost of structured outputs per decode step.
 *
 *   chunkserve-bench-grammar MODEL [BATCH] [ROUNDS]
 *
 * Tokenizes a JSON document that fits the schema below, then runs BATCH
 * matchers through it token by token as a decode step would: one mask per
 * sequence per step, then the token accepted. Reports the mask time of one
 * step for the whole batch (p50 / p99 / max over the document's steps): the
 * first round starts with an empty mask cache (every state walks the
 * vocabulary trie once), later rounds find the masks cached, as a server
 * does once a schema has been seen. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkserve/clock.h"
#include "chunkserve/error.h"
#include "chunkserve/grammar.h"
#include "chunkserve/tokenizer.h"

static const char *SCHEMA =
    "{\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},"
    "\"email\":{\"type\":\"string\",\"format\":\"email\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":8},"
    "\"address\":{\"type\":\"object\",\"properties\":{\"street\":{\"type\":\"string\"},"
    "\"city\":{\"type\":\"string\"},\"zip\":{\"type\":\"string\",\"pattern\":\"^[0-9]{5}$\"}},"
    "\"required\":[\"street\",\"city\",\"zip\"]},"
    "\"score\":{\"type\":\"number\"},\"active\":{\"type\":\"boolean\"}},"
    "\"required\":[\"name\",\"age\",\"email\",\"tags\",\"address\",\"score\",\"active\"]}";

static const char *DOC =
    "{\"name\": \"Ada Lovelace, Countess of Lovelace\", \"age\": 36, "
    "\"email\": \"ada.lovelace@analytical-engine.org\", "
    "\"tags\": [\"mathematics\", \"computing\", \"poetry of science\", \"notes on the engine\"], "
    "\"address\": {\"street\": \"12 St James's Square\", \"city\": \"London\", \"zip\": \"10001\"}, "
    "\"score\": 99.75, \"active\": true}";

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL [BATCH] [ROUNDS]\n", argv[0]);
        return 2;
    }
    int batch = argc > 2 ? atoi(argv[2]) : 32, rounds = argc > 3 ? atoi(argv[3]) : 3;
    cs_tokenizer *tok;
    cs_vocab_trie *trie;
    cs_grammar *g;
    if (cs_tokenizer_load(argv[1], &tok) || cs_vocab_trie_init(tok, 0, &trie)) {
        fprintf(stderr, "%s\n", cs_last_error());
        return 1;
    }
    cs_structured spec = {.kind = CS_STRUCTURED_JSON_SCHEMA, .text = SCHEMA};
    double t0 = cs_now();
    if (cs_grammar_compile(&spec, &g)) {
        fprintf(stderr, "%s\n", cs_last_error());
        return 1;
    }
    double t_compile = cs_now() - t0;
    int32_t *ids;
    size_t n;
    if (cs_tokenizer_encode(tok, DOC, strlen(DOC), false, false, &ids, &n)) {
        fprintf(stderr, "%s\n", cs_last_error());
        return 1;
    }
    printf("vocab %d, document %zu tokens, batch %d, schema compiled in %.3f ms\n",
           cs_tokenizer_n_vocab(tok), n, batch, t_compile * 1e3);
    cs_matcher **m = calloc((size_t)batch, sizeof *m);
    double *step = malloc(n * sizeof *step);
    for (int r = 0; r < rounds; r++) {
        for (int b = 0; b < batch; b++)
            if (cs_matcher_init(g, trie, &m[b])) return 1;
        cs_grammar_stats s0 = cs_grammar_get_stats(g);
        for (size_t i = 0; i < n; i++) {
            double t = cs_now();
            for (int b = 0; b < batch; b++) {
                const uint32_t *allow;
                int32_t c = cs_matcher_mask(m[b], &allow);
                if (c <= 0 || !((allow[ids[i] / 32] >> (ids[i] % 32)) & 1)) {
                    fprintf(stderr, "token %zu (%d) not allowed\n", i, ids[i]);
                    return 1;
                }
            }
            step[i] = cs_now() - t;
            for (int b = 0; b < batch; b++)
                if (cs_matcher_accept(m[b], ids[i])) {
                    fprintf(stderr, "accept: %s\n", cs_last_error());
                    return 1;
                }
        }
        cs_grammar_stats s1 = cs_grammar_get_stats(g);
        double total = 0;
        for (size_t i = 0; i < n; i++)
            total += step[i];
        qsort(step, n, sizeof *step, cmp);
        printf("round %d (%s): step mask time for %d sequences: p50 %.3f ms, p99 %.3f ms, max %.3f "
               "ms, mean %.3f ms; trie walks %llu (%.0f nodes each), cache hits %llu\n",
               r, r == 0 ? "cold cache" : "warm cache", batch, step[n / 2] * 1e3,
               step[(size_t)(0.99 * (double)(n - 1))] * 1e3, step[n - 1] * 1e3,
               total / (double)n * 1e3, (unsigned long long)(s1.walks - s0.walks),
               s1.walks > s0.walks ? (double)(s1.nodes - s0.nodes) / (double)(s1.walks - s0.walks)
                                   : 0.0,
               (unsigned long long)(s1.hits - s0.hits));
        for (int b = 0; b < batch; b++)
            cs_matcher_free(m[b]);
    }
    free(m);
    free(step);
    free(ids);
    cs_grammar_free(g);
    cs_vocab_trie_free(trie);
    cs_tokenizer_free(tok);
    return 0;
}
