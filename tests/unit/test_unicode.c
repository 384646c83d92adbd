/* test_unicode.c: UTF-8 decoding (overlongs, surrogates, range, truncation),
 * the generated class tables and GPT-2's byte <-> unicode mapping. */
#include "test.h"
#include "unicode.h"

static int dec(const char *s, size_t n, uint32_t *cp) {
    return cs__utf8_decode((const uint8_t *)s, n, cp);
}

static void test_decode(void) {
    uint32_t cp = 0;
    ASSERT_EQ_INT(dec("A", 1, &cp), 1);
    ASSERT_EQ_INT(cp, 'A');
    ASSERT_EQ_INT(dec("\xc3\xa9", 2, &cp), 2);
    ASSERT_EQ_INT(cp, 0xE9);
    ASSERT_EQ_INT(dec("\xe4\xb8\xad", 3, &cp), 3);
    ASSERT_EQ_INT(cp, 0x4E2D);
    ASSERT_EQ_INT(dec("\xf0\x9f\x98\x80", 4, &cp), 4);
    ASSERT_EQ_INT(cp, 0x1F600);
    ASSERT_EQ_INT(dec("\xf4\x8f\xbf\xbf", 4, &cp), 4);
    ASSERT_EQ_INT(cp, 0x10FFFF);
    ASSERT_EQ_INT(dec("\xed\x9f\xbf", 3, &cp), 3); /* U+D7FF, just below the surrogates */
    ASSERT_EQ_INT(cp, 0xD7FF);

    /* Ill-formed: the return value is minus the maximal subpart length. */
    ASSERT_EQ_INT(dec("\x80", 1, &cp), -1);             /* lone continuation */
    ASSERT_EQ_INT(dec("\xc0\x80", 2, &cp), -1);         /* overlong NUL */
    ASSERT_EQ_INT(dec("\xc1\xbf", 2, &cp), -1);         /* overlong */
    ASSERT_EQ_INT(dec("\xe0\x80\x80", 3, &cp), -1);     /* overlong 3-byte */
    ASSERT_EQ_INT(dec("\xf0\x80\x80\x80", 4, &cp), -1); /* overlong 4-byte */
    ASSERT_EQ_INT(dec("\xed\xa0\x80", 3, &cp), -1);     /* surrogate U+D800 */
    ASSERT_EQ_INT(dec("\xed\xbf\xbf", 3, &cp), -1);     /* surrogate U+DFFF */
    ASSERT_EQ_INT(dec("\xf4\x90\x80\x80", 4, &cp), -1); /* U+110000 */
    ASSERT_EQ_INT(dec("\xf5\x80\x80\x80", 4, &cp), -1);
    ASSERT_EQ_INT(dec("\xff", 1, &cp), -1);
    ASSERT_EQ_INT(dec("\xe2\x82\x41", 3, &cp), -2); /* E2 82 is a valid prefix, 41 ends it */
    ASSERT_EQ_INT(dec("\xf0\x9f\x98\x41", 4, &cp), -3);
    /* Truncated but valid so far: 0 (the streaming detokenizer waits). */
    ASSERT_EQ_INT(dec("\xe2\x82", 2, &cp), 0);
    ASSERT_EQ_INT(dec("\xf0\x9f\x98", 3, &cp), 0);
    ASSERT_EQ_INT(dec("\xf0", 1, &cp), 0);

    ASSERT_TRUE(cs__utf8_valid((const uint8_t *)"", 0));
    ASSERT_TRUE(cs__utf8_valid((const uint8_t *)"h\xc3\xa9llo \xf0\x9f\x98\x80", 11));
    ASSERT_TRUE(!cs__utf8_valid((const uint8_t *)"ab\xc3", 3));
    ASSERT_TRUE(!cs__utf8_valid((const uint8_t *)"\xed\xa0\x80", 3));
}

static void test_encode_roundtrip(void) {
    static const uint32_t cps[] = {0,      0x7F,   0x80,   0x7FF,   0x800,   0xD7FF,
                                   0xE000, 0xFFFD, 0xFFFF, 0x10000, 0x1F600, 0x10FFFF};
    for (size_t i = 0; i < sizeof cps / sizeof cps[0]; i++) {
        uint8_t buf[4];
        int k = cs__utf8_encode(cps[i], buf);
        uint32_t back = 0;
        ASSERT_EQ_INT(cs__utf8_decode(buf, (size_t)k, &back), k);
        ASSERT_EQ_INT(back, cps[i]);
    }
}

