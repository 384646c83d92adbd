/* chunkserve/tokenizer.h: byte-level BPE tokenizer (GPT-2 / SmolLM / Llama-3 /
 * Qwen2 style), its special tokens, streaming detokenization and the model's
 * chat template.
 *
 * A tokenizer is built by the model loader (from GGUF tokenizer.ggml.* keys or
 * a Hugging Face tokenizer.json) and owned by the model; see cs_model_tokenizer().
 * All functions taking a const cs_tokenizer* are thread-safe. */
#ifndef CHUNKSERVE_TOKENIZER_H
#define CHUNKSERVE_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cs_tokenizer cs_tokenizer;

/* Loads only the tokenizer of a model (a .gguf file or a Hugging Face
 * directory with tokenizer.json), without its weights. Free with
 * cs_tokenizer_free(). Errors as cs_model_load(). */
int cs_tokenizer_load(const char *path, cs_tokenizer **out);
void cs_tokenizer_free(cs_tokenizer *tok); /* NULL is a no-op */

/* Number of token ids (valid ids are 0 .. n_vocab-1). */
int32_t cs_tokenizer_n_vocab(const cs_tokenizer *tok);
/* 64 bits of XXH3 over everything that decides how text becomes ids and ids
 * become text: every token's text, type and attributes, the merges in rank
 * order, the special tokens, the pre-tokenizer, BOS, EOS and add_bos, UNK
 * where a byte can map to it (PAD never changes a token), and the chat
 * template. A GGUF file and the tokenizer.json it came from give the same
 * value. O(vocabulary); call it once. */
uint64_t cs_tokenizer_fingerprint(const cs_tokenizer *tok);
/* Special ids, or -1 when the model has none. */
int32_t cs_tokenizer_bos(const cs_tokenizer *tok);
int32_t cs_tokenizer_eos(const cs_tokenizer *tok);
/* True for ids that end generation (eos, <|im_end|>, <|eot_id|>, ...). */
bool cs_tokenizer_is_eog(const cs_tokenizer *tok, int32_t id);
/* True for control/special tokens (not printed by decode unless asked). */
bool cs_tokenizer_is_special(const cs_tokenizer *tok, int32_t id);

/* Encode len bytes of text (need not be NUL-terminated; must be valid UTF-8,
 * else CS_EINVAL). With parse_special, the text of control tokens (e.g.
 * "<|im_start|>") maps to their ids; without it that text is ordinary text.
 * User-defined added tokens always match (as in HF tokenizers and llama.cpp).
 * add_bos prepends BOS when the model asks for it (tokenizer.ggml.add_bos_token),
 * unless, with parse_special, the text starts with the BOS token's text (a chat
 * template that renders it): never two.
 * On success *ids is malloc'd (caller frees with free()) and *n_ids is set.
 * Failure: CS_EINVAL (invalid UTF-8), CS_ENOMEM. */
int cs_tokenizer_encode(const cs_tokenizer *tok, const char *text, size_t len, bool parse_special,
                        bool add_bos, int32_t **ids, size_t *n_ids);

/* Raw bytes of one token (byte-level mapping undone). Special tokens give
 * their text. Returns CS_EINVAL for an id out of range. The bytes stay valid
 * as long as the tokenizer. */
int cs_tokenizer_token_bytes(const cs_tokenizer *tok, int32_t id, const char **bytes, size_t *len);

/* Decode ids to text. skip_special drops control tokens. The result is
 * malloc'd and NUL-terminated; bytes that do not form valid UTF-8 are replaced
 * by U+FFFD. Failure: CS_EINVAL (id out of range), CS_ENOMEM. */
int cs_tokenizer_decode(const cs_tokenizer *tok, const int32_t *ids, size_t n_ids,
                        bool skip_special, char **text, size_t *len);

/* Streaming detokenizer: feed ids one at a time and get back only complete
 * UTF-8 characters, holding partial sequences until the next token completes
 * them (a multi-byte character split across tokens is never emitted broken).
 * Not thread-safe per object; one per sequence. */
typedef struct cs_detok {
    const cs_tokenizer *tok;
    bool skip_special;
    uint8_t pending[8]; /* bytes of an incomplete UTF-8 character */
    int n_pending;
} cs_detok;
void cs_detok_init(cs_detok *d, const cs_tokenizer *tok, bool skip_special);
/* Appends the text completed by token id to out (capacity out_cap, which must
 * be at least the token's byte length + 8). Sets *out_len. CS_EINVAL for a bad
 * id, CS_ERANGE when out_cap is too small. */
int cs_detok_push(cs_detok *d, int32_t id, char *out, size_t out_cap, size_t *out_len);
/* Flushes pending bytes at end of stream (as U+FFFD if incomplete). */
int cs_detok_flush(cs_detok *d, char *out, size_t out_cap, size_t *out_len);

/* Chat template. Messages are (role, content) pairs. The tokenizer knows the
 * model's template from its metadata; supported families: ChatML (SmolLM2,
 * Qwen), Llama-3. end: how the text ends (CS_CHAT_CLOSED: after the last
 * message's end marker, as add_generation_prompt false; CS_CHAT_GENERATION_PROMPT:
 * then the assistant's header; CS_CHAT_CONTINUE: the last message without its
 * end marker, so the model continues it). On success *text is malloc'd.
 * CS_ENOTSUP (with cs_last_error() naming the template) when the model's
 * template is not one we support; CS_EINVAL for a bad role or end. */
typedef struct {
    const char *name;
    const char *arguments; /* a JSON object as text */
} cs_chat_tool_call;
typedef struct {
    const char *role;    /* system, user, assistant, tool */
    const char *content; /* "" for an assistant message with only tool calls */
    const cs_chat_tool_call *tool_calls; /* assistant messages: n_tool_calls calls */
    size_t n_tool_calls;
} cs_chat_message;
typedef enum {
    CS_CHAT_CLOSED = 0,
    CS_CHAT_GENERATION_PROMPT = 1,
    CS_CHAT_CONTINUE = 2
} cs_chat_end;
int cs_tokenizer_apply_chat(const cs_tokenizer *tok, const cs_chat_message *msgs, size_t n_msgs,
                            cs_chat_end end, char **text);
/* The same with tools (n_tools tool objects as JSON text) offered to the
 * model. ChatML templates only: Qwen2.5's tools section byte for byte as its
 * template renders it (tools and arguments printed as Python's json.dumps
 * does); other ChatML templates (SmolLM2) get the same section after their
 * system message (docs/tools.md). Tool calls and tool messages render as
 * Qwen2.5's <tool_call> and <tool_response> blocks, with or without tools.
 * CS_EINVAL for a tool or arguments that are not JSON objects; CS_ENOTSUP
 * for tools with a Llama-3 template. */
int cs_tokenizer_apply_chat_tools(const cs_tokenizer *tok, const cs_chat_message *msgs,
                                  size_t n_msgs, const char *const *tools, size_t n_tools,
                                  cs_chat_end end, char **text);

#ifdef __cplusplus
}
#endif
#endif
