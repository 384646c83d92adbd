/* unicode.c: UTF-8 decoding, class lookup over the generated range tables,
 * and the GPT-2 byte-level mapping. The tables themselves are generated
 * (tools/gen_unicode_tables.py -> unicode_tables.c). */
#include "unicode.h"

unsigned cs__unicode_flags(uint32_t cp) {
    if (cp < 256) return cs__unicode_latin1[cp];
    size_t lo = 0, hi = cs__unicode_n_ranges;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const cs__urange *r = &cs__unicode_ranges[mid];
        if (cp < r->first) {
            hi = mid;
        } else if (cp > r->last) {
            lo = mid + 1;
        } else {
            return r->flags;
        }
    }
    return 0;
}

int cs__utf8_decode(const uint8_t *s, size_t n, uint32_t *cp) {
    uint8_t b0 = s[0];
    if (b0 < 0x80) {
        *cp = b0;
        return 1;
    }
    int need;
    uint32_t c;
    /* Bounds of the second byte exclude overlongs (E0, F0), surrogates (ED)
     * and code points above U+10FFFF (F4), per Unicode table 3-7. */
    uint8_t lo = 0x80, hi = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
        need = 1;
        c = b0 & 0x1F;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
        need = 2;
        c = b0 & 0x0F;
        if (b0 == 0xE0) lo = 0xA0;
        if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
        need = 3;
        c = b0 & 0x07;
        if (b0 == 0xF0) lo = 0x90;
        if (b0 == 0xF4) hi = 0x8F;
    } else {
        return -1;
    }
    for (int i = 1; i <= need; i++) {
        if ((size_t)i >= n) return 0;
        uint8_t b = s[i];
        if (b < lo || b > hi) return -i;
        lo = 0x80;
        hi = 0xBF;
        c = (c << 6) | (b & 0x3F);
    }
    *cp = c;
    return need + 1;
}

int cs__utf8_encode(uint32_t cp, uint8_t out[4]) {
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

int cs__utf8_valid(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        int k = cs__utf8_decode(s + i, n - i, &cp);
        if (k <= 0) return 0;
        i += (size_t)k;
    }
    return 1;
}

/* bytes_to_unicode() keeps '!'..'~', U+00A1..U+00AC and U+00AE..U+00FF and
 * numbers the remaining bytes from U+0100 in order: 0x00..0x20 (33 bytes),
 * 0x7F..0xA0 (34 bytes), then 0xAD. */
uint32_t cs__byte_to_unicode(uint8_t b) {
    if (b <= 0x20) return 0x100u + b;
    if (b >= 0x7F && b <= 0xA0) return 0x100u + 33u + (b - 0x7Fu);
    if (b == 0xAD) return 0x100u + 67u;
    return b;
}

int cs__unicode_to_byte(uint32_t cp) {
    if (cp < 0x100) {
        if (cp <= 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD) return -1;
        return (int)cp;
    }
    if (cp <= 0x100 + 32) return (int)(cp - 0x100);
    if (cp <= 0x100 + 66) return (int)(cp - 0x100 - 33 + 0x7F);
    if (cp == 0x100 + 67) return 0xAD;
    return -1;
}
