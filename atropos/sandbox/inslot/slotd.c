/* slotd: the per-slot supervisor as a small static program (docs/native-supervisor.md).
 *
 * It serves the hot path of a slot's sandbox, the `exec` call, the terminal and `ping`, exactly as
 * supervisor.py's Supervisor.run (and inslot_terminal.run_terminal) do: same warm interpreters (their
 * boot scripts come from the host, made by inslot_warm.py), same process accounting (ns_last_pid
 * marks, kill(-1) sweeps), same output capture. Anything else the host asks for (a file tool, an
 * exec with a cwd, a request the declaration refuses) comes after an "upgrade": slotd kills every
 * process of the sandbox and execs the Python supervisor in its own place, on the same protocol
 * descriptors, for the rest of the sandbox's life. A sandbox that only runs commands never starts Python.
 *
 * Wire (host side: atropos/sandbox/host/isolation/slotd_wire.py): frames of a 4-byte big-endian
 * length and a body. Requests are not JSON: a kind byte, the sequence number, then the op's fields
 * in the order the protocol's one declaration gives them (atropos/sandbox/inslot/inslot_protocol.py),
 * each a 4-byte big-endian length and its bytes; the parsers are generated from that declaration
 * into slotd_protocol.h (scripts/gen_slotd_header.py), the configuration frame's too. Replies are JSON, ASCII only: captured output
 * travels as base64 of the kept head and tail bytes, and the host renders the text as
 * inslot_common.Capture does, so both supervisors answer a call with the same reply.
 *
 * Threat model: as supervisor.py's. It runs as the slot's uid beside the slot's code, is made
 * non-dumpable first thing, and protects the host (bounded output, bounded frames, nothing of a
 * call survives it), not itself from its own slot.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int rfd = -1, wfd = -1;
static int last_pid_fd = -1;
static char *root_dir;                 /* the workspace (the cwd of every call served here) */
static char **base_env;                /* the slot's environment for calls (NULL-terminated) */
static char **upgrade_argv;            /* the Python supervisor, run in our place on upgrade */
static char *run_dir, *term_dir;       /* the terminal's socket and log; where its shell starts */
static char **tmux_argv, **shell_argv; /* how to run tmux; the session's command (NULL: tmux's) */

#ifdef SLOTD_SANITIZED
/* The test-only build under AddressSanitizer and UndefinedBehaviorSanitizer (slotd_build.SANITIZER_CFLAGS,
   tests/test_slotd_sanitized.py): any report ends slotd; reports go to its stderr. */
static struct rlimit child_as;
static int has_child_as;
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "detect_leaks=1:exitcode=86:abort_on_error=0"; }
const char *__ubsan_default_options(void);
const char *__ubsan_default_options(void) { return "print_stacktrace=1:halt_on_error=1:exitcode=87"; }
/* LeakSanitizer's check at exit stops the process's threads through ptrace, which a non-dumpable
   process refuses: dumpable again for that last step only (registered after the sanitizer's own
   handler, so it runs before it). */
static void dumpable_for_leak_check(void) { prctl(PR_SET_DUMPABLE, 1, 0, 0, 0); }
#endif

/* ------------------------------------------------------------------ small helpers */

static void die(const char *what) {
    fprintf(stderr, "slotd: %s: %s\n", what, strerror(errno));
    _exit(111);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) die("malloc");
    return p;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static long ns_last_pid(void) {
    char buf[32];
    ssize_t n = pread(last_pid_fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return -1;
    buf[n] = 0;
    return strtol(buf, NULL, 10);
}

/* A poll timeout from milliseconds that may be out of int's range (a deadline days away): the
   loops poll again until the deadline, so a shorter wait is harmless, an overflowing cast is not. */
static int poll_ms(double ms) {
    if (!(ms > 0)) return 0;
    return ms > 3600e3 ? 3600 * 1000 : (int)ms;
}

static int pidfd_open(pid_t pid) { return (int)syscall(SYS_pidfd_open, pid, 0); }

static void write_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            _exit(0); /* the host is gone */
        }
        p += w;
        n -= (size_t)w;
    }
}

