/* step_model.c: windowed ridge least squares over the last steps (see
 * chunkserve/step_model.h). 4 unknowns: the normal equations are a 4x4
 * system, solved from scratch after every step (a few hundred flops; a step
 * takes milliseconds). */
#include "chunkserve/step_model.h"

#include <math.h>
#include <string.h>

enum { K = CS_STEP_MODEL_FEATURES };

/* Features are scaled to be of order 1 for the models we serve, so one ridge
 * weight suits every coefficient. */
static const double scale[K] = {1.0, 1e-3, 1e-6, 1e-2, 1e-2};

void cs_step_model_init(cs_step_model *m) {
    memset(m, 0, sizeof *m);
}

static void features(double tokens, double pairs, double rows, double x[K]) {
    x[0] = 1.0 * scale[0];
    x[1] = tokens * scale[1];
    x[2] = pairs * scale[2];
    x[3] = rows * scale[3];
    x[4] = (tokens < CS_STEP_MODEL_SMALL ? tokens : CS_STEP_MODEL_SMALL) * scale[4];
}

/* Solves a x = b (K x K, symmetric positive definite after the ridge) by
 * Gaussian elimination with partial pivoting; false when singular. */
static bool solve(double a[K][K], double b[K], double x[K]) {
    for (int c = 0; c < K; c++) {
        int p = c;
        for (int r = c + 1; r < K; r++)
            if (fabs(a[r][c]) > fabs(a[p][c])) p = r;
        if (fabs(a[p][c]) < 1e-300) return false;
        if (p != c) {
            for (int k = 0; k < K; k++) {
                double t = a[c][k];
                a[c][k] = a[p][k], a[p][k] = t;
            }
            double t = b[c];
            b[c] = b[p], b[p] = t;
        }
        for (int r = c + 1; r < K; r++) {
            double f = a[r][c] / a[c][c];
            for (int k = c; k < K; k++)
                a[r][k] -= f * a[c][k];
            b[r] -= f * b[c];
        }
    }
    for (int c = K - 1; c >= 0; c--) {
        double s = b[c];
        for (int k = c + 1; k < K; k++)
            s -= a[c][k] * x[k];
        x[c] = s / a[c][c];
    }
    return true;
}

/* Whether the window's token counts span a factor of 2 or more: only then
 * can the fit tell the per-token cost from the fixed one. */
static bool spans(const cs_step_model *m) {
    double lo = INFINITY, hi = 0;
    for (int32_t i = 0; i < m->n; i++) {
        double t = m->x[i][1] / scale[1];
        lo = t < lo ? t : lo, hi = t > hi ? t : hi;
    }
    return hi >= 2 * lo;
}

void cs_step_model_observe(cs_step_model *m, double tokens, double pairs, double rows,
                           double seconds) {
    features(tokens, pairs, rows, m->x[m->head]);
    m->y[m->head] = seconds;
    m->head = (m->head + 1) % CS_STEP_MODEL_WINDOW;
    if (m->n < CS_STEP_MODEL_WINDOW) m->n++;
    double a[K][K] = {{0}}, b[K] = {0}, w[K];
    for (int32_t i = 0; i < m->n; i++)
        for (int r = 0; r < K; r++) {
            b[r] += m->x[i][r] * m->y[i];
            for (int c = 0; c < K; c++)
                a[r][c] += m->x[i][r] * m->x[i][c];
        }
    /* ridge: small against a window of steps of a few ms and features ~1 */
    for (int r = 1; r < K; r++)
        a[r][r] += 1e-6 * (double)m->n;
    /* trusted: enough steps, a spread of token counts, time growing with
     * tokens; otherwise the last trusted fit stays (steady decode-only
     * steps all have one token count and say nothing about its cost) */
    if (solve(a, b, w) && m->n >= 8 && w[1] > 0 && spans(m)) {
        memcpy(m->w, w, sizeof w);
        m->fitted = true;
    }
}

double cs_step_model_predict(const cs_step_model *m, double tokens, double pairs, double rows) {
    if (!m->fitted) return NAN;
    double x[K], t = 0;
    features(tokens, pairs, rows, x);
    for (int k = 0; k < K; k++)
        t += m->w[k] * x[k];
    return t > 0 ? t : 0;
}

double cs_step_model_eval(const double w[K], double tokens, double pairs, double rows) {
    double x[K], t = 0;
    features(tokens, pairs, rows, x);
    for (int k = 0; k < K; k++)
        t += w[k] / scale[k] * x[k];
    return t > 0 ? t : 0;
}

bool cs_step_model_ready(const cs_step_model *m) {
    return m->fitted;
}

void cs_step_model_coefficients(const cs_step_model *m, double w[K]) {
    for (int k = 0; k < K; k++)
        w[k] = m->fitted ? m->w[k] * scale[k] : 0;
}
