/* unicode.h: the Unicode pieces the tokenizer needs: strict UTF-8 decoding,
 * the character classes used by the BPE pre-tokenizers (from generated range
 * tables), and GPT-2's byte <-> code point mapping for byte-level BPE.
 * Not a general Unicode library: no normalization, no case mapping. */
#ifndef CS_UNICODE_H
#define CS_UNICODE_H

#include <stddef.h>
#include <stdint.h>

/* Character classes, as a bit set per code point. */
enum {
    CS_UFLAG_LETTER = 0x01,  /* general category L* (regex \p{L}) */
    CS_UFLAG_NUMBER = 0x02,  /* general category N* (regex \p{N}) */
    CS_UFLAG_SPACE = 0x04,   /* White_Space property (regex \s in Rust regex and Oniguruma) */
    CS_UFLAG_PYSPACE = 0x08, /* Python str.isspace() (Jinja's |trim) */
};

/* Generated tables (unicode_tables.c). */
typedef struct {
    uint32_t first, last; /* inclusive */
    uint8_t flags;
} cs__urange;
extern const cs__urange cs__unicode_ranges[];
extern const size_t cs__unicode_n_ranges;
extern const uint8_t cs__unicode_latin1[256];
extern const char cs__unicode_version[];

/* CS_UFLAG_* set of a code point; 0 for unassigned, surrogates, > U+10FFFF. */
unsigned cs__unicode_flags(uint32_t cp);

/* Decodes one UTF-8 character from s[0..n), n >= 1. Returns its length (1..4)
 * and sets *cp; 0 when s[0..n) is a proper prefix of a valid sequence (the
 * input ends inside a character); -k when the first k bytes (k >= 1) are an
 * ill-formed "maximal subpart" (Unicode ch. 3, U+FFFD substitution), to be
 * replaced by one U+FFFD. Rejects overlongs, surrogates and > U+10FFFF. */
int cs__utf8_decode(const uint8_t *s, size_t n, uint32_t *cp);

/* Writes cp (<= U+10FFFF, not a surrogate) as UTF-8; returns 1..4. */
int cs__utf8_encode(uint32_t cp, uint8_t out[4]);

/* True when s[0..n) is entirely valid UTF-8. */
int cs__utf8_valid(const uint8_t *s, size_t n);

/* GPT-2 bytes_to_unicode(): printable Latin-1 bytes map to themselves, the
 * other 68 to U+0100.. in byte order. */
uint32_t cs__byte_to_unicode(uint8_t b);
/* Inverse; -1 for a code point that is not in the mapping. */
int cs__unicode_to_byte(uint32_t cp);

#endif
