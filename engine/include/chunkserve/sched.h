/* chunkserve/sched.h: the stall-free step scheduler both pools run
 * (Sarathi-Serve style; architecture.md, scheduling). Each step spends a
 * token budget: first one token for every running decode, then chunks of
 * waiting prompts in arrival order fill what is left; a prompt that does not
 * fit continues next step. Sequences join and leave every step (continuous batching). Pages are
 * reserved as tokens need them; when a decode finds none, the newest running
 * sequence is preempted (its pages freed, recomputed later from its tokens).
 * Full pages are shared between prompts with the same prefix (prefix cache).
 * Single-threaded: the engine thread owns it (see chunkserve/serve.h for the
 * thread-safe serving loop around it). */
#ifndef CHUNKSERVE_SCHED_H
#define CHUNKSERVE_SCHED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkserve/engine.h"
#include "chunkserve/grammar.h"
#include "chunkserve/sampler.h"
#include "chunkserve/stop.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int32_t max_num_batched_tokens;   /* step budget; 0 = unlimited (whole prompts, no chunking) */
    int32_t max_num_seqs;             /* running sequences at most; default 256 */
    int32_t max_num_partial_prefills; /* prompts part-way through prefill at once; default 4 */
    int32_t max_chunk_tokens;         /* one prompt's chunk per step at most (vLLM's
                                         long_prefill_token_threshold); 0 = the budget. A prefill
                                         worker sets it so pages stream while the next chunk computes */
    bool enable_prefix_caching;       /* default true */
    double step_time_target_ms;       /* > 0: size each step's prompt chunks so that the step's
                                         predicted time (chunkserve/step_model.h, fitted from this
                                         engine's measured steps) stays within it; decodes still
                                         go first and the token budget still caps the step. Until
                                         the model is ready a chunk is capped by a probe size that
                                         starts at one page, doubles after a step under half the
                                         target and halves after one over it (at most
                                         CS_SCHED_PROBE_TOKENS); a step with no chunk yet always
                                         gets one page's worth, so prompts make progress. Any
                                         split is exact (chunkserve/engine.h). 0 = off */
    int32_t num_speculative_tokens;   /* > 0: speculative decoding with prompt-lookup (n-gram)
                                         drafts: a decode whose last tokens occurred before in
                                         its context proposes up to this many of the tokens
                                         that followed them, and one step verifies them all
                                         (speculation, below); at most CS_SCHED_SPEC_MAX.
                                         0 = off */
    bool speculative_always;          /* draft whenever a draft is found, whatever the step
                                         model predicts it costs (tests, benchmarks) */
    cs_engine *draft_engine;          /* with num_speculative_tokens: drafts come from this
                                         engine's model (a draft model with the target's
                                         vocabulary; speculation, below) instead of prompt
                                         lookup. Must outlive the scheduler; NULL: prompt
                                         lookup */
    const struct cs_tenant_share *tenant_shares; /* tenants' weights (copied at init); a
                                         tenant not named weighs 1 (tenants, below) */
    int32_t n_tenant_shares;
} cs_sched_params;

/* Tenants: token-fair steps. Each request belongs to a tenant (cs_request.
 * tenant; "" is the default tenant). The scheduler counts, per tenant, the
 * tokens it computed for it (prompt chunks, decodes, drafts) divided by the
 * tenant's weight: its virtual tokens. Among the candidates for a prompt
 * chunk of the best priority (each tenant's running prompt, else its oldest
 * waiting one), the one whose tenant would have the fewest virtual tokens
 * once the chunk it would get now is charged goes first (virtual finish:
 * weighted fair queueing; a tenant's short prompts arriving together all
 * start beside another tenant's long chunk, until their tenant is a chunk
 * ahead); at equal finish the tenant with fewer virtual tokens goes first,
 * then the one active since later (below). A tenant's own prompts keep the
 * order without tenants (running first, then arrival). Decodes keep their
 * precedence, and a tenant with nothing to run takes nothing: the budget goes
 * to the others (work-conserving). A tenant that had no live request when
 * one arrives starts at the fewest virtual tokens among the active tenants,
 * or when none is active at the count of the last one to leave (if it had
 * fewer), so being idle saves no credit (VTC, Sheng et al., OSDI '24); at
 * equal counts the tenant that became active last goes first (a chat
 * turn arriving beside a flood gets the next step's chunk, not the one
 * after). A prompt due before every running prompt of another tenant (by
 * the rule above; a running one already chunked this step at its count
 * now, one this step finishes not counted) may take one prompt seat beyond
 * max_num_partial_prefills (one in all). Tenants are what the doors
 * say: the API key's when keys are configured (api/auth.h), else the
 * request's own field. With one tenant this is the order without tenants. */
