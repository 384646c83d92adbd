/* kvx_tx.c: the KV transport's sender: the control plane for every payload
 * (the channels it rides on are kvx_tx_chan.c's; kvx_tx-impl.h draws the
 * split). One I/O thread polls every channel; API calls only queue work
 * under the mutex and wake it, so the engine's step never waits on the
 * network.
 *
 * Per channel, in order: a FIFO of items (chunks of at most one staging
 * slot, trailers). The head chunks are packed into free slots of the
 * channel's payload link as soon as slots are free (TCP: the chunk's XXH3;
 * NCCL: the gather kernel, overlapping the previous chunk's ncclSend). A
 * packed chunk at the head of the FIFO becomes its data frame on TCP (PAGES
 * with the page bytes written straight from the pool, or a LINK_PAGES
 * descriptor), and once that frame is fully written the link sends the chunk
 * (NCCL: ncclSend, so the receiver posts the matching ncclRecv in the same
 * order). A data frame that reached the socket is always followed by its
 * send, even when its transfer ended meanwhile (the receiver drops the
 * bytes), so the two sides stay matched. Only the I/O thread touches links
 * and slots; slow link calls (open, close, a send waiting for NCCL) run
 * without the mutex. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvx_tx-impl.h"
#include "chunkserve/assert.h"
#include "chunkserve/error.h"
#include "chunkserve/secret.h"
#include "chunkserve/log.h"

cs_kvx_tx_params cs_kvx_tx_params_default(void) {
    cs_kvx_tx_params p;
    memset(&p, 0, sizeof p);
    p.name = "prefill";
    p.checksum = true;
    p.max_queued_bytes = 256u << 20;
    p.keepalive_ms = 1000;
    p.renew_ms = 1000;
    p.dead_ms = 5000;
    p.n_slots = 2;
    p.init_timeout_ms = 30000;
    p.op_timeout_ms = 10000;
    return p; /* max_frame_bytes 0: the payload's default */
}

static void push_event(cs_kvx_tx *tx, tx_event *e) {
    if (tx->ev_tail)
        tx->ev_tail->next = e;
    else
        tx->ev_head = e;
    tx->ev_tail = e;
}

void cs__tx_send_unref(cs_kvx_tx *tx, tx_send *s) {
    if (!s || --s->refs > 0) return;
    tx_event *e = s->ev;
    s->ev = NULL;
    e->send = s;
    push_event(tx, e);
}

/* A data frame dropped before any byte was written frees its slot and its
 * chunk's room: nothing reached the receiver. */
static void drop_out(cs_kvx_tx *tx, tx_chan *ch, kvx_out *o) {
    tx_slot *sl = o->owner;
    if (sl) {
        ch->queued_bytes -= sl->bytes;
        cs__tx_send_unref(tx, sl->send);
        *sl = (tx_slot){0};
    }
    free(o);
}

void cs__tx_xfer_end(cs_kvx_tx *tx, tx_xfer *x, int status, const char *msg) {
    for (tx_xfer **pp = &tx->xfers; *pp; pp = &(*pp)->next)
        if (*pp == x) {
            *pp = x->next;
            break;
        }
    tx_chan *ch = x->ch;
    kvx_out **pp = &ch->qhead, *prev = NULL;
    while (*pp) {
        kvx_out *o = *pp;
        if (o->xfer == x && o->off == 0) {
            *pp = o->next;
            if (ch->qtail == o) ch->qtail = prev;
            drop_out(tx, ch, o);
        } else {
            if (o->xfer == x) o->xfer = NULL;
            prev = o;
            pp = &o->next;
        }
    }
    for (tx_item *it = ch->ihead; it; it = it->next)
        if (it->x == x) it->x = NULL;
    ch->n_xfers--;
    tx->st.transfers_active--;
    if (status == 0)
        tx->st.transfers_completed++;
    else
        tx->st.transfers_failed++;
    tx_event *e = x->ev;
    e->done = x->done;
    e->arg = x->arg;
    e->id = x->id;
    e->status = status;
    snprintf(e->msg, sizeof e->msg, "%s", msg ? msg : "");
    push_event(tx, e);
    if (status)
        CS_LOGW("kvx tx: transfer %llu to %s:%d failed: %s (%s)", (unsigned long long)x->id,
                ch->host, ch->port, cs_strerror(status), msg ? msg : "");
    free(x);
}

void cs__tx_item_pop(tx_chan *ch) {
    tx_item *it = ch->ihead;
    ch->ihead = it->next;
    if (!ch->ihead) ch->itail = NULL;
}

/* Frees an item that never became a frame: its pages leave the queue. */
void cs__tx_item_drop(cs_kvx_tx *tx, tx_chan *ch, tx_item *it) {
    if (it->kind == IT_CHUNK)
        ch->queued_bytes -= (size_t)it->n_pages * (size_t)tx->p.layout.page_bytes;
    cs__tx_send_unref(tx, it->send);
    free(it);
}