static int read_exact(int fd, char *p, size_t n) {
    while (n) {
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

/* A growing string for the reply. */
typedef struct { char *p; size_t n, cap; } buf_t;

static void b_put(buf_t *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->p = realloc(b->p, b->cap);
        if (!b->p) die("realloc");
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void b_str(buf_t *b, const char *s) { b_put(b, s, strlen(s)); }

static void b_fmt(buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void b_fmt(buf_t *b, const char *fmt, ...) {
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    b_put(b, tmp, (size_t)n);
}

static void b_b64(buf_t *b, const unsigned char *s, size_t n) {
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char q[4];
    for (size_t i = 0; i < n; i += 3) {
        unsigned v = (unsigned)s[i] << 16 | (i + 1 < n ? (unsigned)s[i + 1] << 8 : 0) | (i + 2 < n ? s[i + 2] : 0);
        q[0] = tab[v >> 18 & 63];
        q[1] = tab[v >> 12 & 63];
        q[2] = i + 1 < n ? tab[v >> 6 & 63] : '=';
        q[3] = i + 2 < n ? tab[v & 63] : '=';
        b_put(b, q, 4);
    }
}

static void send_frame(buf_t *b) {
    unsigned char hdr[4] = {(unsigned char)(b->n >> 24), (unsigned char)(b->n >> 16), (unsigned char)(b->n >> 8),
                            (unsigned char)b->n};
    write_all(wfd, (const char *)hdr, 4);
    write_all(wfd, b->p, b->n);
}

/* ------------------------------------------------------------------ request fields */

typedef struct { const char *p; size_t left; int bad; } fields_t;

/* The next field as a NUL-terminated copy (a field holds no NUL where a string is meant:
   the host never sends one, see slotd_wire.encode_op). */
static char *field(fields_t *f, size_t *len) {
    if (f->bad || f->left < 4) { f->bad = 1; return NULL; }
    const unsigned char *u = (const unsigned char *)f->p;
    size_t n = (size_t)u[0] << 24 | (size_t)u[1] << 16 | (size_t)u[2] << 8 | u[3];
    if (n > f->left - 4) { f->bad = 1; return NULL; }
    char *s = xmalloc(n + 1);
    memcpy(s, f->p + 4, n);
    s[n] = 0;
    f->p += 4 + n;
    f->left -= 4 + n;
    if (len) *len = n;
    return s;
}

static long field_long(fields_t *f) {
    char *s = field(f, NULL);
    long v = s && *s ? strtol(s, NULL, 10) : 0;
    free(s);
    return v;
}

/* The typed readers the generated parsers use (slotd_protocol.h): a field out of its declared bounds,
   or not a number where one is declared, makes the request malformed (f->bad). */
static double slotd_float(fields_t *f, double lo, double hi) {
    char *s = field(f, NULL), *end = NULL;
    double v = s && *s ? strtod(s, &end) : 0;
    if (!s || !*s || *end || !(v >= lo && v <= hi)) f->bad = 1; /* NaN fails the comparison too */
    free(s);
    return f->bad ? 0 : v;
}

static long long slotd_int(fields_t *f, long long lo, long long hi, int *present) {
    char *s = field(f, NULL), *end = NULL;
    if (present) *present = s && *s;
    if (s && !*s && present) { free(s); return 0; } /* an optional field, absent */
    errno = 0;
    long long v = s && *s ? strtoll(s, &end, 10) : 0;
    if (!s || !*s || *end || errno || v < lo || v > hi) f->bad = 1;
    free(s);
    return f->bad ? 0 : v;
}

static int slotd_bool(fields_t *f, int optional) {
    char *s = field(f, NULL);
    int v = !s ? 0 : !strcmp(s, "1") ? 1 : !strcmp(s, "0") ? 0 : optional && !*s ? -1 : (f->bad = 1, 0);
    free(s);
    return v;
}

/* A string field; `binary`: it may hold NUL bytes (its length says where it ends), else it may not. */
static char *slotd_str(fields_t *f, size_t *len, long long lo, long long hi, int binary) {
    char *s = field(f, len);
    if (!s) { *len = 0; return xmalloc(1); }
    if ((long long)*len < lo || (long long)*len > hi || (!binary && strlen(s) != *len)) f->bad = 1;
    return s;
}

/* A count, then `per` strings per item (1: a list, 2: a map's name and value), NULL-terminated. */
static char **slotd_strs(fields_t *f, long long *n, long long lo, long long hi, int per) {
    *n = slotd_int(f, lo, hi, NULL);
    if (f->bad) *n = 0;
    long long total = *n * per;
    char **v = xmalloc(sizeof(char *) * (size_t)(total + 1));
    long long got = 0;
    for (; got < total && !f->bad; got++) {
        size_t len;
        v[got] = field(f, &len);
        if (v[got] && strlen(v[got]) != len) f->bad = 1;
        if (!v[got]) break;
    }
    v[got] = NULL;
    if (got < total) *n = got / per; /* what was read is freed with the rest */
    return v;
}

/* Each of the `n` strings at `v` (every `step`-th: a map's names) is one of `choices` (NULL-terminated),
   else the frame is malformed (a declared field's choices: a configuration's mode and limit names). */
static void slotd_choices(fields_t *f, char *const *v, long long n, int step, const char *const *choices) {
    for (long long i = 0; i < n && !f->bad; i++) {
        const char *const *c = choices;
        while (*c && strcmp(*c, v[i * step])) c++;
        if (!*c) f->bad = 1;
    }
}

static void slotd_free_strs(char **v) {
    if (!v) return;
    for (char **p = v; *p; p++) free(*p);
    free(v);
}

#include "slotd_protocol.h"

/* ------------------------------------------------------------------ capture */

/* The first and the last `half` bytes of a stream, and its length (inslot_common.Capture). */
typedef struct {
    size_t half, head_n, ring_n, ring_pos;
    unsigned long long total;
    unsigned char *head, *ring;
} capture_t;

static void cap_init(capture_t *c, long cap) {
    memset(c, 0, sizeof *c);
    c->half = cap / 2 > 1 ? (size_t)(cap / 2) : 1;
    c->head = xmalloc(c->half);
    c->ring = xmalloc(c->half);
}

static void cap_feed(capture_t *c, const unsigned char *d, size_t n) {
    c->total += n;
    size_t room = c->half - c->head_n;
    if (room) {
        size_t take = n < room ? n : room;
        memcpy(c->head + c->head_n, d, take);
        c->head_n += take;
        d += take;
        n -= take;
    }
    if (n > c->half) { d += n - c->half; n = c->half; }
    while (n) {
        size_t take = c->half - c->ring_pos;
        if (take > n) take = n;
        memcpy(c->ring + c->ring_pos, d, take);
        c->ring_pos = (c->ring_pos + take) % c->half;
        c->ring_n = c->ring_n + take > c->half ? c->half : c->ring_n + take;
        d += take;
        n -= take;
    }
}

static void cap_json(buf_t *b, const char *name, capture_t *c) {
    b_fmt(b, ",\"%s\":[\"", name);
    b_b64(b, c->head, c->head_n);
    b_str(b, "\",\"");
    unsigned char *tail = xmalloc(c->ring_n);
    size_t start = (c->ring_pos + c->half - c->ring_n) % c->half;
    for (size_t i = 0; i < c->ring_n; i++) tail[i] = c->ring[(start + i) % c->half];
    b_b64(b, tail, c->ring_n);
    free(tail);
    b_fmt(b, "\",%llu]", c->total);
    free(c->head);
    free(c->ring);
}

/* ------------------------------------------------------------------ processes */

static char *env_get(char **env, const char *name) {
    size_t n = strlen(name);
    for (; *env; env++)
        if (!strncmp(*env, name, n) && (*env)[n] == '=') return *env + n + 1;
    return NULL;
}

/* Exec `argv` as Popen does for an environment: a name without a slash is tried in every
   directory of that environment's PATH (os.get_exec_path); the error reported is the first one
   that is not "no such file", else the last. Returns only on failure, with errno set. */
static void exec_like_popen(char **argv, char **env) {
    if (strchr(argv[0], '/')) {
        execve(argv[0], argv, env);
        return;
    }
    const char *path = env_get(env, "PATH");
    if (!path) path = "/bin:/usr/bin";
    int saved = 0;
    char full[PATH_MAX];
    const char *p = path;
    for (;;) {
        const char *end = strchr(p, ':');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        int w = n ? snprintf(full, sizeof full, "%.*s/%s", (int)n, p, argv[0]) : snprintf(full, sizeof full, "%s", argv[0]);
        if (w > 0 && (size_t)w < sizeof full) {
            execve(full, argv, env);
            if (errno != ENOENT && errno != ENOTDIR && !saved) saved = errno;
        }
        if (!end) break;
        p = end + 1;
    }
    if (saved) errno = saved;
}

typedef struct {
    pid_t pid;
    int out_fd, err_fd;
    int reaped, status;
} child_t;

/* Start argv in its own session in `cwd` (NULL: in ours and our directory, as subprocess.run), stdin from `stdin_fd`, stdout and stderr into fresh
   non-blocking pipes; `keep` (up to two descriptors, -1 for none) are inherited at their numbers,
   nothing else is (every descriptor of ours is close-on-exec); `cpu` > 0: its RLIMIT_CPU, set by the
   child itself before its exec (the slot's seccomp filter lets no process change another's limits).
   0 on success, else an errno. */
static int spawn(char **argv, char **env, const char *cwd, int stdin_fd, const int keep[2], long cpu, child_t *ch) {
    int out[2], err[2], errp[2];
    if (pipe2(out, O_CLOEXEC)) return errno;
    if (pipe2(err, O_CLOEXEC)) { int e = errno; close(out[0]); close(out[1]); return e; }
    if (pipe2(errp, O_CLOEXEC)) {
        int e = errno;
        close(out[0]); close(out[1]); close(err[0]); close(err[1]);
        return e;
    }
    pid_t pid = fork();
    if (pid == 0) {
        int e;
#ifdef SLOTD_SANITIZED
        if (has_child_as && setrlimit(RLIMIT_AS, &child_as)) goto fail;
#endif
        if (cwd && (setsid() < 0 || chdir(cwd) < 0)) goto fail;
        if (cpu > 0) {
            struct rlimit rl = {(rlim_t)cpu, (rlim_t)cpu + 1};
            if (setrlimit(RLIMIT_CPU, &rl)) goto fail;
        }
        if (dup2(stdin_fd, 0) < 0 || dup2(out[1], 1) < 0 || dup2(err[1], 2) < 0) goto fail;
        for (int i = 0; i < 2; i++)
            if (keep[i] >= 0 && fcntl(keep[i], F_SETFD, 0) < 0) goto fail;
        exec_like_popen(argv, env);
    fail:
        e = errno;
        (void)!write(errp[1], &e, sizeof e);
        _exit(255);
    }
    int e = pid < 0 ? errno : 0;
    close(out[1]);
    close(err[1]);
    close(errp[1]);
    if (pid > 0) {
        int child_errno = 0;
        ssize_t r;
        do r = read(errp[0], &child_errno, sizeof child_errno); while (r < 0 && errno == EINTR);
        if (r == (ssize_t)sizeof child_errno) {
            while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {}
            e = child_errno ? child_errno : EINVAL;
        }
    }
    close(errp[0]);
    if (e) {
        close(out[0]);
        close(err[0]);
        return e;
    }
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    fcntl(err[0], F_SETFL, O_NONBLOCK);
    ch->pid = pid;
    ch->out_fd = out[0];
    ch->err_fd = err[0];
    ch->reaped = 0;
    ch->status = 0;
    return 0;
}

static int child_alive(child_t *ch) {
    if (ch->reaped) return 0;
    pid_t r = waitpid(ch->pid, &ch->status, WNOHANG);
    if (r == ch->pid) { ch->reaped = 1; return 0; }
    return 1;
}

/* Popen.wait's returncode: the exit status, or minus the signal. */
static int child_wait(child_t *ch) {
    if (!ch->reaped) {
        while (waitpid(ch->pid, &ch->status, 0) < 0 && errno == EINTR) {}
        ch->reaped = 1;
    }
    return WIFSIGNALED(ch->status) ? -WTERMSIG(ch->status) : WEXITSTATUS(ch->status);
}

static void child_close(child_t *ch) {
    if (ch->out_fd >= 0) close(ch->out_fd);
    if (ch->err_fd >= 0) close(ch->err_fd);
    ch->out_fd = ch->err_fd = -1;
}

/* ------------------------------------------------------------------ warm interpreters */

typedef struct {
    char *kind;   /* "/bin/bash" or "python3": argv[0] of the calls it serves */
    char *boot;   /* its boot script, "{go}" and "{src}" standing for the descriptors */
    int live;
    long cpu; /* the RLIMIT_CPU it set itself before its exec (0: none) */
    child_t proc;
    int src_fd, go_w, pidfd;
} warm_t;

static warm_t warm[SLOTD_MAX_WARM];
static int n_warm;
static const char *last_kind = "/bin/bash";
/* the CPU limit the last call asked for: what the next waiting interpreters set themselves (a
   process's limits are its own to change: the slot's seccomp filter refuses prlimit on another) */
static long warm_cpu = 0;
static long mark = -1;               /* see supervisor.py: Supervisor.mark */

static char *boot_script(const char *tmpl, int go, int src) {
    buf_t b = {0};
    char num[16];
    for (const char *p = tmpl; *p;) {
        if (!strncmp(p, "{go}", 4)) { snprintf(num, sizeof num, "%d", go); b_str(&b, num); p += 4; }
        else if (!strncmp(p, "{src}", 5)) { snprintf(num, sizeof num, "%d", src); b_str(&b, num); p += 5; }
        else { b_put(&b, p, 1); p++; }
    }
    return b.p;
}

static void warm_close_fds(warm_t *w) {
    if (w->src_fd >= 0) close(w->src_fd);
    if (w->go_w >= 0) close(w->go_w);
    w->src_fd = w->go_w = -1;
}

static void warm_drop(warm_t *w) {
    if (!w->live) return;
    warm_close_fds(w);
    child_close(&w->proc);
    if (w->pidfd >= 0) close(w->pidfd);
    w->pidfd = -1;
    if (!w->proc.reaped) kill(w->proc.pid, SIGKILL); /* unreaped: the pid is still ours */
    child_wait(&w->proc);
    w->live = 0;
}

static int any_warm(void) {
    for (int i = 0; i < n_warm; i++)
        if (warm[i].live) return 1;
    return 0;
}

static void drop_warm(void) {
    for (int i = 0; i < n_warm; i++) warm_drop(&warm[i]);
}

static int warm_start(warm_t *w) {
    int src = memfd_create("source", MFD_CLOEXEC);
    if (src < 0) return errno;
    int go[2];
    if (pipe2(go, O_CLOEXEC)) { int e = errno; close(src); return e; }
    char *script = boot_script(w->boot, go[0], src);
    char *argv[] = {w->kind, "-c", script, NULL};
    int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    int keep[2] = {go[0], src};
    int e = devnull < 0 ? errno : spawn(argv, base_env, root_dir, devnull, keep, warm_cpu, &w->proc);
    if (devnull >= 0) close(devnull);
    free(script);
    close(go[0]);
    if (e) { close(src); close(go[1]); return e; }
    w->cpu = warm_cpu;
    w->src_fd = src;
    w->go_w = go[1];
    w->pidfd = pidfd_open(w->proc.pid);
    w->live = 1;
    if (w->pidfd < 0) { e = errno; warm_drop(w); return e; }
    return 0;
}

/* ------------------------------------------------------------------ process accounting */

static void kill_leftovers(void) { kill(-1, SIGKILL); }

static void clean_slate(void) {
    kill_leftovers();
    drop_warm();
    mark = ns_last_pid();
}

static int untouched(void) { return mark >= 0 && ns_last_pid() == mark; }

static void guard(void) {
    if (any_warm() && !untouched()) clean_slate();
}

/* Between calls: the warm interpreters of supervisor.py's Supervisor.idle, in its order. */
static void idle(void) {
    for (int i = 0; i < n_warm; i++) {
        warm_t *w = &warm[i];
        if (strcmp(w->kind, "/bin/bash") && strcmp(w->kind, last_kind)) continue;
        if (w->live) {
            if (child_alive(&w->proc) && w->cpu == warm_cpu) continue;
            warm_drop(w);
        }
        if (!untouched()) clean_slate();
        long before = mark;
        if (warm_start(w)) return; /* e.g. the process limit: calls start their own */
        if (before < 0 || w->proc.pid != before + 1) {
            clean_slate(); /* someone else took a pid in between: no warm ones now */
            return;
        }
        mark = w->proc.pid;
    }
}

/* ------------------------------------------------------------------ exec */

static void reply_exec(long seq, int code, int timed_out, int limited, capture_t *out, capture_t *err, double ms,
                       int start_errno) {
    buf_t b = {0};
    b_fmt(&b, "{\"seq\":%ld,\"ok\":true,\"native\":true,\"result\":{", seq);
    if (code >= 0) b_fmt(&b, "\"exit_code\":%d,\"signal\":null", code);
    else b_fmt(&b, "\"exit_code\":null,\"signal\":%d", -code);
    b_fmt(&b, ",\"timed_out\":%s,\"output_limited\":%s,\"duration_ms\":%.3f,\"start_errno\":%d",
          timed_out ? "true" : "false", limited ? "true" : "false", ms, start_errno);
    cap_json(&b, "stdout", out);
    cap_json(&b, "stderr", err);
    b_str(&b, "}}");
    send_frame(&b);
    free(b.p);
}

/* The host encodes every request itself: a malformed one (a field missing, out of its declared
   bounds, or more fields than the op declares) is a bug, not a call to answer. */
static void malformed(fields_t *f, const char *op) {
    if (!f->bad && !f->left) return;
    fprintf(stderr, "slotd: malformed %s request\n", op);
    _exit(112);
}

static void do_exec(fields_t *f, long seq) {
    slotd_exec_t r;
    slotd_parse_exec(f, &r);
    malformed(f, "exec");
    double timeout = r.timeout;
    long cap = (long)r.max_output, cpu = (long)r.cpu_seconds;
    long long hard_cap = r.hard_output;
    size_t stdin_len = r.stdin__len;
    char *stdin_data = r.stdin_;
    long n_env = (long)r.env_n, argc = (long)r.argv_n;
    char **env_pairs = r.env, **argv = r.argv;

    guard(); /* again, right before a waiting interpreter is handed the call */
    warm_t *w = NULL;
    for (int i = 0; i < n_warm; i++)
        if (!strcmp(argv[0], warm[i].kind)) {
            last_kind = warm[i].kind;
            /* a CPU limit is set by the process itself before its exec: a waiting one has its own */
            if (argc == 3 && !strcmp(argv[1], "-c") && warm[i].live && stdin_len == 0 && n_env == 0 &&
                warm[i].cpu == (cpu > 0 ? cpu : 0) &&
                child_alive(&warm[i].proc))
                w = &warm[i];
        }
    warm_cpu = cpu > 0 ? cpu : 0;
    capture_t out, err;
    cap_init(&out, cap);
    cap_init(&err, cap);
    child_t proc;
    int pidfd;
    double start;
    long call_mark = -1;
    if (w) {
        w->live = 0;
        proc = w->proc;
        pidfd = w->pidfd;
        w->pidfd = -1;
        call_mark = any_warm() ? -1 : mark; /* no other waiting interpreter: the mark may hold */
        start = now();
        /* the source (plus bash's terminating NUL) into the memfd, then go */
        size_t n = strlen(argv[2]) + (!strcmp(w->kind, "/bin/bash") ? 1 : 0);
        (void)!pwrite(w->src_fd, argv[2], n, 0);
        (void)!write(w->go_w, "g", 1);
        warm_close_fds(w);
    } else {
        /* the slot's environment, then the call's own variables over it */
        size_t n_base = 0;
        while (base_env[n_base]) n_base++;
        char **env = xmalloc(sizeof(char *) * (n_base + (size_t)n_env + 1));
        size_t n = 0;
        for (size_t i = 0; i < n_base; i++) {
            int overridden = 0;
            size_t klen = strcspn(base_env[i], "=");
            for (long j = 0; j < n_env; j++)
                if (strlen(env_pairs[2 * j]) == klen && !strncmp(base_env[i], env_pairs[2 * j], klen)) overridden = 1;
            if (!overridden) env[n++] = base_env[i];
        }
        size_t n_kept = n; /* the slot's own entries: env[n_kept..] are this call's, allocated here */
        for (long j = 0; j < n_env; j++) {
            int later = 0;
            for (long k = j + 1; k < n_env; k++)
                if (!strcmp(env_pairs[2 * j], env_pairs[2 * k])) later = 1;
            if (later) continue;
            size_t len = strlen(env_pairs[2 * j]) + strlen(env_pairs[2 * j + 1]) + 2;
            char *kv = xmalloc(len);
            snprintf(kv, len, "%s=%s", env_pairs[2 * j], env_pairs[2 * j + 1]);
            env[n++] = kv;
        }
        env[n] = NULL;
        int in = -1;
        if (stdin_len) {
            in = memfd_create("stdin", MFD_CLOEXEC);
            if (in >= 0) {
                (void)!write(in, stdin_data, stdin_len);
                lseek(in, 0, SEEK_SET);
            }
        } else {
            in = open("/dev/null", O_RDONLY | O_CLOEXEC);
        }
        int keep[2] = {-1, -1};
        start = now();
        int e = in < 0 ? errno : spawn(argv, env, root_dir, in, keep, cpu, &proc);
        if (in >= 0) close(in);
        /* the child has exec'd (or failed): the array and the call's own K=V strings are ours to free */
        for (size_t i = n_kept; i < n; i++) free(env[i]);
        free(env);
        if (e) {
            reply_exec(seq, 127, 0, 0, &out, &err, 0.0, e);
            goto done;
        }
        pidfd = pidfd_open(proc.pid);
    }

    struct pollfd pf[3] = {{proc.out_fd, POLLIN, 0}, {proc.err_fd, POLLIN, 0}, {pidfd, POLLIN, 0}};
    /* without a pidfd (none left: the descriptor limit) the call ends when its pipes close */
    int open_fds = pidfd >= 0 ? 3 : 2, timed_out = 0, limited = 0, exited = 0;
    double deadline = start + timeout;
    static unsigned char chunk[65536];
    while (open_fds) {
        double remaining = deadline - now();
        if (remaining <= 0) { timed_out = 1; break; }
        int ms = exited ? 50 : poll_ms(remaining * 1000 + 0.999999);
        int n = poll(pf, 3, ms);
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (exited && n == 0) break;
        for (int i = 0; i < 3; i++) {
            if (pf[i].fd < 0 || !pf[i].revents) continue;
            if (i == 2) {
                exited = 1;
                pf[i].fd = -1;
                open_fds--;
                continue;
            }
            ssize_t r = read(pf[i].fd, chunk, sizeof chunk);
            if (r < 0) {
                if (errno == EAGAIN || errno == EINTR) continue;
                r = 0;
            }
            if (r == 0) {
                pf[i].fd = -1;
                open_fds--;
                continue;
            }
            cap_feed(i == 0 ? &out : &err, chunk, (size_t)r);
        }
        if (out.total + err.total > (unsigned long long)hard_cap) { limited = 1; break; }
    }
    if (pidfd >= 0) close(pidfd);
    if (call_mark >= 0 && exited && !timed_out && !limited && !any_warm() && ns_last_pid() == call_mark) {
        /* no pid was handed out since the interpreter that ran the call: nothing to sweep */
    } else {
        kill_leftovers();
        drop_warm();
        mark = ns_last_pid(); /* the call's process is still unreaped: its pid stays taken */
    }
    int code = child_wait(&proc);
    child_close(&proc);
    reply_exec(seq, code, timed_out, limited, &out, &err, (now() - start) * 1000, 0);
done:
    slotd_free_exec(&r);
}

/* ------------------------------------------------------------------ terminal */
/* inslot_terminal.py's run_terminal: the slot's tmux session driven by tmux clients, what it
   printed read from the session's log, never blocking on whatever the slot put in the log's place.
   The host strips the ANSI sequences (inslot_terminal.strip_ansi) from the text it renders. */

#define TMUX_TIMEOUT 5.0
#define PROMPT_END "]$ "

/* subprocess.run([*tmux, "-S", sock, *args], capture_output=True, timeout=5, stdin=DEVNULL):
   0 with *rc set, -1 on timeout (the client killed), else an errno (the start failed). */
static int tmux_run(const char *sock, const char **args, int *rc, buf_t *err_out) {
    size_t n_tmux = 0, n_args = 0;
    while (tmux_argv[n_tmux]) n_tmux++;
    while (args[n_args]) n_args++;
    char **argv = xmalloc(sizeof(char *) * (n_tmux + n_args + 3));
    size_t k = 0;
    for (size_t i = 0; i < n_tmux; i++) argv[k++] = tmux_argv[i];
    argv[k++] = "-S";
    argv[k++] = (char *)sock;
    for (size_t i = 0; i < n_args; i++) argv[k++] = (char *)args[i];
    argv[k] = NULL;
    int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
    int keep[2] = {-1, -1};
    child_t ch;
    int e = null < 0 ? errno : spawn(argv, base_env, NULL, null, keep, 0, &ch);
    if (null >= 0) close(null);
    free(argv);
    if (e) return e;
    int pidfd = pidfd_open(ch.pid);
    struct pollfd pf[3] = {{ch.out_fd, POLLIN, 0}, {ch.err_fd, POLLIN, 0}, {pidfd, POLLIN, 0}};
    double deadline = now() + TMUX_TIMEOUT;
    int open_fds = 2, timed_out = 0;
    char chunk[4096];
    while (open_fds) { /* communicate(): both pipes to their end */
        double remaining = deadline - now();
        if (remaining <= 0) { timed_out = 1; break; }
        int n = poll(pf, 2, poll_ms(remaining * 1000 + 1));
        if (n < 0 && errno != EINTR) break;
        for (int i = 0; i < 2 && n > 0; i++) {
            if (pf[i].fd < 0 || !pf[i].revents) continue;
            ssize_t r = read(pf[i].fd, chunk, sizeof chunk);
            if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            if (r <= 0) { pf[i].fd = -1; open_fds--; continue; }
            if (i == 1 && err_out) b_put(err_out, chunk, (size_t)r);
        }
    }
    if (!timed_out) { /* the pipes closed: wait for the client itself within what is left */
        double remaining = deadline - now();
        struct pollfd pp = {pidfd, POLLIN, 0};
        if (pidfd >= 0 && (remaining <= 0 || poll(&pp, 1, poll_ms(remaining * 1000 + 1)) == 0)) timed_out = 1;
    }
    if (timed_out) kill(ch.pid, SIGKILL);
    if (pidfd >= 0) close(pidfd);
    int code = child_wait(&ch);
    child_close(&ch);
    if (timed_out) return -1;
    *rc = code;
    return 0;
}

static off_t log_size(const char *path) {
    struct stat st;
    if (lstat(path, &st) || !S_ISREG(st.st_mode)) return 0;
    return st.st_size;
}

static int open_log(const char *path) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && (fstat(fd, &st) || !S_ISREG(st.st_mode))) { close(fd); fd = -1; }
    return fd;
}

static int ends_with_prompt(const char *path, off_t size) {
    int fd = open_log(path);
    if (fd < 0) return 0;
    char buf[64];
    ssize_t n = pread(fd, buf, sizeof buf, size > 64 ? size - 64 : 0);
    close(fd);
    size_t p = strlen(PROMPT_END);
    return n >= (ssize_t)p && !memcmp(buf + n - p, PROMPT_END, p);
}

static void term_fail(long seq, const char *why, int err, const char *file, buf_t *detail) {
    buf_t b = {0};
    b_fmt(&b, "{\"seq\":%ld,\"ok\":false,\"native\":true,\"fail\":\"%s\",\"errno\":%d,\"file\":\"", seq, why, err);
    if (file) b_b64(&b, (const unsigned char *)file, strlen(file));
    b_str(&b, "\",\"detail\":\"");
    if (detail && detail->n) b_b64(&b, (const unsigned char *)detail->p, detail->n);
    b_str(&b, "\"}");
    send_frame(&b);
    free(b.p);
}

/* One tmux client for the terminal; 0 when it ran (rc in *rc), else the failure was answered. */
static int term_tmux(long seq, const char *sock, const char **args, int *rc, buf_t *err_out) {
    int e = tmux_run(sock, args, rc, err_out);
    if (e == -1) { term_fail(seq, "timeout", 0, NULL, NULL); return -1; }
    if (e) { term_fail(seq, "os", e, tmux_argv[0], NULL); return -1; }
    return 0;
}

static void do_terminal(fields_t *f, long seq) {
    slotd_terminal_t r;
    slotd_parse_terminal(f, &r);
    malformed(f, "terminal");
    size_t input_len = r.input_len;
    char *input = r.input, **keys = r.keys;
    long n_keys = (long)r.keys_n;
    long long offset = r.offset;
    long cap = (long)r.max_output;
    double wait = r.wait_ms / 1000.0, settle = r.settle_ms / 1000.0;
    char cols[24], rows[24];
    snprintf(cols, sizeof cols, "%lld", r.cols);
    snprintf(rows, sizeof rows, "%lld", r.rows);
    clean_slate(); /* its tmux clients take pids: with no waiting interpreter alive, all are ours */
    char sock[PATH_MAX], log[PATH_MAX], pipe_cmd[PATH_MAX + 32];
    snprintf(sock, sizeof sock, "%s/tmux.sock", run_dir);
    snprintf(log, sizeof log, "%s/terminal.log", run_dir);
    int rc = 0;
    struct stat st;
    if (lstat(sock, &st) || !S_ISSOCK(st.st_mode)) {
        term_fail(seq, "not_socket", 0, sock, NULL);
        goto out;
    }
    const char *has[] = {"has-session", "-t", "main", NULL};
    if (term_tmux(seq, sock, has, &rc, NULL)) goto out;
    if (rc != 0) {
        size_t n_shell = 0;
        while (shell_argv && shell_argv[n_shell]) n_shell++;
        const char **create = xmalloc(sizeof(char *) * (n_shell + 12));
        size_t k = 0;
        const char *head[] = {"new-session", "-d", "-s", "main", "-x", cols, "-y", rows, "-c", term_dir};
        for (size_t i = 0; i < sizeof head / sizeof head[0]; i++) create[k++] = head[i];
        for (size_t i = 0; i < n_shell; i++) create[k++] = shell_argv[i];
        create[k] = NULL;
        buf_t err = {0};
        int failed = term_tmux(seq, sock, create, &rc, &err);
        free(create);
        if (!failed && rc != 0) term_fail(seq, "start", 0, NULL, &err);
        free(err.p);
        if (failed || rc != 0) goto out;
        snprintf(pipe_cmd, sizeof pipe_cmd, "exec cat >> %s", log);
        const char *pipe_args[] = {"pipe-pane", "-O", "-t", "main", pipe_cmd, NULL};
        if (term_tmux(seq, sock, pipe_args, &rc, NULL)) goto out;
    }
    for (long i = 0; i < n_keys; i++) {
        const char *send[] = {"send-keys", "-t", "main", keys[i], NULL};
        if (term_tmux(seq, sock, send, &rc, NULL)) goto out;
    }
    if (input_len) {
        const char *send[] = {"send-keys", "-t", "main", "-l", "--", input, NULL};
        if (term_tmux(seq, sock, send, &rc, NULL)) goto out;
    }
    if (r.enter >= 0 ? r.enter == 1 : input_len > 0) {
        const char *send[] = {"send-keys", "-t", "main", "Enter", NULL};
        if (term_tmux(seq, sock, send, &rc, NULL)) goto out;
    }
    {
        off_t size = log_size(log);
        double end = now() + wait, last_change = now();
        while (now() < end) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
            off_t now_size = log_size(log);
            if (now_size != size) {
                size = now_size;
                last_change = now();
                if (ends_with_prompt(log, size)) break; /* the shell is back at its prompt */
            } else if (now_size > offset && now() - last_change >= settle) {
                break;
            }
        }
        if (size < offset) offset = 0; /* truncated from inside the slot: all it holds is new */
        capture_t c;
        cap_init(&c, cap);
        if (size > offset) {
            int fd = open_log(log);
            if (fd >= 0) {
                /* what the capture keeps is 2*half bytes (half = cap/2: one less than cap when cap is odd);
                   a log part no longer than that is read whole, else its head and its tail */
                size_t kept = 2 * c.half;
                unsigned char *tmp = xmalloc((size_t)(size - offset) < kept ? (size_t)(size - offset) : kept);
                if ((size_t)(size - offset) <= kept) {
                    ssize_t r = pread(fd, tmp, (size_t)(size - offset), offset);
                    if (r > 0) cap_feed(&c, tmp, (size_t)r);
                } else {
                    ssize_t r = pread(fd, tmp, c.half, offset);
                    if (r > 0) cap_feed(&c, tmp, (size_t)r);
                    c.total += (unsigned long long)(size - offset) - kept; /* the skipped middle */
                    r = pread(fd, tmp, c.half, size - (off_t)c.half);
                    if (r > 0) cap_feed(&c, tmp, (size_t)r);
                }
                free(tmp);
                close(fd);
            }
        }
        buf_t b = {0};
        b_fmt(&b, "{\"seq\":%ld,\"ok\":true,\"native\":true,\"result\":{\"offset\":%lld,\"bytes\":%lld", seq,
              (long long)size, (long long)(size - offset));
        cap_json(&b, "output", &c);
        b_str(&b, "}}");
        send_frame(&b);
        free(b.p);
    }
out:
    mark = ns_last_pid();
    slotd_free_terminal(&r);
}

/* ------------------------------------------------------------------ file tools */
/* inslot_files.py's SlotFiles, served here so that a slot's first file call starts no Python
   (docs/native-supervisor.md): the same system calls in the same order (openat2 strictly beneath
   the workspace, the same flags, the same checks), the raw outcome sent back, and the host renders
   the reply and composes every message with the Python supervisor's own functions
   (inslot_file_replies.py, in slotd_wire.decode_files).
   Text rules the host cannot apply after the fact (edit's strict UTF-8 and its matching) are here. */

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#define RESOLVE_NO_MAGICLINKS 0x02
#define RESOLVE_BENEATH 0x08
#define RESOLVE_IN_ROOT 0x10

static char *files_ws;  /* SlotFiles.workspace: the workspace as the slot sees it ("/" for an image root) */
static char *files_cwd; /* SlotFiles.cwd: NULL, or an image's WorkingDir ("/" when it is gone) */

typedef struct { uint64_t flags, mode, resolve; } open_how_t;

/* A failed file call: what failed and how (the host writes the message, as inslot_files does). */
typedef struct { const char *kind; int err; char *name; size_t name_n; long long num; } fs_fail_t;

static void fs_set(fs_fail_t *x, const char *kind, int err) { x->kind = kind; x->err = err; }

/* inslot_files._openat2: `path` (n bytes) strictly beneath `dir_fd`; -1 with x set on failure. */
static int fs_openat2(int dir_fd, const char *path, size_t n, int flags, mode_t mode, fs_fail_t *x) {
    if (memchr(path, 0, n)) { fs_set(x, "nul", 0); return -1; }
    open_how_t how = {(uint64_t)(flags | O_CLOEXEC), (flags & O_CREAT) ? mode : 0,
                      (uint64_t)((strcmp(files_ws, "/") ? RESOLVE_BENEATH : RESOLVE_IN_ROOT) | RESOLVE_NO_MAGICLINKS)};
    char *z = xmalloc(n + 1); /* the callers' paths are counted, not always NUL-terminated */
    memcpy(z, path, n);
    z[n] = 0;
    long fd = -1;
    for (int i = 0; i < 64; i++) {
        fd = syscall(SYS_openat2, dir_fd, z, &how, sizeof how);
        if (fd >= 0 || errno != EAGAIN) break; /* EAGAIN: a rename raced a ".." step; the kernel asks for a retry */
    }
    int e = errno;
    free(z);
    if (fd >= 0) return (int)fd;
    fs_set(x, "os", e);
    return -1;
}

static int fs_root(fs_fail_t *x) {
    int fd = open(files_ws, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) fs_set(x, "raw", errno);
    return fd;
}

/* SlotFiles._rel: `path` relative to the workspace (malloc'd, its length in *out_n), or NULL with x
   set ("empty", "escape"). */
static char *fs_rel(const char *path, size_t n, size_t *out_n, fs_fail_t *x) {
    if (!n) { fs_set(x, "empty", 0); return NULL; }
    if (path[0] != '/' && !files_cwd) {
        char *r = xmalloc(n + 1);
        memcpy(r, path, n);
        r[n] = 0;
        *out_n = n;
        return r;
    }
    size_t cn = path[0] != '/' ? strlen(files_cwd) + 1 : 0;
    char *full = xmalloc(cn + n + 1), *norm = xmalloc(cn + n + 1);
    if (cn) { memcpy(full, files_cwd, cn - 1); full[cn - 1] = '/'; }
    memcpy(full + cn, path, n);
    size_t fn = cn + n, nn = 0;
    for (size_t i = 0; i < fn; i++) /* re.sub("/+", "/") */
        if (!(full[i] == '/' && nn && norm[nn - 1] == '/')) norm[nn++] = full[i];
    free(full);
    size_t rn = strlen(files_ws);
    while (rn && files_ws[rn - 1] == '/') rn--;
    const char *root = rn ? files_ws : "/";
    if (!rn) rn = 1;
    char *r = NULL;
    if ((nn == rn || (nn == rn + 1 && norm[rn] == '/')) && !memcmp(norm, root, rn)) {
        r = strdup(".");
        *out_n = 1;
    } else {
        size_t in = root[rn - 1] == '/' ? rn : rn + 1; /* root + "/" */
        if (nn >= in && !memcmp(norm, root, rn) && norm[in - 1] == '/') {
            r = xmalloc(nn - in + 1);
            memcpy(r, norm + in, nn - in);
            r[nn - in] = 0;
            *out_n = nn - in;
        } else {
            fs_set(x, "escape", 0);
        }
    }
    free(norm);
    return r;
}

static char *fd_path(int fd) {
    char link[64], *out = xmalloc(PATH_MAX + 1);
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, out, PATH_MAX);
    out[n > 0 ? n : 0] = 0;
    return out;
}