typedef struct cs_tenant_share {
    const char *name;   /* 1..CS_TENANT_NAME_MAX bytes */
    double weight;      /* share: [CS_TENANT_SHARE_MIN, CS_TENANT_SHARE_MAX] */
} cs_tenant_share;
enum { CS_TENANT_NAME_MAX = 64 };
#define CS_TENANT_SHARE_MIN 1e-3
#define CS_TENANT_SHARE_MAX 1e6

/* Speculation. A draft is checked by sampling each of its positions' logits
 * with the request's own sampler, in order, and keeping the drafted tokens
 * while they equal what was sampled; the first that differs is replaced by
 * the sampled token, and the step ends the sequence's tokens there. The
 * sampler's randomness depends only on (seed, tokens generated) and the
 * kernels' bits do not depend on a step's shape, so every emitted token,
 * its logprobs and the sampler's state are exactly those of decoding one
 * token a step: greedy and seeded output are byte-identical with and
 * without speculation, and the output distribution is the model's. (For a
 * draft that is one token, this is the standard rejection rule: the draft
 * d is kept with probability p(d), else a token is drawn from p without
 * d.) Drafts ride after the step's decodes and prompt chunks, within the
 * token budget. Until the step model is first fitted a step carries at
 * most max(num_speculative_tokens, decodes) drafts (a probe, not weighed
 * against the step-time target: nothing predicts its time yet); once it
 * is, a sequence gets the number of drafts (up to num_speculative_tokens)
 * that maximizes the step's expected decode tokens per predicted second,
 * from its recent acceptance rate, within the step-time target, and none
 * when they would not pay. The prediction is a linear fit, and a CPU's
 * step time is not linear in a few tokens (a few drafts can pay a tile's
 * jump for little where many pay it well), so with prompt lookup, once the
 * model is fitted and with 8 decodes or more, a step of decodes alone
 * carries every draft found (of sequences whose acceptance is not low,
 * within the step-time target) or none, by measurement: for each such
 * decode batch size, the decode tokens a second that decode-only steps
 * served with drafts and without; the one that served more, and now and
 * then the other again (as rarely as keeps those retries' cost near 1% of
 * the time: every 16 to 256 steps of that size); a step with prompt chunks
 * drafts by the rule unless plain steps served more (engine/src/spec_gate.h).
 * speculative_always skips the rule and the gate.
 *
 * A draft model (draft_engine) runs in the same step, on this thread, before
 * the target: one pass computes the draft KV a sequence lacks (its context
 * after a prefill, a migration or a preemption: in chunks of at most the
 * step's room, proposing nothing until it is caught up) with its decode
 * token and proposes its first draft, each further pass feeds the last
 * draft and proposes the next (the draft model's argmax: the check above
 * keeps the output the target's). Its pages are its own pool's, given back
 * with the sequence's. The cost rule counts the draft's measured time: a
 * pass a step for the most drafts any sequence gets (a sequence's
 * catch-up is not weighed: it is paid once, like a prompt chunk). The gate
 * above is prompt lookup's only: after plain steps a draft model's KV
 * lags, and its catch-up would be charged to the drafting side. */
enum { CS_SCHED_NGRAM_MAX = 4, CS_SCHED_NGRAM_MIN = 1, CS_SCHED_SPEC_MAX = 16 };
/* Drafted tokens a step verifies at most (each is a logits row: with no
 * token budget, this bounds the step's logits buffer). */
enum { CS_SCHED_DRAFT_ROWS = 1024 };

enum { CS_SCHED_PROBE_TOKENS = 256 };
/* Prompt positions whose logits one step computes for prompt_logprobs, at
 * most (bounds the step's logits buffer: rows * n_vocab floats). */
enum { CS_SCHED_PROMPT_LOGPROB_ROWS = 128 };
/* Compiled structured-output grammars kept per scheduler (least recently used out). */
enum { CS_SCHED_GRAMMARS = 32 };

cs_sched_params cs_sched_params_default(void);

/* Where a request's prompt KV comes from (architecture.md, request flow). */
enum cs_kv_mode {
    CS_KV_LOCAL = 0,    /* computed here in chunks, then decoded here (default) */
    CS_KV_PREFILL_ONLY, /* prefill worker: compute the prompt, report each step's
                         * completed pages (cs_event.kv_pages), sample one token,
                         * finish with CS_FINISH_LENGTH (no stop rules, no text) */
    CS_KV_REMOTE,       /* decode worker: the pages are reserved at add (as with
                         * reserve) and filled from outside (cs_engine_kv_import
                         * on cs_sched_kv_pages); the sequence joins the running
                         * batch at cs_sched_kv_ready with the first token */
};

