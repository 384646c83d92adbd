/* test_stop: stop strings are cut and never shown, text that may become a
 * stop string is held back, stop ids / end-of-generation / max_tokens end a
 * sequence, and the emitted text always concatenates to the decode. */
#include <stdlib.h>

#include "chunkserve/stop.h"
#include "test.h"

static cs_tokenizer *tok;
static char matched[64]; /* the last feed's cs_stop_matched_string ("" none) */
static int32_t matched_token;

/* Feeds text's tokens; returns all emitted text and sets the finish reason
 * and the number of tokens consumed. */
static char *feed(const cs_stop_params *p, const char *text, enum cs_finish *fin, int32_t *used) {
    int32_t *ids;
    size_t n;
    ASSERT_EQ_INT(cs_tokenizer_encode(tok, text, strlen(text), true, false, &ids, &n), 0);
    cs_stop *s = NULL;
    ASSERT_EQ_INT(cs_stop_init(tok, p, &s), 0);
    char *all = calloc(1, 4096);
    *fin = CS_FINISH_NONE;
    size_t i;
    for (i = 0; i < n && *fin == CS_FINISH_NONE; i++) {
        char *t;
        ASSERT_EQ_INT(cs_stop_push(s, ids[i], &t, fin), 0);
        strcat(all, t);
        free(t);
    }
    *used = (int32_t)i;
    const char *m = cs_stop_matched_string(s);
    snprintf(matched, sizeof matched, "%s", m ? m : "");
    matched_token = cs_stop_matched_token(s);
    cs_stop_free(s);
    free(ids);
    return all;
}