/* SlotFiles._open_rel */
static int fs_open_rel(const char *rel, size_t n, int flags, mode_t mode, fs_fail_t *x) {
    int root = fs_root(x);
    if (root < 0) return -1;
    int fd = fs_openat2(root, rel, n, flags, mode, x);
    close(root);
    if (fd >= 0 && !strcmp(files_ws, "/") && !(flags & O_PATH)) {
        /* an image root reaches /proc, where "self" is this supervisor: not for the file tools */
        char *real = fd_path(fd);
        int proc = !strcmp(real, "/proc") || !strncmp(real, "/proc/", 6);
        free(real);
        if (proc) { close(fd); fs_set(x, "proc", 0); return -1; }
    }
    return fd;
}

/* SlotFiles._open: -1 with x set, else the descriptor and `path`'s rel (malloc'd) in *rel. */
static int fs_open(const char *path, size_t n, int flags, mode_t mode, char **rel, size_t *rel_n, fs_fail_t *x) {
    *rel = fs_rel(path, n, rel_n, x);
    if (!*rel) return -1;
    return fs_open_rel(*rel, *rel_n, flags, mode, x);
}

static void fs_reply_fail(long seq, fs_fail_t *x) {
    buf_t b = {0};
    b_fmt(&b, "{\"seq\":%ld,\"ok\":false,\"native\":true,\"fs\":{\"fail\":\"%s\",\"errno\":%d,\"num\":%lld", seq,
          x->kind, x->err, x->num);
    if (x->name) { b_str(&b, ",\"name\":\""); b_b64(&b, (unsigned char *)x->name, x->name_n); b_str(&b, "\""); }
    b_str(&b, "}}");
    send_frame(&b);
    free(b.p);
    free(x->name);
}

