/* test_secret.c: the cluster secret (base/src/secret.c): a value or a file
 * of one or two lines (the key proved, and one more accepted during a
 * rotation), every refusal naming what was wrong, tokens of either key
 * accepted and no other, and the reload: nothing while the file is the
 * same, the new keys once it changes (a new file renamed into place, as a
 * Kubernetes Secret volume does), a bad change refused once with the old
 * keys kept. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chunkserve/secret.h"
#include "test.h"

#define A "aaaaaaaaaaaaaaaa-first"
#define B "bbbbbbbbbbbbbbbb-second"

static char dir[] = "/tmp/test_secret_XXXXXX";
static char path[300];

/* Writes text to a new file and renames it over path. */
static void put(const char *text) {
    char tmp[320];
    snprintf(tmp, sizeof tmp, "%s/new", dir);
    FILE *f = fopen(tmp, "wb");
    ASSERT_TRUE(f);
    fputs(text, f);
    fclose(f);
    ASSERT_EQ_INT(rename(tmp, path), 0);
}

static int load(const char *text, cs_secret *s) {
    put(text);
    return cs_secret_load(NULL, path, s);
}

static bool key_is(const cs_secret_key *k, const char *v) {
    return k->len == strlen(v) && !memcmp(k->key, v, k->len);
}

int main(void) {
    ASSERT_TRUE(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/cluster-secret", dir);
    cs_secret s, t;

    /* a value is one secret; a line break in it is refused (two secrets go
     * in a file) */
    ASSERT_EQ_INT(cs_secret_load(NULL, NULL, &s), 0);
    ASSERT_TRUE(!s.set && s.n == 0 && !cs_secret_token(&s) && s.id == 0);
    ASSERT_TRUE(cs_secret_check_token(&s, "anything", 8));
    ASSERT_EQ_INT(cs_secret_load("short", NULL, &s), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "--cluster-secret: a cluster secret has 5 bytes");
    ASSERT_EQ_INT(cs_secret_load(A "\n" B, NULL, &s), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "line break");
    ASSERT_EQ_INT(cs_secret_load(A "\r", NULL, &s), CS_EINVAL);
    ASSERT_EQ_INT(cs_secret_load(A, NULL, &s), 0);
    ASSERT_EQ_INT(s.n, 1);
    put(A "\n");
    ASSERT_EQ_INT(cs_secret_load(A, path, &s), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "both set");

    /* a file: one secret a line; CRLF and the last newline dropped */
    ASSERT_EQ_INT(load(A "\n", &s), 0);
    ASSERT_TRUE(s.set && s.n == 1 && key_is(&s.k[0], A) && s.id != 0);
    ASSERT_EQ_INT(load(A, &t), 0);
    ASSERT_TRUE(t.n == 1 && key_is(&t.k[0], A) && t.id == s.id);
    ASSERT_EQ_STR(cs_secret_token(&t), s.k[0].token);
    ASSERT_EQ_INT(strlen(s.k[0].token), 64);
    ASSERT_EQ_INT(load(B "\r\n" A "\r\n", &t), 0);
    ASSERT_TRUE(t.n == 2 && key_is(&t.k[0], B) && key_is(&t.k[1], A) && t.id != s.id);
    ASSERT_EQ_INT(load(A "\n" A "\n", &t), 0); /* the same twice: one key */
    ASSERT_EQ_INT(t.n, 1);
    struct {
        const char *text, *msg;
    } bad[] = {
        {"", "on line 1 has 0 bytes"},
        {"\n", "on line 1 has 0 bytes"},
        {A "\n\n" B "\n", "on line 2 has 0 bytes"},
        {A "\nshort\n", "on line 2 has 5 bytes"},
        {A "\n" B "\n" A "\n", "more than 2 lines"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ASSERT_EQ_INT(load(bad[i].text, &t), CS_EINVAL);
        ASSERT_MSG_HAS(cs_last_error(), bad[i].msg);
        ASSERT_TRUE(!t.set);
    }
    ASSERT_EQ_INT(cs_secret_load(NULL, "/nonexistent/cluster-secret", &t), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "/nonexistent/cluster-secret cannot be read");

    /* tokens: either key's is accepted during a rotation, no other */
    cs_secret a, b, ab;
    ASSERT_EQ_INT(cs_secret_load(A, NULL, &a), 0);
    ASSERT_EQ_INT(cs_secret_load(B, NULL, &b), 0);
    ASSERT_EQ_INT(load(A "\n" B "\n", &ab), 0);
    ASSERT_EQ_STR(cs_secret_token(&ab), cs_secret_token(&a)); /* it proves the first */
    ASSERT_TRUE(cs_secret_check_token(&ab, cs_secret_token(&a), 64));
    ASSERT_TRUE(cs_secret_check_token(&ab, cs_secret_token(&b), 64));
    ASSERT_TRUE(!cs_secret_check_token(&a, cs_secret_token(&b), 64));
    ASSERT_TRUE(!cs_secret_check_token(&ab, cs_secret_token(&a), 63));
    ASSERT_TRUE(!cs_secret_check_token(&ab, NULL, 0));

    /* the reload */
    ASSERT_EQ_INT(load(A "\n", &s), 0);
    ASSERT_EQ_INT(cs_secret_reload(&s, path), 0); /* unchanged */
    put(A "\n");                                  /* a new file, the same secret */
    ASSERT_EQ_INT(cs_secret_reload(&s, path), 0);
    put(A "\n" B "\n"); /* rotation step 1 */
    ASSERT_EQ_INT(cs_secret_reload(&s, path), 1);
    ASSERT_TRUE(s.n == 2 && key_is(&s.k[0], A) && key_is(&s.k[1], B) && s.id == a.id);
    ASSERT_EQ_INT(cs_secret_reload(&s, path), 0);
    put(B "\n" A "\n"); /* step 2: the proved key and the id change */
    ASSERT_EQ_INT(cs_secret_reload(&s, path), 1);
    ASSERT_TRUE(s.n == 2 && key_is(&s.k[0], B) && s.id == b.id);
    ASSERT_EQ_STR(cs_secret_token(&s), cs_secret_token(&b));
    put("short\n"); /* refused once; the keys stay */
    ASSERT_EQ_INT(cs_secret_reload(&s, path), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "5 bytes");
    ASSERT_EQ_INT(cs_secret_reload(&s, path), 0);
    ASSERT_TRUE(s.n == 2 && key_is(&s.k[0], B) && key_is(&s.k[1], A));
    unlink(path); /* gone: an error at every try (a read may succeed later) */
    ASSERT_EQ_INT(cs_secret_reload(&s, path), CS_EIO);
    ASSERT_MSG_HAS(cs_last_error(), "cannot be read");
    ASSERT_EQ_INT(cs_secret_reload(&s, path), CS_EIO);
    ASSERT_EQ_INT(s.n, 2);
    put(B "\n"); /* step 3 */
    ASSERT_EQ_INT(cs_secret_reload(&s, path), 1);
    ASSERT_TRUE(s.n == 1 && key_is(&s.k[0], B));
    ASSERT_TRUE(!cs_secret_check_token(&s, cs_secret_token(&a), 64));

    cs_secret_clear(&s);
    ASSERT_TRUE(!s.set && s.n == 0 && s.k[0].len == 0);
    unlink(path);
    rmdir(dir);
    fprintf(stderr, "test_secret: ok\n");
    return 0;
}
