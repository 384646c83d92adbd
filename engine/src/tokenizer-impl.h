/* tokenizer-impl.h: how loaders hand a vocabulary to the tokenizer, and the
 * tokenizer's internal layout. Loaders (GGUF metadata, tokenizer.json) fill a
 * cs_vocab_spec and call cs__tokenizer_create; they never touch the struct. */
#ifndef CS_TOKENIZER_IMPL_H
#define CS_TOKENIZER_IMPL_H

#include "chunkserve/tokenizer.h"

/* Token types, numbered as GGUF's tokenizer.ggml.token_type. */
enum cs_token_type {
    CS_TOKEN_UNDEFINED = 0,
    CS_TOKEN_NORMAL = 1,
    CS_TOKEN_UNKNOWN = 2,
    CS_TOKEN_CONTROL = 3,
    CS_TOKEN_USER_DEFINED = 4,
    CS_TOKEN_UNUSED = 5,
    CS_TOKEN_BYTE = 6,
};

/* Pre-tokenizer families (the split before BPE merges). */
enum cs_pretok {
    CS_PRETOK_GPT2 = 0, /* 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
    CS_PRETOK_SMOLLM,   /* digits isolated one by one, then GPT2 */
    CS_PRETOK_LLAMA3,   /* Llama-3 regex, \p{N}{1,3} */
    CS_PRETOK_QWEN2,    /* Llama-3 regex with single \p{N} */
};

/* The two tokenizer models a GGUF names (tokenizer.ggml.model). */
enum cs_tok_model {
    CS_TOK_BPE = 0, /* "gpt2": byte-level BPE, merges by rank after a pre-tokenizer split */
    CS_TOK_SPM,     /* "llama": SentencePiece BPE, merges by score, U+2581 for spaces, byte
                       fallback <0xNN> (Gemma, Llama 2, Mistral v0.1, TinyLlama) */
};

typedef struct {
    enum cs_tok_model model;
    int32_t n_vocab;
    const char *const *tokens;  /* (n_vocab) token strings: BPE in byte-level (GPT-2 unicode)
                                   form; SPM as SentencePiece pieces (U+2581 for a space) */
    const size_t *token_lens;   /* (n_vocab) byte lengths; NULL = NUL-terminated */
    const int32_t *token_types; /* (n_vocab) enum cs_token_type; NULL = all normal */
    int32_t n_merges;
    const char *const *merges; /* (n_merges) "left right", rank = index */
    const size_t *merge_lens;  /* (n_merges); NULL = NUL-terminated */
    enum cs_pretok pretok;     /* BPE only */
    const float *scores;       /* SPM: (n_vocab) merge priorities, higher first */
    bool add_space_prefix;     /* SPM: a space before the text and after each special token
                                  (SentencePiece's add_dummy_prefix) */
    int32_t bos_id, eos_id, unk_id, pad_id; /* -1 = none */
    const int32_t *eog_ids;                 /* extra end-of-generation ids */
    int32_t n_eog_ids;
    bool add_bos;
    const char *chat_template; /* may be NULL */
} cs_vocab_spec;

/* Builds a tokenizer, copying everything it needs from spec (spec may be
 * freed afterwards). Validates: ids in range, token types known, no
 * duplicate (non-empty) token texts, each merge "left right" names two
 * tokens whose concatenation is a token, no duplicate merges; CS_EBADMSG
 * with a message otherwise. Token texts of CONTROL / USER_DEFINED / UNKNOWN
 * tokens are taken as plain text, all others as byte-level strings.
 * CONTROL and UNKNOWN tokens are matched in input only with parse_special;
 * USER_DEFINED ones always (as HF tokenizers and llama.cpp do). Caller frees
 * with cs_tokenizer_free (NULL is a no-op). */
int cs__tokenizer_create(const cs_vocab_spec *spec, cs_tokenizer **out);

/* Maps a tokenizer.ggml.pre / tokenizer.json pre-tokenizer name to the enum;
 * CS_ENOTSUP with a message naming it when unknown. */
int cs__pretok_from_name(const char *name, enum cs_pretok *out);

