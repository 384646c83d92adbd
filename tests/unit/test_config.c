/* test_config.c: the option table (proc/src/config.c): defaults, environment
 * over defaults, flags over both, --x=v, booleans and --no-x, every error
 * (bad number, out of range, unknown flag, missing value, stray argument)
 * naming what was wrong, --help, and the dump. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chunkserve/config.h"
#include "chunkserve/error.h"
#include "test.h"

typedef struct {
    const char *model, *host;
    int64_t port, max_batched_tokens;
    double temperature;
    bool chat, verbose, no_special;
} opts;

#define O(f) offsetof(opts, f)
static const cs_config_entry table[] = {
    {"model", CS_CONFIG_STR, O(model), NULL, "model path", 0, 0},
    {"host", CS_CONFIG_STR, O(host), "127.0.0.1", "address to listen on", 0, 0},
    {"port", CS_CONFIG_INT, O(port), "8080", "port", 0, 65535},
    {"max-batched-tokens", CS_CONFIG_INT, O(max_batched_tokens), "512", "step budget", 0, 0},
    {"temperature", CS_CONFIG_DOUBLE, O(temperature), "0.7", "sampling temperature", 0, 2},
    {"chat", CS_CONFIG_BOOL, O(chat), NULL, "use the chat template", 0, 0},
    {"verbose", CS_CONFIG_BOOL, O(verbose), "true", "debug logging", 0, 0},
    {"no-special", CS_CONFIG_BOOL, O(no_special), "false", "a boolean whose name starts with no-",
     0, 0},
};
#undef O
#define N (sizeof table / sizeof table[0])

static const char *const vars[] = {"CHUNKSERVE_MODEL",       "CHUNKSERVE_HOST",
                                   "CHUNKSERVE_PORT",        "CHUNKSERVE_MAX_BATCHED_TOKENS",
                                   "CHUNKSERVE_TEMPERATURE", "CHUNKSERVE_CHAT",
                                   "CHUNKSERVE_VERBOSE",     "CHUNKSERVE_NO_SPECIAL"};

static void clear_env(void) {
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        unsetenv(vars[i]);
}

/* Parses a NULL-terminated list of arguments after a command word. */
static int parse(opts *o, const char *const *args) {
    char *argv[32];
    int argc = 0;
    argv[argc++] = "prog";
    argv[argc++] = "cmd";
    for (; *args; args++)
        argv[argc++] = (char *)*args;
    argv[argc] = NULL;
    memset(o, 0xab, sizeof *o); /* every field must be written */
    return cs_config_parse(table, N, o, argc, argv, 2, "prog cmd", "a test program");
}

#define ARGS(...) ((const char *const[]){__VA_ARGS__, NULL})
#define NO_ARGS ((const char *const[]){NULL})

static void expect_error(const char *const *args, const char *needle1, const char *needle2) {
    opts o;
    int r = parse(&o, args);
    ASSERT_EQ_INT(r, CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), needle1);
    if (needle2) ASSERT_MSG_HAS(cs_last_error(), needle2);
}

static void test_defaults(void) {
    clear_env();
    opts o;
    ASSERT_EQ_INT(parse(&o, NO_ARGS), 0);
    ASSERT_TRUE(o.model == NULL);
    ASSERT_EQ_STR(o.host, "127.0.0.1");
    ASSERT_EQ_INT(o.port, 8080);
    ASSERT_EQ_INT(o.max_batched_tokens, 512);
    ASSERT_NEAR(o.temperature, 0.7, 0);
    ASSERT_TRUE(!o.chat && o.verbose && !o.no_special);
}

static void test_env_and_flags(void) {
    clear_env();
    setenv("CHUNKSERVE_MODEL", "/env/model.gguf", 1);
    setenv("CHUNKSERVE_PORT", "9000", 1);
    setenv("CHUNKSERVE_MAX_BATCHED_TOKENS", "2048", 1);
    setenv("CHUNKSERVE_CHAT", "true", 1);
    setenv("CHUNKSERVE_VERBOSE", "0", 1);
    setenv("CHUNKSERVE_TEMPERATURE", "", 1); /* empty = unset */
    opts o;
    ASSERT_EQ_INT(parse(&o, NO_ARGS), 0);
    ASSERT_EQ_STR(o.model, "/env/model.gguf");
    ASSERT_EQ_INT(o.port, 9000);
    ASSERT_EQ_INT(o.max_batched_tokens, 2048);
    ASSERT_TRUE(o.chat && !o.verbose);
    ASSERT_NEAR(o.temperature, 0.7, 0);

    /* Flags win over the environment; both spellings; the last one wins. */
    ASSERT_EQ_INT(parse(&o, ARGS("--port", "1234", "--model=/flag/m", "--max-batched-tokens=64",
                                 "--port=4321", "--temperature", "1.5", "--host=")),
                  0);
    ASSERT_EQ_STR(o.model, "/flag/m");
    ASSERT_EQ_INT(o.port, 4321);
    ASSERT_EQ_INT(o.max_batched_tokens, 64);
    ASSERT_NEAR(o.temperature, 1.5, 0);
    ASSERT_EQ_STR(o.host, "");
    clear_env();
}