int main(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/f32/tiny.gguf", getenv("CS_TINY_DIR"));
    ASSERT_EQ_INT(cs_tokenizer_load(path, &tok), 0);
    enum cs_finish fin;
    int32_t used;
    cs_stop_params p = {0};
    p.max_tokens = 1000;
    p.skip_special = true;

    char *t = feed(&p, "hello world", &fin, &used);
    ASSERT_EQ_STR(t, "hello world");
    ASSERT_EQ_INT(fin, CS_FINISH_NONE);
    free(t);

    const char *stops[] = {"STOP", "\n\n"};
    p.stop = stops, p.n_stop = 2;
    t = feed(&p, "one two STOP three", &fin, &used);
    ASSERT_EQ_STR(t, "one two ");
    ASSERT_EQ_INT(fin, CS_FINISH_STOP);
    ASSERT_EQ_STR(matched, "STOP"); /* what ended it (vLLM's stop_reason) */
    ASSERT_EQ_INT(matched_token, -1);
    free(t);
    t = feed(&p, "para one\n\npara two", &fin, &used);
    ASSERT_EQ_STR(t, "para one");
    ASSERT_EQ_INT(fin, CS_FINISH_STOP);
    ASSERT_EQ_STR(matched, "\n\n");
    free(t);
    t = feed(&p, "x \n\n STOP", &fin, &used); /* the earliest in the text */
    ASSERT_EQ_STR(matched, "\n\n");
    free(t);
    t = feed(&p, "STO but not a stop; ST", &fin, &used); /* partial matches are released */
    ASSERT_EQ_INT(fin, CS_FINISH_NONE);
    ASSERT_EQ_STR(t, "STO but not a stop; "); /* "ST" still held: it may become STOP */
    free(t);

    /* held-back text is never shown early: push token by token */
    cs_stop *s = NULL;
    ASSERT_EQ_INT(cs_stop_init(tok, &p, &s), 0);
    int32_t *ids;
    size_t n;
    ASSERT_EQ_INT(cs_tokenizer_encode(tok, "abc ST", 6, false, false, &ids, &n), 0);
    char shown[64] = "";
    for (size_t i = 0; i < n; i++) {
        char *x;
        ASSERT_EQ_INT(cs_stop_push(s, ids[i], &x, &fin), 0);
        strcat(shown, x);
        free(x);
    }
    ASSERT_TRUE(strstr(shown, "ST") == NULL);
    free(ids);
    cs_stop_free(s);

    /* max_tokens: everything held is flushed with LENGTH */
    p.max_tokens = 3;
    p.n_stop = 0;
    t = feed(&p, "a b c d e f", &fin, &used);
    ASSERT_EQ_INT(fin, CS_FINISH_LENGTH);
    ASSERT_EQ_INT(used, 3);
    free(t);

    /* end-of-generation token: stop, its text not shown; ignore_eos keeps going */
    p.max_tokens = 100;
    t = feed(&p, "hi<|im_end|>more", &fin, &used);
    ASSERT_EQ_INT(fin, CS_FINISH_STOP);
    ASSERT_EQ_STR(t, "hi");
    ASSERT_EQ_STR(matched, ""); /* end-of-generation: no stop reason */
    ASSERT_EQ_INT(matched_token, -1);
    free(t);
    /* min_tokens: a stop token or string before it is text like any other */
    p.min_tokens = 50;
    t = feed(&p, "hi<|im_end|>more", &fin, &used);
    ASSERT_EQ_INT(fin, CS_FINISH_NONE);
    ASSERT_EQ_STR(t, "himore");
    free(t);
    p.stop = stops, p.n_stop = 1;
    t = feed(&p, "one two STOP three", &fin, &used);
    ASSERT_EQ_INT(fin, CS_FINISH_NONE);
    ASSERT_EQ_STR(t, "one two STOP three");
    free(t);
    p.min_tokens = 1; /* from token 1 on stop strings count, from token 2 stop tokens */
    t = feed(&p, "one two STOP three", &fin, &used);
    ASSERT_EQ_INT(fin, CS_FINISH_STOP);
    ASSERT_EQ_STR(t, "one two ");
    free(t);
    p.n_stop = 0, p.min_tokens = 101; /* more than max_tokens */
    ASSERT_EQ_INT(cs_stop_init(tok, &p, &s), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "min_tokens");
    p.min_tokens = 0;
    p.ignore_eos = true;
    t = feed(&p, "hi<|im_end|>more", &fin, &used);
    ASSERT_EQ_INT(fin, CS_FINISH_NONE);
    ASSERT_EQ_STR(t, "himore"); /* the control token is skipped in text */
    free(t);

    /* stop token ids */
    int32_t *sid;
    size_t ns;
    ASSERT_EQ_INT(cs_tokenizer_encode(tok, "x", 1, false, false, &sid, &ns), 0);
    p.stop_ids = sid, p.n_stop_ids = 1;
    t = feed(&p, "abxcd", &fin, &used);
    ASSERT_EQ_INT(fin, CS_FINISH_STOP);
    ASSERT_EQ_INT(matched_token, sid[0]); /* the stop_ids entry that ended it */
    ASSERT_EQ_STR(matched, "");
    free(t);
    t = feed(&p, "xab", &fin, &used); /* the very first token stops: nothing buffered yet */
    ASSERT_EQ_INT(fin, CS_FINISH_STOP);
    ASSERT_EQ_INT(used, 1);
    ASSERT_EQ_STR(t, "");
    free(t);
    free(sid);

    /* bad parameters */
    cs_stop_params bad = {0};
    ASSERT_EQ_INT(cs_stop_init(tok, &bad, &s), CS_EINVAL); /* max_tokens 0 */
    bad.max_tokens = 5;
    const char *empty[] = {""};
    bad.stop = empty, bad.n_stop = 1;
    ASSERT_EQ_INT(cs_stop_init(tok, &bad, &s), CS_EINVAL);
    bad.n_stop = 0;
    int32_t badid = 1 << 30;
    bad.stop_ids = &badid, bad.n_stop_ids = 1;
    ASSERT_EQ_INT(cs_stop_init(tok, &bad, &s), CS_EINVAL);
    cs_tokenizer_free(tok);
    return 0;
}