/* Builds a tokenizer from a Hugging Face tokenizer.json (+ optional
 * tokenizer_config.json text for chat_template / bos / eos; may be NULL).
 * CS_EBADMSG for malformed or inconsistent JSON, CS_ENOTSUP (naming it) for
 * a model type, pre-tokenizer or option we do not implement. */
int cs__tokenizer_from_hf_json(const char *tokenizer_json, size_t len, const char *config_json,
                               cs_tokenizer **out);

/* Pre-tokenizer output: end offsets (bytes into the text) of the pieces, in
 * order; the first piece starts at 0. Reusable; the owner frees ends. */
typedef struct {
    size_t *ends;
    size_t n, cap;
} cs__pieces;

/* Splits len bytes of text as the pre-tokenizer kind does, replacing out's
 * contents. CS_EINVAL for invalid UTF-8, CS_ENOMEM. */
int cs__pretok_split(enum cs_pretok kind, const char *text, size_t len, cs__pieces *out);
/* Canonical name of a kind ("gpt2", "smollm", "llama3", "qwen2"). */
const char *cs__pretok_name(enum cs_pretok kind);

/* HF BPE "ignore_merges": a pre-token that is itself in the vocabulary is
 * emitted as that token without running merges. cs__tokenizer_create turns
 * it on for CS_PRETOK_LLAMA3 (as llama.cpp does for llama-bpe); the
 * tokenizer.json loader sets it from model.ignore_merges. */
void cs__tokenizer_set_ignore_merges(cs_tokenizer *tok, bool on);

struct cs__merge_slot {
    uint64_t key;   /* (left id << 32) | right id; UINT64_MAX = empty */
    int32_t rank;   /* index in the merge list: lower merges first */
    int32_t result; /* id of the token left + right */
};

/* Internal layout; only tokenizer.c, tokenizer_json.c and chat.c look inside. */
struct cs_tokenizer {
    enum cs_tok_model model;
    bool add_space_prefix; /* SPM */
    float *scores;         /* SPM: (n_vocab) */
    int32_t n_vocab;
    uint8_t *types;    /* (n_vocab) enum cs_token_type */
    uint8_t *attrs;    /* (n_vocab) CS__TOK_* bits */
    char *text;        /* all token strings as given, each NUL-terminated */
    size_t *text_off;  /* (n_vocab + 1) offsets into text; length = next - this - 1 */
    char *bytes;       /* all token byte strings (byte-level mapping undone, or U+2581 back
                          to a space), NUL-terminated */
    size_t *bytes_off; /* (n_vocab + 1) offsets into bytes, same convention */
    int32_t *text_map; /* (text_map_mask + 1) open-addressing table of ids by text, -1 empty */
    size_t text_map_mask;
    struct cs__merge_slot *merge_map; /* (merge_map_mask + 1) open-addressing table */
    size_t merge_map_mask;
    int32_t n_merges;
    int32_t byte_id[256];       /* token of each single byte in byte-level form, -1 if none */
    int32_t byte_fallback[256]; /* "<0xXX>" BYTE token, -1 if none */
    int32_t *specials;          /* ids matched in text, by first byte then longest first */
    int32_t n_specials;
    int32_t special_start[257]; /* specials[special_start[b] .. special_start[b+1]) start with b */
    enum cs_pretok pretok;
    bool ignore_merges;
    bool add_bos;
    int32_t bos_id, eos_id, unk_id, pad_id;
    char *chat_template; /* NULL when the model has none */
};

enum {
    CS__TOK_EOG = 0x01,     /* ends generation */
    CS__TOK_SPECIAL = 0x02, /* CONTROL or UNKNOWN: matched only with parse_special, skippable */
    CS__TOK_ADDED = 0x04,   /* USER_DEFINED: always matched as a whole in input text */
};

/* Gemma's chat template (chat.c), for Gemma GGUF files that carry none. */
extern const char cs__gemma_chat_template[];

/* Text of a token as stored (for special tokens, their literal text). */
static inline const char *cs__tok_text(const cs_tokenizer *tok, int32_t id, size_t *len) {
    *len = tok->text_off[id + 1] - tok->text_off[id] - 1;
    return tok->text + tok->text_off[id];
}

#endif