tx_xfer *cs__tx_find_xfer(cs_kvx_tx *tx, uint64_t id) {
    for (tx_xfer *x = tx->xfers; x; x = x->next)
        if (x->id == id) return x;
    return NULL;
}

static bool slot_progress(cs_kvx_tx *tx, tx_chan *ch, int i, int64_t now);

/* Packs the first not yet packed chunks into free slots, in order (a pack
 * that finishes at once, as TCP's checksum does, is packed at once). */
static void pack_chunks(cs_kvx_tx *tx, tx_chan *ch) {
    if (!ch->link || ch->fd < 0) return;
    int64_t now = cs__kvx_now_ms();
    for (tx_item *it = ch->ihead; it; it = it->next) {
        if (it->kind != IT_CHUNK || it->slot >= 0) continue;
        if (!it->x) continue; /* ended before its pack: dropped at the head */
        int s = -1;
        for (int i = 0; i < tx->p.n_slots && s < 0; i++)
            if (ch->slots[i].state == SL_FREE) s = i;
        if (s < 0) return;
        char err[200] = "";
        int r = tx->pl->pack(ch->link, s, it->ids, it->n_pages, tx->p.checksum, err, sizeof err);
        if (r) {
            char m[260];
            snprintf(m, sizeof m, "%s pack of pages %d+%d failed: %s", tx->pl->name, it->first_page,
                     it->n_pages, err);
            cs__tx_chan_close(tx, ch, r == CS_ENOMEM ? r : CS_EIO, m);
            return;
        }
        size_t bytes = (size_t)it->n_pages * (size_t)tx->p.layout.page_bytes;
        ch->slots[s] = (tx_slot){SL_PACKING,  it,    it->send, it->ids, it->first_page,
                                 it->n_pages, bytes, 0,        now};
        it->send = NULL; /* the slot holds the reference now */
        it->slot = s;
        if (!slot_progress(tx, ch, s, now)) return;
    }
}

/* Turns packed head chunks into data frames and trailers into TRAILER
 * frames, in FIFO order; drops the items of ended transfers. */
static void emit_items(cs_kvx_tx *tx, tx_chan *ch) {
    while (ch->ihead && ch->fd >= 0) {
        tx_item *it = ch->ihead;
        tx_xfer *x = it->x;
        if (it->kind == IT_CHUNK) {
            tx_slot *sl = it->slot >= 0 ? &ch->slots[it->slot] : NULL;
            if (sl && sl->state == SL_PACKING) return; /* its pack still reads the pages */
            if (!x) {
                if (sl) {
                    cs__tx_send_unref(tx, sl->send);
                    *sl = (tx_slot){0};
                }
                cs__tx_item_pop(ch);
                cs__tx_item_drop(tx, ch, it);
                continue;
            }
            if (!sl || !cs__tx_link_ready(ch)) return;
            kvx_out *o = cs__tx_new_out(ch);
            if (!o) return;
            if (tx->pl->inline_pages) { /* PAGES: the bytes follow, from the pool */
                o->type = CS_KVX_PAGES;
                o->xfer_id = x->id;
                o->h.type = CS_KVX_PAGES;
                o->h.epoch = tx->p.incarnation;
                o->h.xfer_id = x->id;
                o->h.fingerprint = tx->fingerprint;
                o->h.payload_len = sl->bytes;
                if (tx->p.checksum) o->h.flags = CS_KVX_FLAG_CHECKSUM, o->h.payload_xxh64 = sl->sum;
                o->base = tx->p.pool.base;
                o->ids = sl->ids;
                o->n_pages = sl->n_pages;
                o->page_bytes = (size_t)tx->p.layout.page_bytes;
                o->total = CS_KVX_HDR_BYTES + sl->bytes;
            } else { /* LINK_PAGES: a descriptor; the bytes follow over the link */
                cs_kvx_link_desc d = {sl->bytes, sl->sum, tx->p.checksum ? CS_KVX_DESC_SUM : 0};
                uint8_t pl[CS_KVX_LINK_DESC_BYTES];
                cs_kvx_link_desc_encode(&d, pl);
                cs__kvx_out_ctl(o, CS_KVX_LINK_PAGES, tx->p.incarnation, x->id, tx->fingerprint, pl,
                                sizeof pl);
            }
            o->h.first_page = (uint32_t)sl->first_page;
            o->h.n_pages = (uint32_t)sl->n_pages;
            cs_kvx_hdr_encode(&o->h, o->hdr);
            o->owner = sl;
            o->xfer = x;
            cs__tx_enqueue(ch, o);
            if (tx->p.checksum) cs__kvx_fold(&x->digest, sl->sum);
            sl->state = SL_QUEUED;
            sl->item = NULL;
            it->slot = -1; /* the slot now belongs to the frame */
            cs__tx_item_pop(ch);
            free(it);
            continue;
        }
        /* trailer: every data frame of its transfer is ahead of it; its MAC
         * needs the session key */
        if (!ch->authed) return;
        if (x) {
            cs_kvx_trailer_wire tw;
            memset(&tw, 0, sizeof tw);
            tw.t = it->t;
            tw.xxh64 = tx->p.checksum ? x->digest : 0;
            uint8_t pl[CS_KVX_TRAILER_BYTES];
            cs_kvx_trailer_encode(&tw, pl);
            cs__kvx_trailer_mac(ch->session, x->id, pl, pl + CS_KVX_TRAILER_MAC_AT);
            kvx_out *o = cs__tx_new_out(ch);
            if (!o) return;
            cs__kvx_out_ctl(o, CS_KVX_TRAILER, tx->p.incarnation, x->id, tx->fingerprint, pl,
                            sizeof pl);
            o->xfer = x;
            cs__tx_enqueue(ch, o);
        }
        cs__tx_item_pop(ch);
        cs__tx_item_drop(tx, ch, it);
    }
}