static void test_bools(void) {
    clear_env();
    opts o;
    ASSERT_EQ_INT(parse(&o, ARGS("--chat", "--no-verbose")), 0);
    ASSERT_TRUE(o.chat && !o.verbose);
    ASSERT_EQ_INT(parse(&o, ARGS("--chat=false", "--verbose=1")), 0);
    ASSERT_TRUE(!o.chat && o.verbose);
    ASSERT_EQ_INT(parse(&o, ARGS("--chat=TRUE", "--verbose=0")), 0);
    ASSERT_TRUE(o.chat && !o.verbose);
    /* An entry named no-x is itself, not the negation of x; --no-no-x negates it. */
    ASSERT_EQ_INT(parse(&o, ARGS("--no-special")), 0);
    ASSERT_TRUE(o.no_special);
    ASSERT_EQ_INT(parse(&o, ARGS("--no-special", "--no-no-special")), 0);
    ASSERT_TRUE(!o.no_special);
    /* A boolean does not take the next argument. */
    expect_error(ARGS("--chat", "false"), "unexpected argument 'false'", NULL);
    expect_error(ARGS("--chat=maybe"), "--chat", "'maybe' is not a boolean");
    expect_error(ARGS("--no-chat=1"), "--no-chat takes no value", NULL);
    expect_error(ARGS("--no-port"), "unknown option '--no-port'", NULL);
    setenv("CHUNKSERVE_CHAT", "yes", 1);
    expect_error(NO_ARGS, "CHUNKSERVE_CHAT", "'yes' is not a boolean");
    clear_env();
}

static void test_errors(void) {
    clear_env();
    expect_error(ARGS("--port", "80x"), "--port", "'80x' is not an integer");
    expect_error(ARGS("--port="), "--port", "is not an integer");
    expect_error(ARGS("--port", " 80"), "--port", "is not an integer");
    expect_error(ARGS("--max-batched-tokens", "99999999999999999999"), "--max-batched-tokens",
                 "out of range");
    expect_error(ARGS("--temperature", "warm"), "--temperature", "'warm' is not a finite number");
    expect_error(ARGS("--temperature", "nan"), "--temperature", "not a finite number");
    expect_error(ARGS("--temperature", "inf"), "--temperature", "not a finite number");
    expect_error(ARGS("--temperature", "1e400"), "--temperature: 1e400 is out of range", NULL);
    expect_error(ARGS("--port", "65536"), "--port: 65536 is out of range", "(0..65535)");
    expect_error(ARGS("--port=-1"), "--port: -1 is out of range", NULL);
    expect_error(ARGS("--temperature=2.5"), "--temperature: 2.5 is out of range", "(0..2)");
    expect_error(ARGS("--bogus", "1"), "unknown option '--bogus'", NULL);
    expect_error(ARGS("--bogus=1"), "unknown option '--bogus'", NULL);
    expect_error(ARGS("--model"), "--model needs a value", NULL);
    expect_error(ARGS("stray"), "unexpected argument 'stray'", NULL);
    expect_error(ARGS("-p", "1"), "unexpected argument '-p'", NULL);
    expect_error(ARGS("--"), "unexpected argument '--'", NULL);
    /* The first mistake is the one reported. */
    expect_error(ARGS("--port", "x", "--bogus"), "--bogus", NULL);
    expect_error(ARGS("--bogus", "--port", "x"), "--bogus", NULL);
    setenv("CHUNKSERVE_PORT", "70000", 1);
    expect_error(NO_ARGS, "CHUNKSERVE_PORT: 70000 is out of range", NULL);
    /* ... even when a flag would have replaced it: a broken environment is reported. */
    expect_error(ARGS("--port", "1"), "CHUNKSERVE_PORT", NULL);
    clear_env();
    /* Bounds are inclusive. */
    opts o;
    ASSERT_EQ_INT(parse(&o, ARGS("--port", "0", "--temperature", "2")), 0);
    ASSERT_EQ_INT(parse(&o, ARGS("--temperature", "1e-400")), 0); /* underflow rounds to 0 */
    ASSERT_EQ_INT(parse(&o, ARGS("--port", "65535", "--temperature", "0")), 0);
    ASSERT_EQ_INT(o.port, 65535);
    ASSERT_EQ_INT(parse(&o, ARGS("--max-batched-tokens", "-9223372036854775808")), 0);
    ASSERT_TRUE(o.max_batched_tokens == INT64_MIN);
}