static void test_classes(void) {
    ASSERT_EQ_INT(cs__unicode_flags('a'), CS_UFLAG_LETTER);
    ASSERT_EQ_INT(cs__unicode_flags('Z'), CS_UFLAG_LETTER);
    ASSERT_EQ_INT(cs__unicode_flags('7'), CS_UFLAG_NUMBER);
    ASSERT_EQ_INT(cs__unicode_flags(' '), CS_UFLAG_SPACE | CS_UFLAG_PYSPACE);
    ASSERT_EQ_INT(cs__unicode_flags('\n'), CS_UFLAG_SPACE | CS_UFLAG_PYSPACE);
    ASSERT_EQ_INT(cs__unicode_flags('\''), 0);
    ASSERT_EQ_INT(cs__unicode_flags(0x1C), CS_UFLAG_PYSPACE); /* Python isspace, not \s */
    ASSERT_EQ_INT(cs__unicode_flags(0x85), CS_UFLAG_SPACE | CS_UFLAG_PYSPACE);
    ASSERT_EQ_INT(cs__unicode_flags(0xA0), CS_UFLAG_SPACE | CS_UFLAG_PYSPACE);
    ASSERT_EQ_INT(cs__unicode_flags(0xE9), CS_UFLAG_LETTER);
    ASSERT_EQ_INT(cs__unicode_flags(0xB2), CS_UFLAG_NUMBER);   /* superscript two (No) */
    ASSERT_EQ_INT(cs__unicode_flags(0x17F), CS_UFLAG_LETTER);  /* long s */
    ASSERT_EQ_INT(cs__unicode_flags(0x0301), 0);               /* combining acute (Mn) */
    ASSERT_EQ_INT(cs__unicode_flags(0x0663), CS_UFLAG_NUMBER); /* Arabic-Indic three */
    ASSERT_EQ_INT(cs__unicode_flags(0x1680), CS_UFLAG_SPACE | CS_UFLAG_PYSPACE);
    ASSERT_EQ_INT(cs__unicode_flags(0x180E), 0); /* no longer White_Space since 6.3 */
    ASSERT_EQ_INT(cs__unicode_flags(0x200B), 0); /* zero width space is Cf */
    ASSERT_EQ_INT(cs__unicode_flags(0x2028), CS_UFLAG_SPACE | CS_UFLAG_PYSPACE);
    ASSERT_EQ_INT(cs__unicode_flags(0x216B), CS_UFLAG_NUMBER); /* roman numeral twelve (Nl) */
    ASSERT_EQ_INT(cs__unicode_flags(0x3000), CS_UFLAG_SPACE | CS_UFLAG_PYSPACE);
    ASSERT_EQ_INT(cs__unicode_flags(0x4E2D), CS_UFLAG_LETTER);
    ASSERT_EQ_INT(cs__unicode_flags(0xAC00), CS_UFLAG_LETTER);
    ASSERT_EQ_INT(cs__unicode_flags(0x1F600), 0);
    ASSERT_EQ_INT(cs__unicode_flags(0x20000), CS_UFLAG_LETTER);
    ASSERT_EQ_INT(cs__unicode_flags(0xE000), 0);
    ASSERT_EQ_INT(cs__unicode_flags(0x10FFFF), 0);
    ASSERT_EQ_INT(cs__unicode_flags(0x110000), 0);
    ASSERT_EQ_INT(cs__unicode_flags(0xFFFFFFFFu), 0);

    /* The tables are sorted and disjoint, which the binary search needs. */
    ASSERT_TRUE(cs__unicode_n_ranges > 100);
    for (size_t i = 0; i < cs__unicode_n_ranges; i++) {
        ASSERT_TRUE(cs__unicode_ranges[i].first <= cs__unicode_ranges[i].last);
        ASSERT_TRUE(cs__unicode_ranges[i].flags != 0);
        if (i) ASSERT_TRUE(cs__unicode_ranges[i - 1].last < cs__unicode_ranges[i].first);
    }
    for (uint32_t cp = 0; cp < 256; cp++) {
        unsigned f = 0;
        for (size_t i = 0; i < cs__unicode_n_ranges; i++)
            if (cs__unicode_ranges[i].first <= cp && cp <= cs__unicode_ranges[i].last)
                f = cs__unicode_ranges[i].flags;
        ASSERT_EQ_INT(cs__unicode_latin1[cp], f);
    }
    ASSERT_TRUE(cs__unicode_version[0] != 0);
}

static void test_byte_mapping(void) {
    int seen[324] = {0};
    for (int b = 0; b < 256; b++) {
        uint32_t u = cs__byte_to_unicode((uint8_t)b);
        ASSERT_TRUE(u < 324);
        ASSERT_EQ_INT(seen[u], 0);
        seen[u] = 1;
        ASSERT_EQ_INT(cs__unicode_to_byte(u), b);
    }
    ASSERT_EQ_INT(cs__byte_to_unicode(' '), 0x120);  /* 'Ġ' */
    ASSERT_EQ_INT(cs__byte_to_unicode('\n'), 0x10A); /* 'Ċ' */
    ASSERT_EQ_INT(cs__byte_to_unicode(0), 0x100);
    ASSERT_EQ_INT(cs__byte_to_unicode('!'), '!');
    ASSERT_EQ_INT(cs__byte_to_unicode('~'), '~');
    ASSERT_EQ_INT(cs__byte_to_unicode(0x7F), 0x121);
    ASSERT_EQ_INT(cs__byte_to_unicode(0xA0), 0x142);
    ASSERT_EQ_INT(cs__byte_to_unicode(0xA1), 0xA1);
    ASSERT_EQ_INT(cs__byte_to_unicode(0xAD), 0x143);
    ASSERT_EQ_INT(cs__byte_to_unicode(0xFF), 0xFF);
    ASSERT_EQ_INT(cs__unicode_to_byte(' '), -1);
    ASSERT_EQ_INT(cs__unicode_to_byte(0xAD), -1);
    ASSERT_EQ_INT(cs__unicode_to_byte(0x144), -1);
    ASSERT_EQ_INT(cs__unicode_to_byte(0x4E2D), -1);
}

int main(void) {
    test_decode();
    test_encode_roundtrip();
    test_classes();
    test_byte_mapping();
    printf("test_unicode: ok\n");
    return 0;
}