/* Progress of slot i's running operation (pack or send): finished ones move
 * on, ones past op_timeout_ms close the channel. Returns false when the
 * channel closed. */
static bool slot_progress(cs_kvx_tx *tx, tx_chan *ch, int i, int64_t now) {
    tx_slot *sl = &ch->slots[i];
    if (sl->state != SL_PACKING && sl->state != SL_SENDING) return true;
    char err[200] = "", m[300];
    uint64_t sum = 0;
    int r = tx->pl->query(ch->link, i, &sum, err, sizeof err);
    if (r < 0) {
        snprintf(m, sizeof m, "%s %s to %s:%d failed: %s", tx->pl->name,
                 sl->state == SL_PACKING ? "pack" : "send", ch->host, ch->port, err);
        cs__tx_chan_close(tx, ch, CS_EIO, m);
        return false;
    }
    if (r == 1) {
        if (now - sl->since <= tx->p.op_timeout_ms) return true;
        snprintf(m, sizeof m, "%s %s of a %zu-byte chunk to %s:%d not complete after %d ms",
                 tx->pl->name, sl->state == SL_PACKING ? "pack" : "send", sl->bytes, ch->host,
                 ch->port, tx->p.op_timeout_ms);
        cs__tx_chan_close(tx, ch, CS_ETIMEDOUT, m);
        return false;
    }
    if (sl->state == SL_PACKING) {
        sl->state = SL_PACKED;
        sl->sum = sum;
        if (!tx->pl->inline_pages) { /* copied to staging: the pages may be reused now */
            cs__tx_send_unref(tx, sl->send);
            sl->send = NULL;
        }
    } else {
        *sl = (tx_slot){0};
    }
    return true;
}

/* Polls the link: init progress, async errors, finished packs and sends.
 * Returns false when the channel closed. */
static bool link_poll(cs_kvx_tx *tx, tx_chan *ch, int64_t now) {
    char err[200] = "", m[300];
    int r = tx->pl->state(ch->link, err, sizeof err);
    if (r < 0) {
        snprintf(m, sizeof m, "%s link with %s:%d failed: %s", tx->pl->name, ch->host, ch->port,
                 err);
        cs__tx_chan_close(tx, ch, CS_ECONNRESET, m);
        return false;
    }
    if (r == 0) ch->local_ready = true;
    if (!cs__tx_link_ready(ch) && now > ch->init_deadline) {
        snprintf(m, sizeof m, "%s link with %s:%d not ready after %d ms (%s)", tx->pl->name,
                 ch->host, ch->port, tx->p.init_timeout_ms,
                 ch->local_ready ? "no LINK_READY from the receiver" : "init in progress");
        cs__tx_chan_close(tx, ch, CS_ETIMEDOUT, m);
        return false;
    }
    for (int i = 0; i < tx->p.n_slots; i++)
        if (!slot_progress(tx, ch, i, now)) return false;
    return true;
}

static bool link_busy(const cs_kvx_tx *tx, const tx_chan *ch) {
    if (!ch->link || tx->pl->inline_pages) return false; /* inline: progress is the socket's */
    if (!cs__tx_link_ready(ch) || ch->ihead) return true;
    for (int i = 0; i < tx->p.n_slots; i++)
        if (ch->slots[i].state != SL_FREE) return true;
    return false;
}

/* A data frame was fully written: the link sends its chunk. Without the
 * mutex: a first ncclSend may wait for the connection to the peer
 * (ncclInProgress, bounded by op_timeout_ms). Only this thread touches the
 * link, the slots and the out queue, so nothing moves meanwhile. */