/* Runs fn with stdout sent to a temporary file and returns what it printed. */
static char *capture_stdout(int (*fn)(void), int *rc) {
    char path[512];
    const char *dir = getenv("CS_TEST_TMPDIR");
    snprintf(path, sizeof path, "%s/test_config_stdout.%d", dir ? dir : "/tmp", (int)getpid());
    fflush(stdout);
    int fd = dup(fileno(stdout));
    ASSERT_TRUE(freopen(path, "w", stdout) != NULL);
    *rc = fn();
    fflush(stdout);
    ASSERT_TRUE(dup2(fd, fileno(stdout)) >= 0);
    close(fd);
    FILE *f = fopen(path, "r");
    ASSERT_TRUE(f != NULL);
    static char buf[8192];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    unlink(path);
    return buf;
}

static int parse_help(void) {
    opts o;
    /* --help wins even after a mistake and with a broken environment. */
    setenv("CHUNKSERVE_PORT", "bad", 1);
    int r = parse(&o, ARGS("--bogus", "--help"));
    clear_env();
    return r;
}

static void test_help(void) {
    int rc = 0;
    char *out = capture_stdout(parse_help, &rc);
    ASSERT_EQ_INT(rc, 1);
    ASSERT_MSG_HAS(out, "usage: prog cmd [options]\n\na test program\n\noptions:\n");
    ASSERT_MSG_HAS(out, "  --model VALUE                "); /* aligned to the longest flag */
    ASSERT_MSG_HAS(out, "   model path (env CHUNKSERVE_MODEL)\n");
    ASSERT_MSG_HAS(out,
                   "  --port VALUE                 port (default 8080; env CHUNKSERVE_PORT)\n");
    ASSERT_MSG_HAS(out, "  --max-batched-tokens VALUE   step budget (default 512; env "
                        "CHUNKSERVE_MAX_BATCHED_TOKENS)\n");
    ASSERT_MSG_HAS(out,
                   "  --chat                       use the chat template (env CHUNKSERVE_CHAT)\n");
    ASSERT_MSG_HAS(
        out,
        "  --verbose                    debug logging (default true; env CHUNKSERVE_VERBOSE)\n");
    ASSERT_MSG_HAS(out, "a boolean whose name starts with no- (env CHUNKSERVE_NO_SPECIAL)\n");
    ASSERT_MSG_HAS(out, "  -h, --help                   print this help and exit\n");
}

static int parse_help_json(void) {
    opts o;
    setenv("CHUNKSERVE_PORT", "bad", 1); /* like --help: wins over a broken environment */
    int r = parse(&o, ARGS("--help-json"));
    clear_env();
    return r;
}

/* --help-json: the table for tools (the Helm chart's tests read the flags). */
static void test_help_json(void) {
    int rc = 0;
    char *out = capture_stdout(parse_help_json, &rc);
    ASSERT_EQ_INT(rc, 1);
    ASSERT_MSG_HAS(out,
                   "[\n {\"name\": \"model\", \"env\": \"CHUNKSERVE_MODEL\", \"type\": \"string\", "
                   "\"default\": null, \"help\": \"model path\"},\n");
    ASSERT_MSG_HAS(
        out, " {\"name\": \"port\", \"env\": \"CHUNKSERVE_PORT\", \"type\": \"int\", \"default\": "
             "\"8080\", \"help\": \"port\", \"min\": 0, \"max\": 65535},\n");
    ASSERT_MSG_HAS(out, "\"type\": \"double\", \"default\": \"0.7\"");
    ASSERT_MSG_HAS(out, "\"name\": \"chat\", \"env\": \"CHUNKSERVE_CHAT\", \"type\": \"bool\"");
    ASSERT_MSG_HAS(out, "\"help\": \"a boolean whose name starts with no-\"}\n]\n");
    /* JSON string escapes */
    static const cs_config_entry odd[] = {
        {"x", CS_CONFIG_STR, 0, "a\\b", "say \"hi\"\n\tnow", 0, 0},
    };
    char buf[512];
    FILE *f = fmemopen(buf, sizeof buf, "w");
    ASSERT_TRUE(f != NULL);
    cs_config_print_json(odd, 1, f);
    fclose(f);
    ASSERT_EQ_STR(
        buf, "[\n {\"name\": \"x\", \"env\": \"CHUNKSERVE_X\", \"type\": \"string\", \"default\": "
             "\"a\\\\b\", \"help\": \"say \\\"hi\\\"\\u000a\\u0009now\"}\n]\n");
}

/* A process's table joined from its modules' tables: each at its struct's
 * offset, in order, the process's defaults replacing the module's; two
 * entries of one name, or a default naming none, are refused. */
typedef struct {
    int64_t a;
    const char *b;
} part_opts;
typedef struct {
    bool verbose;
    part_opts inner;
} whole_opts;