static void b_b64s(buf_t *b, const char *key, const char *s, size_t n) {
    b_fmt(b, ",\"%s\":\"", key);
    b_b64(b, (const unsigned char *)s, n);
    b_str(b, "\"");
}

/* SlotFiles._read_regular: the bytes (malloc'd, *len) and the file's size, or NULL with x set. */
static char *fs_read_regular(const char *path, size_t n, long long offset, long long limit, long long max_bytes,
                             size_t *len, long long *size, fs_fail_t *x) {
    char *rel;
    size_t rel_n;
    int fd = fs_open(path, n, O_RDONLY | O_NONBLOCK | O_NOCTTY, 0644, &rel, &rel_n, x);
    free(rel);
    if (fd < 0) return NULL;
    struct stat st;
    char *data = NULL;
    if (fstat(fd, &st)) { fs_set(x, "raw", errno); goto out; }
    if (S_ISDIR(st.st_mode)) { fs_set(x, "is_directory", 0); goto out; }
    if (!S_ISREG(st.st_mode)) { fs_set(x, "not_regular", 0); goto out; }
    long long want = limit <= 0 ? (st.st_size - offset > 0 ? st.st_size - offset : 0) : limit;
    *size = st.st_size;
    if (want > max_bytes) { fs_set(x, "too_large", 0); x->num = st.st_size; goto out; }
    if (lseek(fd, (off_t)offset, SEEK_SET) < 0) { fs_set(x, "raw", errno); goto out; }
    /* inslot_fs.read_at_most: chunks of 1 MiB, so a file that grows meanwhile costs no more than asked */
    size_t got = 0, cap = 0;
    while ((long long)got < want) {
        size_t chunk = want - (long long)got < (1 << 20) ? (size_t)(want - (long long)got) : (1 << 20);
        if (got + chunk > cap) {
            cap = got + chunk;
            char *p = realloc(data, cap);
            if (!p) die("realloc");
            data = p;
        }
        ssize_t r = read(fd, data + got, chunk);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { fs_set(x, "raw", errno); free(data); data = NULL; goto out; }
        if (!r) break;
        got += (size_t)r;
    }
    if (!data) data = xmalloc(1);
    *len = got;
out:
    close(fd);
    return data;
}