void cs__tx_post_send(cs_kvx_tx *tx, tx_chan *ch, tx_slot *sl) {
    char err[200] = "";
    int i = (int)(sl - ch->slots);
    cs__kvx_link *link = ch->link;
    size_t bytes = sl->bytes;
    if (!tx->pl->inline_pages) pthread_mutex_unlock(&tx->mu);
    int r = tx->pl->send(link, i, bytes, err, sizeof err);
    if (!tx->pl->inline_pages) pthread_mutex_lock(&tx->mu);
    ch->queued_bytes -= bytes;
    /* counted when handed to the socket or NCCL: by the receiver's DONE
     * every chunk of it is counted */
    tx->st.bytes += bytes;
    if (tx->pl->inline_pages) { /* written: the pages may be reused now, the slot too */
        cs__tx_send_unref(tx, sl->send);
        *sl = (tx_slot){0};
    }
    if (r) {
        char m[300];
        snprintf(m, sizeof m, "%s send to %s:%d failed: %s", tx->pl->name, ch->host, ch->port, err);
        cs__tx_chan_close(tx, ch, r == CS_ETIMEDOUT ? r : CS_ECONNRESET, m);
        return;
    }
    if (tx->pl->inline_pages) return;
    sl->state = SL_SENDING;
    sl->since = cs__kvx_now_ms();
}

/* Packs, emits and writes as far as the socket and the slots allow. With
 * an inline payload a written frame frees its slot at once, so this goes
 * round while the socket takes everything and chunks are waiting. */
static void pump(cs_kvx_tx *tx, tx_chan *ch) {
    for (;;) {
        pack_chunks(tx, ch);
        if (ch->fd >= 0) emit_items(tx, ch);
        if (ch->fd >= 0 && ch->state == CH_OPEN && ch->qhead)
            cs__tx_chan_write(tx, ch); /* frames go out at once */
        if (ch->fd < 0 || ch->state != CH_OPEN || ch->qhead || !ch->ihead ||
            !tx->pl->inline_pages || !cs__tx_link_ready(ch))
            return;
        bool free_slot = false;
        for (int i = 0; i < tx->p.n_slots; i++)
            free_slot |= ch->slots[i].state == SL_FREE;
        if (!free_slot) return;
    }
}

/* Room again on ch: the transfers whose send was refused hear it once. */
static void room_check(cs_kvx_tx *tx, tx_chan *ch) {
    if (ch->queued_bytes > tx->p.max_queued_bytes / 2) return;
    for (tx_xfer *x = tx->xfers; x; x = x->next)
        if (x->ch == ch && x->want_room && !x->fail) {
            if (!tx->p.room) {
                x->want_room = false;
                continue;
            }
            tx_event *e = calloc(1, sizeof *e);
            if (!e) continue; /* still wanted: the next room check tells it */
            x->want_room = false;
            e->room = tx->p.room;
            e->arg = x->arg;
            e->id = x->id;
            push_event(tx, e);
        }
}

static void run_events(cs_kvx_tx *tx) {
    tx_event *e = tx->ev_head;
    tx->ev_head = tx->ev_tail = NULL;
    pthread_mutex_unlock(&tx->mu);
    while (e) {
        tx_event *n = e->next;
        if (e->send) {
            if (e->send->release) e->send->release(e->send->arg, e->send->ids, e->send->n);
            free(e->send);
        }
        if (e->room) e->room(e->arg, e->id);
        if (e->done) e->done(e->arg, e->id, e->status, e->msg, NULL);
        free(e);
        e = n;
    }
    pthread_mutex_lock(&tx->mu);
}

static void queue_abort(cs_kvx_tx *tx, tx_xfer *x, int status) {
    if (x->ch->fd < 0) return;
    uint8_t pl[CS_KVX_STATUS_BYTES];
    cs_kvx_status_encode(status, pl);
    cs__tx_queue_ctl(tx, x->ch, CS_KVX_ABORT, x->id, pl, sizeof pl);
}

/* Renewals: every unfinished transfer of c names itself in a PING every
 * renew_ms, so the receiver keeps its reservation while this side lives
 * (the prompt may still wait in the prefill queue). */
static void renew(cs_kvx_tx *tx, tx_chan *c, int64_t now) {
    if (c->n_xfers == 0) return;
    for (tx_xfer *x = tx->xfers; x; x = x->next)
        if (x->ch == c && !x->trailer_queued && !x->fail && now - x->renewed >= tx->p.renew_ms) {
            cs__tx_queue_ctl(tx, c, CS_KVX_PING, x->id, NULL, 0);
            x->renewed = now;
        }
}

/* Channels whose session key was rotated out, once their last transfer
 * ended: closed and freed (a new transfer to that receiver opened a new
 * channel, under the new key). */
static void bury_retired(cs_kvx_tx *tx) {
    for (tx_chan **pp = &tx->chans; *pp;) {
        tx_chan *c = *pp;
        if (!c->retired || c->n_xfers > 0) {
            pp = &c->next;
            continue;
        }
        CS_LOGI("kvx tx: closing the channel to %s:%d: its cluster secret was rotated out", c->host,
                c->port);
        cs__tx_chan_close(tx, c, CS_ECONNRESET, "cluster secret rotated");
        *pp = c->next;
        free(c->slots);
        free(c);
    }
}