static void test_join(void) {
    static const cs_config_entry inner[] = {
        {"a", CS_CONFIG_INT, offsetof(part_opts, a), "1", "a number", 0, 100},
        {"b", CS_CONFIG_STR, offsetof(part_opts, b), "x", "a string", 0, 0},
    };
    static const cs_config_entry outer[] = {
        {"verbose", CS_CONFIG_BOOL, offsetof(whole_opts, verbose), NULL, "debug logging", 0, 0},
    };
    const cs_config_part parts[] = {{outer, 1, 0}, {inner, 2, offsetof(whole_opts, inner)}};
    const cs_config_default defs[] = {{"a", "7"}};
    cs_config_entry *t;
    size_t n;
    ASSERT_EQ_INT(cs_config_join(parts, 2, defs, 1, &t, &n), 0);
    ASSERT_EQ_INT((int)n, 3);
    ASSERT_EQ_STR(t[0].name, "verbose");
    ASSERT_EQ_STR(t[1].name, "a");
    ASSERT_EQ_STR(t[1].def, "7");
    ASSERT_EQ_STR(inner[0].def, "1"); /* the module's own table is untouched */
    clear_env();
    whole_opts o;
    memset(&o, 0, sizeof o);
    char *argv[] = {"prog", "--b", "y", "--verbose", NULL};
    ASSERT_EQ_INT(cs_config_parse(t, n, &o, 4, argv, 1, "prog", "summary"), 0);
    ASSERT_TRUE(o.verbose);
    ASSERT_EQ_INT((int)o.inner.a, 7);
    ASSERT_EQ_STR(o.inner.b, "y");
    free(t);
    const cs_config_part twice[] = {{inner, 2, 0}, {inner, 1, 0}};
    ASSERT_EQ_INT(cs_config_join(twice, 2, NULL, 0, &t, &n), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "'a' is in two tables");
    ASSERT_TRUE(t == NULL);
    const cs_config_default stray[] = {{"c", "1"}};
    ASSERT_EQ_INT(cs_config_join(parts, 2, stray, 1, &t, &n), CS_EINVAL);
    ASSERT_MSG_HAS(cs_last_error(), "'c'");
}

static void test_dump(void) {
    clear_env();
    opts o;
    ASSERT_EQ_INT(parse(&o, ARGS("--chat", "--temperature", "0.25")), 0);
    char buf[1024];
    FILE *f = fmemopen(buf, sizeof buf, "w");
    ASSERT_TRUE(f != NULL);
    cs_config_dump(table, N, &o, f);
    fclose(f);
    ASSERT_EQ_STR(buf, "model = (unset)\nhost = 127.0.0.1\nport = 8080\nmax-batched-tokens = 512\n"
                       "temperature = 0.25\nchat = true\nverbose = true\nno-special = false\n");
}

/* A secret list: the variable's comma list, replaced by the flags, which
 * repeat and join; the dump never shows it. */
static void test_secret_list(void) {
    struct {
        const char *key;
        int64_t port;
    } o;
    static const cs_config_entry t[] = {
        {"key", CS_CONFIG_SECRET, 0, NULL, "keys", 0, 0},
        {"port", CS_CONFIG_INT, sizeof(const char *), "1", "port", 0, 0},
    };
    char *argv[8] = {"prog", "--key", "s1", "--port=2", "--key=s2,s3", "--key", "s4", NULL};
    unsetenv("CHUNKSERVE_KEY");
    ASSERT_EQ_INT(cs_config_parse(t, 2, &o, 7, argv, 1, "prog", NULL), 0);
    ASSERT_EQ_STR(o.key, "s1,s2,s3,s4");
    ASSERT_EQ_INT(o.port, 2);
    setenv("CHUNKSERVE_KEY", "e1,e2", 1);
    ASSERT_EQ_INT(cs_config_parse(t, 2, &o, 1, argv, 1, "prog", NULL), 0);
    ASSERT_EQ_STR(o.key, "e1,e2");
    ASSERT_EQ_INT(cs_config_parse(t, 2, &o, 3, argv, 1, "prog", NULL), 0); /* one flag */
    ASSERT_EQ_STR(o.key, "s1");
    unsetenv("CHUNKSERVE_KEY");
    char buf[256];
    FILE *f = fmemopen(buf, sizeof buf, "w");
    ASSERT_TRUE(f != NULL);
    cs_config_dump(t, 2, &o, f);
    fclose(f);
    ASSERT_EQ_STR(buf, "key = (set)\nport = 1\n");
}

int main(void) {
    test_defaults();
    test_env_and_flags();
    test_bools();
    test_errors();
    test_help();
    test_help_json();
    test_dump();
    test_join();
    test_secret_list();
    printf("test_config: ok\n");
    return 0;
}