static void do_read_file(fields_t *f, long seq) {
    slotd_read_file_t r;
    slotd_parse_read_file(f, &r);
    malformed(f, "read_file");
    fs_fail_t x = {0};
    size_t len = 0;
    long long size = 0;
    char *data = fs_read_regular(r.path, r.path_len, r.offset, r.limit, r.max_bytes, &len, &size, &x);
    if (!data) {
        fs_reply_fail(seq, &x);
    } else {
        buf_t b = {0};
        b_fmt(&b, "{\"seq\":%ld,\"ok\":true,\"native\":true,\"fs\":{\"size\":%lld", seq, size);
        b_b64s(&b, "data", data, len);
        b_str(&b, "}}");
        send_frame(&b);
        free(b.p);
        free(data);
    }
    slotd_free_read_file(&r);
}

/* A write of all `n` bytes; SIGXFSZ ignored meanwhile, as in Python (the file size limit is an
   EFBIG for the tool, not the end of the supervisor), and restored before any call forks. */
static int write_file_all(int fd, const char *p, size_t n) {
    signal(SIGXFSZ, SIG_IGN);
    int e = 0;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) { e = errno; break; }
        p += w;
        n -= (size_t)w;
    }
    signal(SIGXFSZ, SIG_DFL);
    return e;
}