static void *tx_thread(void *arg) {
    cs_kvx_tx *tx = arg;
    cs_log_set_role("kvx-tx");
    pthread_mutex_lock(&tx->mu);
    struct pollfd *pfds = NULL;
    tx_chan **pch = NULL;
    int cap = 0;
    while (!tx->stop) {
        int64_t now = cs__kvx_now_ms();
        int64_t wait = tx->p.keepalive_ms;
        if (tx->xfers && tx->p.renew_ms > 0 && tx->p.renew_ms < wait) wait = tx->p.renew_ms;
        bool busy = false;
        /* failures requested by API calls, deadlines */
        for (tx_xfer *x = tx->xfers, *nx; x; x = nx) {
            nx = x->next;
            if (x->fail) {
                if (x->fail == CS_ECANCELED) queue_abort(tx, x, CS_ECANCELED);
                cs__tx_xfer_end(tx, x, x->fail,
                                x->fail == CS_ECANCELED ? "aborted by the sender" : NULL);
            } else if (now >= x->deadline) {
                queue_abort(tx, x, CS_ETIMEDOUT);
                cs__tx_xfer_end(tx, x, CS_ETIMEDOUT, "sender deadline expired");
            } else if (x->deadline - now < wait) {
                wait = x->deadline - now;
            }
        }
        bury_retired(tx);
        int n = 1, nch = 0;
        for (tx_chan *c = tx->chans; c; c = c->next)
            nch++;
        if (nch + 1 > cap) {
            cap = 2 * (nch + 1);
            pfds = realloc(pfds, (size_t)cap * sizeof *pfds);
            pch = realloc(pch, (size_t)cap * sizeof *pch);
            CS_ASSERT(pfds && pch);
        }
        pfds[0].fd = tx->wake[0];
        pfds[0].events = POLLIN;
        for (tx_chan *c = tx->chans; c; c = c->next) {
            if (c->state == CH_IDLE && c->n_xfers > 0) cs__tx_chan_connect(tx, c);
            if (c->fd < 0) continue;
            if (c->oom) {
                cs__tx_chan_close(tx, c, CS_ENOMEM, "the sender ran out of memory for a frame");
                continue;
            }
            if (now - c->last_rx > tx->p.dead_ms) {
                char m[128];
                snprintf(m, sizeof m, "receiver %s:%d silent for %d ms", c->host, c->port,
                         tx->p.dead_ms);
                cs__tx_chan_close(tx, c, CS_ECONNRESET, m);
                continue;
            }
            if (c->link && !link_poll(tx, c, now)) continue;
            pump(tx, c);
            if (c->fd < 0) continue;
            if (c->state == CH_OPEN && !c->qhead && now - c->last_tx >= tx->p.keepalive_ms &&
                c->acked)
                cs__tx_queue_ctl(tx, c, CS_KVX_PING, 0, NULL, 0);
            if (c->state == CH_OPEN && c->acked && tx->p.renew_ms > 0) renew(tx, c, now);
            if (c->state == CH_OPEN && cs__tx_head_writable(c)) cs__tx_chan_write(tx, c);
            if (c->fd < 0) continue;
            room_check(tx, c);
            busy |= link_busy(tx, c);
            pfds[n].fd = c->fd;
            pfds[n].events =
                POLLIN | (c->state == CH_CONNECTING || cs__tx_head_writable(c) ? POLLOUT : 0);
            pch[n++] = c;
        }
        /* report first: tearing a link down (ncclCommAbort, stream drain)
         * may take a while */
        if (tx->ev_head) {
            run_events(tx);
            continue;
        }
        if (tx->grave) {
            cs__tx_bury(tx);
            continue;
        }
        pthread_mutex_unlock(&tx->mu);
        /* GPU work cannot wake poll(): while a link has work in flight, poll
         * it every 200 us. */
        struct timespec ts;
        if (busy)
            ts = (struct timespec){0, 200000};
        else
            ts = (struct timespec){(wait < 1 ? 1 : wait) / 1000,
                                   ((wait < 1 ? 1 : wait) % 1000) * 1000000L};
        int pr = ppoll(pfds, (nfds_t)n, &ts, NULL);
        pthread_mutex_lock(&tx->mu);
        if (pr < 0) continue;
        if (pfds[0].revents) cs__kvx_drain(tx->wake[0]);
        for (int i = 1; i < n; i++) {
            tx_chan *c = pch[i];
            short rev = pfds[i].revents;
            if (!rev || c->fd != pfds[i].fd) continue;
            if (c->state == CH_CONNECTING && (rev & (POLLOUT | POLLERR | POLLHUP))) {
                int soerr = 0;
                socklen_t sl = sizeof soerr;
                getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
                if (soerr) {
                    char m[160];
                    snprintf(m, sizeof m, "cannot connect to %s:%d: %s", c->host, c->port,
                             strerror(soerr));
                    cs__tx_chan_close(tx, c, CS_ECONNREFUSED, m);
                    continue;
                }
                c->state = CH_OPEN;
            }
            if (rev & (POLLIN | POLLERR | POLLHUP)) cs__tx_chan_read(tx, c);
            if (c->fd >= 0 && (rev & POLLOUT)) cs__tx_chan_write(tx, c);
            if (c->fd >= 0) pump(tx, c);
            if (c->fd >= 0) room_check(tx, c);
        }
        run_events(tx);
    }
    pthread_mutex_unlock(&tx->mu);
    free(pfds);
    free(pch);
    return NULL;
}