typedef struct {
    uint64_t id;           /* the caller's id; unique among live requests */
    const int32_t *prompt; /* (n_prompt) token ids; copied. With n_resumed > 0, the
                             last n_resumed of them were generated earlier */
    int32_t n_prompt;
    int32_t n_resumed; /* migration: tokens at the end of prompt[] already
                          generated (and streamed) elsewhere: they count toward
                          max_tokens and usage, the sampler's penalties and the
                          stop checker see them as generated; the next event is
                          the token after them. 0 normally */
    cs_sampling_params sampling;
    cs_stop_params stop;         /* max_tokens, stop strings and ids, ignore_eos; copied */
    bool logprobs;               /* report the chosen tokens' log-probabilities */
    int32_t top_logprobs;        /* with logprobs: the most likely alternatives per token to
                                    report, 0..CS_MAX_TOP_LOGPROBS */
    bool prompt_logprobs;        /* report each prompt token's log-probability given the
                                    tokens before it (vLLM's prompt_logprobs; not for
                                    resumed requests): the prompt is computed whole, never
                                    from the prefix cache, in chunks of at most
                                    CS_SCHED_PROMPT_LOGPROB_ROWS tokens a step. CS_KV_REMOTE
                                    ignores it (the prefill side computes them) */
    int32_t prompt_top_logprobs; /* with prompt_logprobs: alternatives per token, 0..20 */
    bool disable_speculation;    /* no drafts for this request (the output is the same) */
    int32_t priority;            /* lower first (vLLM's), 0..CS_MAX_PRIORITY; ties by arrival:
                                    the order of admission, prompt chunks, decodes and
                                    preemption (the lowest priority, newest, goes first) */
    enum cs_kv_mode kv_mode;
    bool reserve;             /* reserve the prompt's pages at add, all or nothing:
                                 CS_ENOSPC when they are not free now (admission by
                                 free pages); implied by CS_KV_REMOTE */
    const char *cache_salt;   /* the prefix cache's namespace: only requests with the same
                                 salt share cached pages (it seeds the page hash chain, so
                                 cached-token counts tell nothing across salts); NULL or ""
                                 = the shared namespace. Hashed at add, not kept */
    cs_structured structured; /* structured output (chunkserve/grammar.h): kind NONE = none.
                                 Borrowed; compiled at add (grammars are shared by equal
                                 specs, with their mask caches); resumed tokens must follow it */
    const char *tenant;       /* whose request (tenants, above): NULL or "" = the default
                                 tenant; at most CS_TENANT_NAME_MAX bytes; copied */
    const _Atomic bool *held; /* optional, the caller's, alive until the request ends:
                                 while it reads true the request gets no further prompt
                                 chunk (the others keep running; what it holds stays). A
                                 prefill worker holds a request whose KV channel is
                                 full. A scheduler whose running requests are all held
                                 is idle; whoever clears it wakes the loop
                                 (cs_serve_wake) */
} cs_request;

/* What a step produced for one request. */
typedef struct {
    uint64_t id;
    int32_t token;         /* the new token, -1 when none (cancel, error) */
    cs_logprobs lp;        /* when requested: the token's log-probability, alternatives */
    const char *text;      /* text that became final with this token; "" if none */
    enum cs_finish finish; /* CS_FINISH_NONE while the request goes on */
    /* with CS_FINISH_STOP, what ended it (cs_stop_matched_*): the stop string (valid as
     * long as text), or the stop_token_ids entry; else NULL and -1 */
    const char *stop_string;
    int32_t stop_token;
    int32_t n_prompt_tokens, n_completion_tokens;
    const char *error; /* with CS_FINISH_ERROR: what went wrong */
    int32_t status;    /* with CS_FINISH_ERROR: the CS_E* code (CS_ENOSPC: no room now) */
    int32_t
        n_cached_prompt_tokens; /* prompt tokens taken from the prefix cache at first admission */
    /* CS_KV_PREFILL_ONLY: the pages of the blocks this step completed (the
     * last partial block's come with the final event): entries [kv_first_page,
     * kv_first_page + kv_n_pages) of the prompt's KV transfer order
     * (kv_cache.h's cs_page_table_xfer: every global page, the windowed pages
     * of the last window only, so some blocks report fewer); their ids in
     * kv_pages. The pages stay allocated and unchanged until the next
     * cs_sched_step. Such an event may carry no token.
     * (cs_serve also uses these fields for its admission event: see serve.h.) */
    const int32_t *kv_pages;
    int32_t kv_first_page, kv_n_pages;
    /* prompt_logprobs, on the event of the first token sampled after the prompt:
     * prompt tokens 1..n_prompt-1 (the first has no context), in order; valid
     * until the next step. NULL otherwise */
    const cs_prompt_logprob *prompt_lp;
    int32_t n_prompt_lp;
} cs_event;