/* SlotFiles._make_parents */
static int fs_make_parents(const char *rel, size_t n, fs_fail_t *x) {
    /* the parts, "" and "." left out, and the last one too */
    size_t *starts = xmalloc(sizeof(size_t) * (n / 2 + 1)), *lens = xmalloc(sizeof(size_t) * (n / 2 + 1)), np = 0;
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j < n && rel[j] != '/') j++;
        if (!(j == i || (j - i == 1 && rel[i] == '.'))) {
            starts[np] = i;
            lens[np++] = j - i;
        }
        i = j + 1;
    }
    if (np) np--;
    char *prefix = xmalloc(n + 1);
    size_t pn = 0;
    int rc = 0;
    for (size_t k = 0; k < np; k++) {
        size_t parent_n = pn;
        if (pn) prefix[pn++] = '/';
        memcpy(prefix + pn, rel + starts[k], lens[k]);
        pn += lens[k];
        fs_fail_t y = {0};
        int fd = fs_open_rel(prefix, pn, O_PATH | O_DIRECTORY, 0644, &y);
        if (fd >= 0) { close(fd); continue; }
        if (strcmp(y.kind, "os") || (y.err != ENOENT && y.err != ENOTDIR)) {
            *x = y;
            x->name = xmalloc(pn + 1);
            memcpy(x->name, prefix, pn);
            x->name_n = pn;
            rc = -1;
            break;
        }
        /* the parent: prefix.rsplit("/", 1)[0], or "." */
        const char *par = parent_n ? prefix : ".";
        size_t par_n = parent_n ? parent_n : 1;
        int pfd = fs_open_rel(par, par_n, O_PATH | O_DIRECTORY, 0644, x);
        if (pfd < 0) {
            x->name = xmalloc(par_n + 1);
            memcpy(x->name, par, par_n);
            x->name_n = par_n;
            rc = -1;
            break;
        }
        char *part = strndup(rel + starts[k], lens[k]);
        int e = mkdirat(pfd, part, 0755) ? errno : 0;
        free(part);
        close(pfd);
        if (e && e != EEXIST) {
            fs_set(x, "os", e);
            x->name = xmalloc(pn + 1);
            memcpy(x->name, prefix, pn);
            x->name_n = pn;
            rc = -1;
            break;
        }
    }
    free(prefix);
    free(starts);
    free(lens);
    return rc;
}

static int do_write_file(fields_t *f, long seq) {
    slotd_write_file_t r;
    slotd_parse_write_file(f, &r);
    malformed(f, "write_file");
    fs_fail_t x = {0};
    size_t rel_n = 0;
    char *rel = fs_rel(r.path, r.path_len, &rel_n, &x), *rel2 = NULL;
    int fd = -1;
    struct stat st;
    if (!rel || fs_make_parents(rel, rel_n, &x)) goto fail;
    int flags = O_WRONLY | O_CREAT | O_NONBLOCK | O_NOCTTY | (r.append ? O_APPEND : O_TRUNC);
    fd = fs_open(r.path, r.path_len, flags, 0644, &rel2, &rel_n, &x);
    if (fd < 0) goto fail;
    if (fstat(fd, &st)) { fs_set(&x, "raw", errno); goto fail; }
    if (!S_ISREG(st.st_mode)) { fs_set(&x, "not_regular", 0); goto fail; }
    int e = write_file_all(fd, r.content, r.content_len);
    if (e) { fs_set(&x, "os", e); goto fail; }
    if (fstat(fd, &st)) { fs_set(&x, "raw", errno); goto fail; }
    char *real = fd_path(fd);
    buf_t b = {0};
    b_fmt(&b, "{\"seq\":%ld,\"ok\":true,\"native\":true,\"fs\":{\"size\":%lld", seq, (long long)st.st_size);
    b_b64s(&b, "real", real, strlen(real));
    b_b64s(&b, "rel", rel, strlen(rel));
    b_str(&b, "}}");
    send_frame(&b);
    free(b.p);
    free(real);
    int ok = 1;
    if (0) {
    fail:
        fs_reply_fail(seq, &x);
        ok = 0;
    }
    if (fd >= 0) close(fd);
    free(rel);
    free(rel2);
    slotd_free_write_file(&r);
    return ok;
}

/* One code point of `s` (n bytes) at *i as Python's UTF-8 decoder takes it; -1 (and one byte
   consumed: surrogateescape's one character) for a byte that starts no valid sequence. */
static long utf8_next(const unsigned char *s, size_t n, size_t *i) {
    unsigned c = s[*i];
    size_t k;
    long cp, lo;
    if (c < 0x80) { (*i)++; return c; }
    if (c >= 0xc2 && c <= 0xdf) { k = 1; cp = c & 0x1f; lo = 0x80; }
    else if (c >= 0xe0 && c <= 0xef) { k = 2; cp = c & 0x0f; lo = 0x800; }
    else if (c >= 0xf0 && c <= 0xf4) { k = 3; cp = c & 0x07; lo = 0x10000; }
    else { (*i)++; return -1; }
    for (size_t j = 1; j <= k; j++) {
        if (*i + j >= n || (s[*i + j] & 0xc0) != 0x80) { (*i)++; return -1; }
        cp = cp << 6 | (s[*i + j] & 0x3f);
    }
    if (cp < lo || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) { (*i)++; return -1; }
    *i += k + 1;
    return cp;
}

static int utf8_valid(const char *s, size_t n) {
    for (size_t i = 0; i < n;)
        if (utf8_next((const unsigned char *)s, n, &i) < 0) return 0;
    return 1;
}

/* SlotFiles._replace_file: `data` written in full beside the file, renamed over it (mode kept);
   the file's path relative to the workspace's real path in *out (malloc'd), or -1 with x set. */