int cs__kvx_tx_init_payload(const cs_kvx_tx_params *p, const cs__kvx_payload *pl, cs_kvx_tx **out) {
    *out = NULL;
    bool printable = p && p->name;
    for (const char *c = p && p->name ? p->name : ""; *c; c++)
        printable &= *c >= 0x21 && *c <= 0x7e;
    if (!p || !pl || !printable || !p->name[0] || strlen(p->name) >= CS_KVX_NAME_MAX ||
        p->layout.page_bytes == 0 || (!pl->inline_pages && p->layout.page_bytes % 8) ||
        p->keepalive_ms <= 0 || p->dead_ms <= p->keepalive_ms || !p->pool.base ||
        p->pool.n_pages < 1 || p->pool.kind != pl->pool_kind || p->n_slots < 1 || p->n_slots > 64 ||
        p->init_timeout_ms <= 0 || p->op_timeout_ms <= 0 ||
        (p->max_frame_bytes && p->max_frame_bytes < p->layout.page_bytes))
        return cs_fail(
            CS_EINVAL,
            "kvx tx: bad parameters (name, page_bytes (a multiple of 8 for NCCL), keepalive_ms < "
            "dead_ms, a pool of the payload's kind, n_slots, timeouts, max_frame_bytes >= "
            "page_bytes)");
    cs_kvx_tx *tx = calloc(1, sizeof *tx);
    if (!tx) return cs_fail(CS_ENOMEM, "kvx tx: out of memory");
    tx->p = *p;
    tx->pl = pl;
    snprintf(tx->name, sizeof tx->name, "%s", p->name);
    tx->p.name = tx->name;
    if (!tx->p.max_frame_bytes) tx->p.max_frame_bytes = pl->inline_pages ? 4u << 20 : 32u << 20;
    if (tx->p.max_frame_bytes < p->layout.page_bytes) tx->p.max_frame_bytes = p->layout.page_bytes;
    uint64_t per = tx->p.max_frame_bytes / p->layout.page_bytes;
    tx->slot_pages = per > (uint64_t)INT32_MAX ? INT32_MAX : (int32_t)per;
    if (!tx->p.incarnation) tx->p.incarnation = cs__kvx_incarnation();
    cs__kvx_keys_set(&tx->keys, p->secret);
    tx->p.secret = NULL;
    tx->fingerprint = cs_kvx_layout_fingerprint(&p->layout);
    int r = cs__kvx_wake_init(tx->wake);
    if (r) goto fail_wake;
    pthread_mutex_init(&tx->mu, NULL);
    if (pthread_create(&tx->thread, NULL, tx_thread, tx) != 0) {
        r = CS_ENOMEM;
        goto fail_thread;
    }
    *out = tx;
    return 0;
fail_thread:
    pthread_mutex_destroy(&tx->mu);
    close(tx->wake[0]);
fail_wake:
    free(tx);
    return cs_fail(r, "kvx tx: cannot start: %s", cs_strerror(r));
}

int cs_kvx_tx_init(const cs_kvx_tx_params *p, cs_kvx_tx **out) {
    *out = NULL;
    const cs__kvx_payload *pl = p ? cs__kvx_payload_for_pool(p->pool.kind) : NULL;
    if (p && !pl)
        return cs_fail(
            p->pool.kind == CS_KVX_POOL_CUDA ? CS_ENOTSUP : CS_EINVAL,
            "kvx tx: no payload for a pool of kind %d in this build (CUDA pools need CUDA + NCCL)",
            p->pool.kind);
    return cs__kvx_tx_init_payload(p, pl, out);
}

void cs_kvx_tx_free(cs_kvx_tx *tx) {
    if (!tx) return;
    pthread_mutex_lock(&tx->mu);
    tx->stop = true;
    cs__kvx_wake(tx->wake[1]);
    pthread_mutex_unlock(&tx->mu);
    pthread_join(tx->thread, NULL);
    pthread_mutex_lock(&tx->mu);
    while (tx->chans) {
        tx_chan *c = tx->chans;
        cs__tx_chan_close(tx, c, CS_ECANCELED, "sender shut down");
        tx->chans = c->next;
        free(c->slots);
        free(c);
    }
    cs__tx_bury(tx);
    run_events(tx);
    pthread_mutex_unlock(&tx->mu);
    pthread_mutex_destroy(&tx->mu);
    close(tx->wake[0]);
    cs_secure_zero(&tx->keys, sizeof tx->keys);
    free(tx);
}