/* What the last step did (for tests, metrics and benchmarks). */
typedef struct {
    int32_t n_tokens;          /* tokens computed */
    int32_t n_decode;          /* decode spans (one token each) */
    int32_t n_prefill;         /* prompt chunk spans */
    int32_t n_running_decodes; /* running sequences that wanted a decode token */
    int32_t budget;            /* the step's budget (INT32_MAX when unlimited) */
    int32_t n_draft_tokens;    /* speculative drafts verified (counted in n_tokens) */
    double seconds;            /* the step's engine time and sampling, measured (with a
                                  draft model's time) */
    double draft_seconds;      /* of those, the draft model's */
    double predicted_seconds;  /* the step model's prediction for it (NAN: not ready) */
} cs_step_info;

typedef struct {
    uint64_t steps, preemptions, prefix_hit_tokens, prompt_tokens_computed, generated_tokens;
    uint64_t priority_preemptions; /* of those, to seat a request of a higher priority */
    uint64_t requests_finished, requests_cancelled;
    /* speculation: verifications (decodes that carried drafts), drafted
     * tokens, and the drafted tokens that were kept */
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted_tokens;
    int32_t n_running, n_waiting; /* waiting includes remote requests waiting for KV */
    int32_t n_waiting_kv;         /* remote requests whose KV has not arrived */
    int64_t queued_prompt_tokens; /* prompt tokens of live requests not computed yet */
    int32_t kv_pages_total, kv_pages_used,
        kv_pages_cached; /* cached = reusable prefix pages, no reference */
    int32_t page_size, max_num_batched_tokens;
    int32_t num_speculative_tokens; /* the params': 0 = no speculation */
    bool draft_model;               /* drafts come from a draft model (else prompt lookup) */
} cs_sched_stats;

typedef struct cs_sched cs_sched;

/* The engine must outlive the scheduler. CS_EINVAL for bad params. */
int cs_sched_init(cs_engine *e, const cs_sched_params *p, cs_sched **out);
/* Cancels and frees every request (no events). NULL is a no-op. */
void cs_sched_free(cs_sched *s);

/* Queues a request. Checks it first: CS_EINVAL (with a message) for an empty
 * prompt, one that leaves no room in the context for a token, token ids out
 * of the vocabulary, bad sampling or stop parameters, or an id already live;
 * CS_ENOSPC when the prompt could never fit in the whole KV pool. Nothing
 * changes on failure. */
int cs_sched_add(cs_sched *s, const cs_request *r);
/* Cancels a request at any point; its pages are freed now. CS_ENOENT when
 * the id is not live. No event is produced for it. */
int cs_sched_cancel(cs_sched *s, uint64_t id);

/* The pages reserved at add for request id (reserve or CS_KV_REMOTE), while
 * nothing has run for it yet: for a remote request, the ids its KV goes
 * into, in a KV transfer's order (cs_page_table_xfer of its context:
 * cs_kv_cache_seq_pages of them, what the sender sends). The array stays
 * valid until the request runs or ends. CS_ENOENT when the id is not live or
 * has started. */
int cs_sched_kv_pages(cs_sched *s, uint64_t id, const int32_t **pages, int32_t *n_pages);
/* CS_KV_REMOTE: the prompt's KV is in the reserved pages and first_token
 * was sampled by the prefill side (first_lp: its log-probabilities, when the
 * request asked for them; NULL otherwise): at the next step the token goes
 * through the stop rules (its event is emitted) and the sequence joins the
 * running batch. n_cached: prompt tokens the prefill side took from its
 * prefix cache (reported as the request's cached tokens). CS_ENOENT (not
 * waiting for KV), CS_EINVAL (a token outside the vocabulary, n_cached
 * outside 0..prompt, more alternatives than asked: nothing changes). */
int cs_sched_kv_ready(cs_sched *s, uint64_t id, int32_t first_token, int32_t n_cached,
                      const cs_logprobs *first_lp);

/* Runs one step (does nothing when idle). *events/n_events: what happened,
 * valid until the next call. Fails only on an engine error, after which every
 * live request has been finished with CS_FINISH_ERROR in the events. */
int cs_sched_step(cs_sched *s, const cs_event **events, int32_t *n_events);
bool cs_sched_idle(const cs_sched *s);
void cs_sched_last_step(const cs_sched *s, cs_step_info *info);
void cs_sched_get_stats(const cs_sched *s, cs_sched_stats *st);
/* Tokens computed for a tenant ("" the default) since init: prompt chunks,
 * decodes and drafts. 0 for one it does not know (never seen, or not named
 * in the shares and idle since: such tenants are forgotten). */
uint64_t cs_sched_tenant_tokens(const cs_sched *s, const char *tenant);
/* What a request's time to first token is predicted from (chunkserve/
 * ttft.h): the queued prompt work and the prompt rate as of now. */
struct cs_ttft_load;
void cs_sched_ttft_load(const cs_sched *s, struct cs_ttft_load *L);

#ifdef __cplusplus
}
#endif
#endif