static int fs_replace_file(const char *path, size_t n, const char *data, size_t len, char **out, fs_fail_t *x) {
    size_t rel_n;
    char *rel_in = fs_rel(path, n, &rel_n, x), *real = NULL, *root_real = NULL, *tmp = NULL;
    if (!rel_in) return -1;
    int root = fs_root(x), dir_fd = -1, rc = -1;
    if (root < 0) { free(rel_in); return -1; }
    int fd = fs_openat2(root, rel_in, rel_n, O_WRONLY | O_NONBLOCK | O_NOCTTY, 0644, x);
    if (fd < 0) goto out;
    struct stat st;
    if (fstat(fd, &st)) { fs_set(x, "os", errno); close(fd); goto out; }
    real = fd_path(fd);
    close(fd);
    if (!S_ISREG(st.st_mode)) { fs_set(x, "not_regular", 0); goto out; }
    root_real = fd_path(root);
    size_t rr = strlen(root_real);
    const char *rel;
    if (!strcmp(root_real, "/")) rel = real + 1;
    else if (!strncmp(real, root_real, rr) && real[rr] == '/') rel = real + rr + 1;
    else { fs_set(x, "resolved_escape", 0); goto out; }
    const char *slash = strrchr(rel, '/');
    const char *name = slash ? slash + 1 : rel;
    if (!*rel || !*name) { fs_set(x, "resolved_escape", 0); goto out; }
    char *parent = slash ? strndup(rel, (size_t)(slash - rel)) : strdup(".");
    dir_fd = fs_openat2(root, parent, strlen(parent), O_PATH | O_DIRECTORY, 0644, x);
    free(parent);
    if (dir_fd < 0) goto out;
    /* f".{name[:200]}.edit-{pid}-{monotonic_ns}": 200 characters as Python counts them */
    size_t nn = strlen(name), cut = 0;
    for (int c = 0; c < 200 && cut < nn; c++) utf8_next((const unsigned char *)name, nn, &cut);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    tmp = xmalloc(cut + 64);
    snprintf(tmp, cut + 64, ".%.*s.edit-%d-%lld", (int)cut, name, (int)getpid(),
             (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
    int tfd = openat(dir_fd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (tfd < 0) { fs_set(x, "os", errno); free(tmp); tmp = NULL; goto out; }
    int e = write_file_all(tfd, data, len);
    if (!e && fchmod(tfd, st.st_mode & 07777)) e = errno;
    close(tfd);
    if (!e && renameat(dir_fd, tmp, dir_fd, name)) e = errno;
    if (e) { fs_set(x, "os", e); goto out; }
    free(tmp);
    tmp = NULL;
    *out = strdup(rel);
    rc = 0;
out:
    if (tmp && dir_fd >= 0) unlinkat(dir_fd, tmp, 0);
    free(tmp);
    if (dir_fd >= 0) close(dir_fd);
    close(root);
    free(real);
    free(root_real);
    free(rel_in);
    return rc;
}

/* Where `needle` occurs in `hay` from `from` on (memmem), or NULL. */
static const char *find(const char *hay, size_t n, size_t from, const char *needle, size_t m) {
    return from <= n ? memmem(hay + from, n - from, needle, m) : NULL;
}

static int do_edit_file(fields_t *f, long seq) {
    slotd_edit_file_t r;
    slotd_parse_edit_file(f, &r);
    malformed(f, "edit_file");
    fs_fail_t x = {0};
    size_t len = 0;
    long long size = 0, count = 0;
    char *out = NULL, *updated = NULL;
    char *data = fs_read_regular(r.path, r.path_len, 0, 0, r.max_bytes, &len, &size, &x);
    if (!data) goto fail;
    /* the file as text (strict UTF-8), then str.count and str.replace: on valid UTF-8 with a valid
       UTF-8 needle (the host sends old_string strictly encoded) a byte match is a character match */
    if (!utf8_valid(data, len)) { fs_set(&x, "not_text", 0); goto fail; }
    const char *old = r.old_string, *new_ = r.new_string;
    size_t on = r.old_string_len, nn = r.new_string_len;
    for (const char *p = find(data, len, 0, old, on); p; p = find(data, len, (size_t)(p - data) + on, old, on))
        count++;
    if (!count) { fs_set(&x, "no_match", 0); goto fail; }
    if (count > 1 && !r.replace_all) { fs_set(&x, "ambiguous_match", 0); x.num = count; goto fail; }
    long long times = r.replace_all ? count : 1;
    size_t un = len - (size_t)times * on + (size_t)times * nn, at = 0, o = 0;
    updated = xmalloc(un + 1);
    for (long long k = 0; k < times; k++) {
        const char *p = find(data, len, at, old, on);
        size_t pre = (size_t)(p - data) - at;
        memcpy(updated + o, data + at, pre);
        o += pre;
        memcpy(updated + o, new_, nn);
        o += nn;
        at = (size_t)(p - data) + on;
    }
    memcpy(updated + o, data + at, len - at);
    if (fs_replace_file(r.path, r.path_len, updated, un, &out, &x)) goto fail;
    {
        buf_t b = {0};
        b_fmt(&b, "{\"seq\":%ld,\"ok\":true,\"native\":true,\"fs\":{\"count\":%lld", seq, count);
        b_b64s(&b, "rel", out, strlen(out));
        b_str(&b, "}}");
        send_frame(&b);
        free(b.p);
    }
    int ok = 1;
    if (0) {
    fail:
        fs_reply_fail(seq, &x);
        ok = 0;
    }
    free(out);
    free(updated);
    free(data);
    slotd_free_edit_file(&r);
    return ok;
}

static void do_list_dir(fields_t *f, long seq) {
    slotd_list_dir_t r;
    slotd_parse_list_dir(f, &r);
    malformed(f, "list_dir");
    fs_fail_t x = {0};
    char *rel = NULL;
    size_t rel_n;
    const char *path = r.path_len ? r.path : "."; /* req.get("path") or "." */
    int fd = fs_open(path, r.path_len ? r.path_len : 1, O_RDONLY | O_DIRECTORY, 0644, &rel, &rel_n, &x);
    if (fd < 0) {
        fs_reply_fail(seq, &x);
    } else {
        /* os.listdir(fd) then os.stat(name, dir_fd=fd, follow_symlinks=False) of each: the host sorts
           as Python sorts the names and keeps max_entries of them (a failed stat is left out) */
        char *real = fd_path(fd);
        buf_t b = {0};
        b_fmt(&b, "{\"seq\":%ld,\"ok\":true,\"native\":true,\"fs\":{\"entries\":[", seq);
        int dfd = dup(fd);
        DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
        int first = 1, e = 0;
        if (!d) {
            e = errno;
            if (dfd >= 0) close(dfd);
        } else {
            struct dirent *de;
            errno = 0;
            while ((de = readdir(d))) {
                if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
                struct stat st;
                b_str(&b, first ? "[\"" : ",[\"");
                first = 0;
                b_b64(&b, (unsigned char *)de->d_name, strlen(de->d_name));
                if (fstatat(fd, de->d_name, &st, AT_SYMLINK_NOFOLLOW)) b_str(&b, "\",-1,0]");
                else b_fmt(&b, "\",%u,%lld]", (unsigned)st.st_mode, (long long)st.st_size);
                errno = 0;
            }
            e = errno;
            closedir(d);
        }
        b_str(&b, "]");
        b_b64s(&b, "real", real, strlen(real));
        b_b64s(&b, "rel", rel, rel_n);
        b_str(&b, "}}");
        if (e) {
            fs_set(&x, "raw", e);
            fs_reply_fail(seq, &x);
        } else {
            send_frame(&b);
        }
        free(b.p);
        free(real);
        close(fd);
    }
    free(rel);
    slotd_free_list_dir(&r);
}

static void do_stat(fields_t *f, long seq) {
    slotd_stat_t r;
    slotd_parse_stat(f, &r);
    malformed(f, "stat");
    fs_fail_t x = {0};
    char *rel = NULL;
    size_t rel_n;
    int fd = fs_open(r.path, r.path_len, O_PATH | O_NOFOLLOW, 0644, &rel, &rel_n, &x);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st)) { fs_set(&x, "raw", errno); close(fd); fd = -1; }
    if (fd < 0) {
        fs_reply_fail(seq, &x);
    } else {
        char *real = fd_path(fd);
        buf_t b = {0};
        b_fmt(&b, "{\"seq\":%ld,\"ok\":true,\"native\":true,\"fs\":{\"mode\":%u,\"size\":%lld,\"mtime\":[%lld,%ld]", seq,
              (unsigned)st.st_mode, (long long)st.st_size, (long long)st.st_mtim.tv_sec, (long)st.st_mtim.tv_nsec);
        b_b64s(&b, "real", real, strlen(real));
        b_b64s(&b, "rel", rel, rel_n);
        b_str(&b, "}}");
        send_frame(&b);
        free(b.p);
        free(real);
        close(fd);
    }
    free(rel);
    slotd_free_stat(&r);
}

/* ------------------------------------------------------------------ start-up */

static void upgrade(void) {
    clean_slate(); /* nothing of ours or the slot's survives into the Python supervisor */
    /* it takes the same channel: its descriptors' numbers as its last three arguments (stderr is 2) */
    size_t n = 0;
    while (upgrade_argv[n]) n++;
    char **argv = xmalloc(sizeof(char *) * (n + 4));
    memcpy(argv, upgrade_argv, sizeof(char *) * n);
    char r[16], w[16];
    snprintf(r, sizeof r, "%d", rfd);
    snprintf(w, sizeof w, "%d", wfd);
    argv[n] = r;
    argv[n + 1] = w;
    argv[n + 2] = "2";
    argv[n + 3] = NULL;
    if (fcntl(rfd, F_SETFD, 0) < 0 || fcntl(wfd, F_SETFD, 0) < 0) die("protocol descriptors");
    execve(argv[0], argv, environ);
    die("exec of the Python supervisor");
}

/* A limit of the configuration, its value in decimal; -1: not a number setrlimit takes. */
static int set_limit(int resource, const char *value) {
    struct rlimit rl;
    char *end = NULL;
    errno = 0;
    unsigned long long v = *value >= '0' && *value <= '9' ? strtoull(value, &end, 10) : 0;
    if (!end || *end || errno) return -1;
    rl.rlim_cur = rl.rlim_max = (rlim_t)v;
#ifdef SLOTD_SANITIZED
    /* AddressSanitizer has terabytes of shadow mapped before main: an address-space limit on slotd
       itself would fail its next allocation. The sanitizer build (tests only) gives it to what it
       starts instead, right before their exec (spawn), so the calls see the same limits. */
    if (resource == RLIMIT_AS) { child_as = rl; has_child_as = 1; return 0; }
#endif
    if (setrlimit(resource, &rl)) die("setrlimit");
    return 0;
}

/* Its configuration is the first frame on the request descriptor, not its argv (which any process of
   the slot can read in /proc): the fields of the protocol's declaration (inslot_protocol.SLOTD_CONFIG,
   parsed by the generated slotd_parse_config; host side: host/isolation/slotd_config.py). The
   configuration lives as long as the process: the globals point into it. */
static slotd_config_t conf;

static int malformed_config(void) {
    fprintf(stderr, "slotd: malformed configuration\n");
    slotd_free_config(&conf);
    return 2;
}

/* The channel: the host passes it past bubblewrap's init (which keeps only its stdio, /dev/null but
   for bwrap's stderr) as three descriptors, their numbers our last three arguments: requests (the
   configuration first), replies, and our stderr. (host/isolation/sandbox_process.py) */
int main(int argc, char **argv) {
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)) die("prctl(PR_SET_DUMPABLE)");
#ifdef SLOTD_SANITIZED
    atexit(dumpable_for_leak_check);