void cs_kvx_tx_set_secret(cs_kvx_tx *tx, const cs_secret *s) {
    pthread_mutex_lock(&tx->mu);
    cs__kvx_keys_set(&tx->keys, s);
    for (tx_chan *c = tx->chans; c; c = c->next)
        if (c->authed && !cs__kvx_keys_have(&tx->keys, &c->key)) c->retired = true;
    cs__kvx_wake(tx->wake[1]);
    pthread_mutex_unlock(&tx->mu);
}

uint64_t cs_kvx_tx_incarnation(const cs_kvx_tx *tx) {
    return tx->p.incarnation;
}

int cs_kvx_tx_payload(const cs_kvx_tx *tx) {
    return tx->pl->kind;
}

int cs_kvx_tx_begin(cs_kvx_tx *tx, const char *host, int port, uint64_t xfer_id,
                    int32_t total_pages, int32_t deadline_ms, cs_kvx_done_fn done, void *arg) {
    if (!host || strlen(host) >= 256 || port <= 0 || port > 65535 || total_pages < 1 ||
        deadline_ms <= 0 || !done)
        return cs_fail(
            CS_EINVAL,
            "kvx tx: bad transfer (host, port, total_pages >= 1, deadline_ms > 0, done)");
    pthread_mutex_lock(&tx->mu);
    int r = 0;
    if (cs__tx_find_xfer(tx, xfer_id)) {
        r = cs_fail(CS_EEXIST, "kvx tx: transfer %llu already open", (unsigned long long)xfer_id);
        goto out;
    }
    tx_chan *ch = cs__tx_find_chan(tx, host, port);
    if (!ch) {
        ch = calloc(1, sizeof *ch);
        tx_slot *slots = calloc((size_t)tx->p.n_slots, sizeof *slots);
        if (!ch || !slots) {
            free(ch), free(slots);
            r = cs_fail(CS_ENOMEM, "kvx tx: out of memory");
            goto out;
        }
        snprintf(ch->host, sizeof ch->host, "%s", host);
        ch->port = port;
        ch->fd = -1;
        ch->slots = slots;
        ch->next = tx->chans;
        tx->chans = ch;
    }
    tx_xfer *x = calloc(1, sizeof *x);
    if (x && !(x->ev = calloc(1, sizeof *x->ev))) free(x), x = NULL;
    if (!x) {
        r = cs_fail(CS_ENOMEM, "kvx tx: out of memory");
        goto out;
    }
    x->id = xfer_id;
    x->ch = ch;
    x->total_pages = total_pages;
    x->deadline = cs__kvx_now_ms() + deadline_ms;
    x->renewed = cs__kvx_now_ms(); /* the reservation is fresh: first renewal in renew_ms */
    x->done = done;
    x->arg = arg;
    x->next = tx->xfers;
    tx->xfers = x;
    ch->n_xfers++;
    tx->st.transfers_started++;
    tx->st.transfers_active++;
    cs__kvx_wake(tx->wake[1]);
out:
    pthread_mutex_unlock(&tx->mu);
    return r;
}

static void item_push(tx_chan *ch, tx_item *it) {
    it->next = NULL;
    if (ch->itail)
        ch->itail->next = it;
    else
        ch->ihead = it;
    ch->itail = it;
}

int cs_kvx_tx_send_pages(cs_kvx_tx *tx, uint64_t xfer_id, int32_t first_page, int32_t n_pages,
                         const int32_t *page_ids, cs_kvx_release_fn release, void *arg) {
    int r = 0;
    tx_send *s = NULL;
    tx_item **items = NULL;
    int32_t nit = 0;
    /* the arguments first: what they are does not depend on the transfer's state */
    if (n_pages < 1 || !page_ids)
        return cs_fail(CS_EINVAL, "kvx tx: transfer %llu: %d pages", (unsigned long long)xfer_id,
                       n_pages);
    for (int32_t i = 0; i < n_pages; i++)
        if (page_ids[i] < 0 || page_ids[i] >= tx->p.pool.n_pages)
            return cs_fail(CS_EINVAL,
                           "kvx tx: transfer %llu: page id %d outside the pool (%d pages)",
                           (unsigned long long)xfer_id, page_ids[i], tx->p.pool.n_pages);
    pthread_mutex_lock(&tx->mu);
    tx_xfer *x = cs__tx_find_xfer(tx, xfer_id);
    if (!x || x->fail || x->trailer_queued) {
        r = cs_fail(CS_ENOENT, "kvx tx: transfer %llu is not open", (unsigned long long)xfer_id);
        goto fail;
    }
    if (first_page != x->queued_pages || n_pages > x->total_pages - x->queued_pages) {
        r = cs_fail(CS_EINVAL, "kvx tx: transfer %llu: pages %d+%d out of order (queued %d of %d)",
                    (unsigned long long)xfer_id, first_page, n_pages, x->queued_pages,
                    x->total_pages);
        goto fail;
    }
    size_t pb = (size_t)tx->p.layout.page_bytes;
    tx_chan *ch = x->ch;
    if (ch->queued_bytes + (size_t)n_pages * pb > tx->p.max_queued_bytes && ch->queued_bytes > 0) {
        x->want_room = true;
        tx->st.room_waits++;
        r = cs_fail(CS_EAGAIN, "kvx tx: channel to %s:%d full (%zu bytes queued)", ch->host,
                    ch->port, ch->queued_bytes);
        goto fail;
    }
    s = malloc(sizeof *s + (size_t)n_pages * sizeof *s->ids);
    if (!s) goto nomem;
    if (!(s->ev = calloc(1, sizeof *s->ev))) goto nomem;
    memcpy(s->ids, page_ids, (size_t)n_pages * sizeof *s->ids);
    s->n = n_pages;
    s->refs = 0;
    s->release = release;
    s->arg = arg;
    int32_t per = tx->slot_pages;
    nit = (n_pages + per - 1) / per;
    items = calloc((size_t)nit, sizeof *items);
    if (!items) goto nomem;
    for (int32_t i = 0; i < nit; i++)
        if (!(items[i] = calloc(1, sizeof **items))) goto nomem;
    for (int32_t i = 0; i < nit; i++) {
        tx_item *it = items[i];
        int32_t p0 = i * per, np = n_pages - p0 < per ? n_pages - p0 : per;
        it->kind = IT_CHUNK;
        it->x = x;
        it->first_page = first_page + p0;
        it->n_pages = np;
        it->ids = s->ids + p0;
        it->send = s;
        it->slot = -1;
        s->refs++;
        ch->queued_bytes += (size_t)np * pb;
        item_push(ch, it);
    }
    free(items);
    x->queued_pages += n_pages;
    cs__kvx_wake(tx->wake[1]);
    pthread_mutex_unlock(&tx->mu);
    return 0;
nomem:
    r = cs_fail(CS_ENOMEM, "kvx tx: out of memory");
    if (items)
        for (int32_t i = 0; i < nit; i++)
            free(items[i]);
    free(items);
fail:
    pthread_mutex_unlock(&tx->mu);
    if (s) free(s->ev);
    free(s);
    return r;
}

int cs_kvx_tx_finish(cs_kvx_tx *tx, uint64_t xfer_id, const cs_kvx_trailer *t) {
    pthread_mutex_lock(&tx->mu);
    int r = 0;
    tx_xfer *x = cs__tx_find_xfer(tx, xfer_id);
    if (!x || x->fail || x->trailer_queued) {
        r = cs_fail(CS_ENOENT, "kvx tx: transfer %llu is not open", (unsigned long long)xfer_id);
    } else if (!t || t->total_pages != x->total_pages || x->queued_pages != x->total_pages ||
               t->first_token < 0 || t->prompt_len < 0 || t->n_top < 0 ||
               t->n_top > CS_KVX_MAX_TOP) {
        r = cs_fail(CS_EINVAL, "kvx tx: transfer %llu: trailer with %d pages after %d of %d queued",
                    (unsigned long long)xfer_id, t ? t->total_pages : -1, x->queued_pages,
                    x->total_pages);
    } else {
        tx_item *it = calloc(1, sizeof *it);
        if (!it) {
            r = cs_fail(CS_ENOMEM, "kvx tx: out of memory");
        } else {
            it->kind = IT_TRAILER;
            it->x = x;
            it->t = *t;
            it->slot = -1;
            item_push(x->ch, it);
            x->trailer_queued = true;
            cs__kvx_wake(tx->wake[1]);
        }
    }
    pthread_mutex_unlock(&tx->mu);
    return r;
}

int cs_kvx_tx_abort(cs_kvx_tx *tx, uint64_t xfer_id) {
    pthread_mutex_lock(&tx->mu);
    int r = 0;
    tx_xfer *x = cs__tx_find_xfer(tx, xfer_id);
    if (!x || x->fail)
        r = cs_fail(CS_ENOENT, "kvx tx: transfer %llu is not open", (unsigned long long)xfer_id);
    else
        x->fail = CS_ECANCELED;
    cs__kvx_wake(tx->wake[1]);
    pthread_mutex_unlock(&tx->mu);
    return r;
}

size_t cs_kvx_tx_queued_bytes(cs_kvx_tx *tx, const char *host, int port) {
    pthread_mutex_lock(&tx->mu);
    tx_chan *c = cs__tx_find_chan(tx, host, port);
    size_t n = c ? c->queued_bytes : 0;
    pthread_mutex_unlock(&tx->mu);
    return n;
}

void cs_kvx_tx_get_stats(cs_kvx_tx *tx, cs_kvx_stats *s) {
    pthread_mutex_lock(&tx->mu);
    *s = tx->st;
    pthread_mutex_unlock(&tx->mu);
}