#endif
    if (getpid() > 64) {
        /* its sweeps are kill(-1): only inside a PID namespace of its own do they stop at the sandbox */
        fprintf(stderr, "slotd: not among the first processes of a PID namespace of its own: refusing to run\n");
        return 2;
    }
    /* signal state as supervisor.py's clean_signals leaves it: nothing blocked or ignored */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction sa;
        if (sig == SIGKILL || sig == SIGSTOP || sigaction(sig, NULL, &sa)) continue;
        if (sa.sa_handler == SIG_IGN) signal(sig, SIG_DFL);
    }
    if (argc < 4) { fprintf(stderr, "slotd: usage: slotd REQUEST_FD REPLY_FD STDERR_FD\n"); return 2; }
    rfd = atoi(argv[argc - 3]);
    wfd = atoi(argv[argc - 2]);
    int efd = atoi(argv[argc - 1]);
    if (rfd < 3 || wfd < 3 || efd < 3 || fcntl(rfd, F_GETFD) < 0 || fcntl(wfd, F_GETFD) < 0 || fcntl(efd, F_GETFD) < 0) {
        fprintf(stderr, "slotd: the channel's descriptors are not open\n");
        return 2;
    }
    if (dup2(efd, 2) < 0) die("stderr");
    close(efd);
    unsigned char hdr[4];
    if (read_exact(rfd, (char *)hdr, 4)) return 0;
    size_t size = (size_t)hdr[0] << 24 | (size_t)hdr[1] << 16 | (size_t)hdr[2] << 8 | hdr[3];
    if (size > SLOTD_MAX_FRAME) return 2;
    char *cfg = xmalloc(size);
    if (read_exact(rfd, cfg, size)) { free(cfg); return 0; }
    fields_t f = {cfg, size, 0};
    slotd_parse_config(&f, &conf);
    free(cfg); /* every field is a copy */
    if (f.bad || f.left) return malformed_config();
    for (long long i = 0; i < conf.limits_n; i++) /* the parser checked each name is one of slotd_rlimits */
        for (size_t k = 0; k < sizeof slotd_rlimits / sizeof slotd_rlimits[0]; k++)
            if (!strcmp(conf.limits[2 * i], slotd_rlimits[k].name) &&
                set_limit(slotd_rlimits[k].resource, conf.limits[2 * i + 1]))
                return malformed_config();
    base_env = xmalloc(sizeof(char *) * (size_t)(conf.env_n + 1));
    for (long long i = 0; i < conf.env_n; i++) { /* execve's NAME=VALUE */
        const char *name = conf.env[2 * i], *value = conf.env[2 * i + 1];
        size_t kn = strlen(name), vn = strlen(value);
        if (!kn || strchr(name, '=')) {
            base_env[i] = NULL;
            return malformed_config();
        }
        base_env[i] = xmalloc(kn + vn + 2);
        memcpy(base_env[i], name, kn);
        base_env[i][kn] = '=';
        memcpy(base_env[i] + kn + 1, value, vn + 1);
    }
    base_env[conf.env_n] = NULL;
    n_warm = (int)conf.warm_n;
    for (int i = 0; i < n_warm; i++) {
        warm[i].kind = conf.warm[2 * i];
        warm[i].boot = conf.warm[2 * i + 1];
        warm[i].src_fd = warm[i].go_w = warm[i].pidfd = -1;
    }
    char *workspace = conf.workspace;
    upgrade_argv = conf.argv;
    run_dir = conf.run_dir;
    term_dir = conf.term_dir;
    tmux_argv = conf.tmux;
    shell_argv = conf.shell_n ? conf.shell : NULL;
    files_ws = conf.files_workspace;
    files_cwd = conf.files_cwd;
    struct stat st;
    if (stat(term_dir, &st) || !S_ISDIR(st.st_mode)) term_dir = strdup("/"); /* as supervisor.py's files.cwd */
    if (!*files_cwd)
        files_cwd = NULL;
    else if (stat(files_cwd, &st) || !S_ISDIR(st.st_mode)) /* supervisor.py's files.cwd, as above */
        files_cwd = strdup("/");
    if (!strcmp(conf.mode, "exec")) {
        /* exec_program.py's job (the terminal's tmux server): the limits and signal state set above,
           stdio on /dev/null (none of the host's pipe ends survives: the slot's code runs beside
           the program, as its uid), then the program */
        int null = open("/dev/null", O_RDWR);
        if (null < 0 || dup2(null, 0) < 0 || dup2(null, 1) < 0 || dup2(null, 2) < 0) die("/dev/null");
        if (null > 2) close(null);
        syscall(SYS_close_range, 3, ~0U, 4 /* CLOSE_RANGE_CLOEXEC */);
        if (*workspace && chdir(workspace)) { /* an image's WorkingDir gone: where bwrap put us */ }
        exec_like_popen(upgrade_argv, base_env);
        die(upgrade_argv[0]);
    }
    /* an image's WorkingDir that its root user removed: calls start at / (supervisor.py does the same) */
    root_dir = realpath(workspace, NULL);
    if (!root_dir) root_dir = realpath("/", NULL);
    last_pid_fd = open("/proc/sys/kernel/ns_last_pid", O_RDONLY | O_CLOEXEC);
    if (last_pid_fd < 0) die("/proc/sys/kernel/ns_last_pid");
    /* stdin and stdout are /dev/null (bwrap's, made sure of): what the slot runs gets its own stdio;
       the channel's descriptors are close-on-exec below, like everything else of ours */
    int devnull = open("/dev/null", O_RDWR);
    if (devnull < 0) die("/dev/null");
    dup2(devnull, 0);
    dup2(devnull, 1);
    close(devnull);
    /* what bwrap handed us beyond stdio stays here (the calls start with ours only) */
    syscall(SYS_close_range, 3, ~0U, 4 /* CLOSE_RANGE_CLOEXEC */);
    fcntl(rfd, F_SETFD, FD_CLOEXEC);
    fcntl(wfd, F_SETFD, FD_CLOEXEC);

    buf_t b = {0};
    /* the file tools' workspace: the host words their replies' paths and messages from it */
    b_fmt(&b, "{\"ok\":true,\"native\":true,\"files_workspace\":\"");
    b_b64(&b, (const unsigned char *)files_ws, strlen(files_ws));
    b_fmt(&b, "\",\"result\":{\"ready\":true,\"pid\":%d}}", (int)getpid());
    send_frame(&b);
    b.n = 0;
    idle(); /* mark is unset: the first idle starts from a clean slate, as supervisor.py's */
    char *body = NULL;
    for (;;) {
        unsigned char hdr[4];
        if (read_exact(rfd, (char *)hdr, 4)) break;
        size_t size = (size_t)hdr[0] << 24 | (size_t)hdr[1] << 16 | (size_t)hdr[2] << 8 | hdr[3];
        if (size > SLOTD_MAX_FRAME || size < 1) break;
        body = xmalloc(size);
        if (read_exact(rfd, body, size)) { free(body); break; }
        fields_t f = {body + 1, size - 1, 0};
        long seq = field_long(&f);
        guard();
        if (body[0] == SLOTD_OP_EXEC) {
            do_exec(&f, seq);
        } else if (body[0] == SLOTD_OP_TERMINAL) {
            do_terminal(&f, seq);
        } else if (body[0] == SLOTD_OP_PING) {
            slotd_ping_t r;
            slotd_parse_ping(&f, &r);
            malformed(&f, "ping");
            slotd_free_ping(&r);
            b.n = 0;
            b_fmt(&b, "{\"seq\":%ld,\"ok\":true,\"result\":{\"pong\":true}}", seq);
            send_frame(&b);
        } else if (body[0] == SLOTD_OP_READ_FILE) {
            do_read_file(&f, seq);
        } else if (body[0] == SLOTD_OP_WRITE_FILE || body[0] == SLOTD_OP_EDIT_FILE) {
            int ok = body[0] == SLOTD_OP_WRITE_FILE ? do_write_file(&f, seq) : do_edit_file(&f, seq);
            /* writes_files: the waiting python3 started before the write never serves a later call
               (its start-up read the user site, .pth files, sitecustomize; supervisor.py's
               retire_python); idle() starts another. The waiting bash read nothing: it stays. */
            for (int i = 0; ok && i < n_warm; i++)
                if (strcmp(warm[i].kind, "/bin/bash")) warm_drop(&warm[i]);
        } else if (body[0] == SLOTD_OP_LIST_DIR) {
            do_list_dir(&f, seq);
        } else if (body[0] == SLOTD_OP_STAT) {
            do_stat(&f, seq);
        } else if (body[0] == SLOTD_OP_UPGRADE) {
            slotd_upgrade_t r;
            slotd_parse_upgrade(&f, &r);
            malformed(&f, "upgrade");
            slotd_free_upgrade(&r);
            upgrade();
        } else {
            fprintf(stderr, "slotd: unknown request kind\n");
            free(body);
            free(b.p);
            return 2;
        }
        free(body);
        idle();
    }
    free(b.p); /* the host closed the pipe (or sent what no host sends): the end of this sandbox */
    return 0;
}
