/* GENERATED from atropos/sandbox/inslot/inslot_protocol.py by scripts/gen_slotd_header.py: do not edit.
 * The requests slotd serves and its configuration frame, their fields in the declared order
 * (tests/test_slot_protocol.py regenerates this file and compares). slotd.c defines fields_t and
 * the slotd_* readers. */
#ifndef SLOTD_PROTOCOL_H
#define SLOTD_PROTOCOL_H

#define SLOTD_MAX_FRAME 67108864u

/* exec: timeout, max_output, hard_output, cpu_seconds, stdin, env, argv */
#define SLOTD_OP_EXEC 'E'
typedef struct {
    double timeout;
    long long max_output;
    long long hard_output;
    long long cpu_seconds; /* 0 when absent */
    int has_cpu_seconds;
    char *stdin_; /* empty when absent; may hold NUL bytes */
    size_t stdin__len;
    long long env_n;
    char **env; /* 2*env_n strings: name, value, ... then NULL */
    long long argv_n;
    char **argv; /* argv_n strings, then NULL */
} slotd_exec_t;

static void slotd_parse_exec(fields_t *f, slotd_exec_t *r) {
    memset(r, 0, sizeof *r);
    r->timeout = slotd_float(f, 0.0, 10000000.0);
    r->max_output = slotd_int(f, 0LL, 268435456LL, 0);
    r->hard_output = slotd_int(f, 0LL, 1099511627776LL, 0);
    r->cpu_seconds = slotd_int(f, 1LL, 2147483648LL, &r->has_cpu_seconds);
    r->stdin_ = slotd_str(f, &r->stdin__len, 0, 67108864LL, 1);
    r->env = slotd_strs(f, &r->env_n, 0LL, 4096LL, 2);
    r->argv = slotd_strs(f, &r->argv_n, 1LL, 65536LL, 1);
}

static void slotd_free_exec(slotd_exec_t *r) {
    free(r->stdin_);
    slotd_free_strs(r->env);
    slotd_free_strs(r->argv);
}

/* terminal: input, enter, keys, wait_ms, settle_ms, cols, rows, offset, max_output */
#define SLOTD_OP_TERMINAL 'T'
typedef struct {
    char *input;
    size_t input_len;
    int enter; /* -1 when absent, else 0 or 1 */
    long long keys_n;
    char **keys; /* keys_n strings, then NULL */
    double wait_ms;
    double settle_ms;
    long long cols;
    long long rows;
    long long offset;
    long long max_output;
} slotd_terminal_t;

static void slotd_parse_terminal(fields_t *f, slotd_terminal_t *r) {
    memset(r, 0, sizeof *r);
    r->input = slotd_str(f, &r->input_len, 0LL, 67108864LL, 0);
    r->enter = slotd_bool(f, 1);
    r->keys = slotd_strs(f, &r->keys_n, 0LL, 4096LL, 1);
    r->wait_ms = slotd_float(f, 0.0, 10000000000.0);
    r->settle_ms = slotd_float(f, 0.0, 10000000000.0);
    r->cols = slotd_int(f, 1LL, 10000LL, 0);
    r->rows = slotd_int(f, 1LL, 10000LL, 0);
    r->offset = slotd_int(f, 0LL, 9223372036854775807LL, 0);
    r->max_output = slotd_int(f, 0LL, 268435456LL, 0);
}

static void slotd_free_terminal(slotd_terminal_t *r) {
    free(r->input);
    slotd_free_strs(r->keys);
}

/* ping: no fields */
#define SLOTD_OP_PING 'P'
typedef struct {
    int unused;
} slotd_ping_t;

static void slotd_parse_ping(fields_t *f, slotd_ping_t *r) {
    memset(r, 0, sizeof *r);
    (void)f;
}

static void slotd_free_ping(slotd_ping_t *r) {
    (void)r;
}

/* upgrade: no fields */
#define SLOTD_OP_UPGRADE 'U'
typedef struct {
    int unused;
} slotd_upgrade_t;

static void slotd_parse_upgrade(fields_t *f, slotd_upgrade_t *r) {
    memset(r, 0, sizeof *r);
    (void)f;
}

static void slotd_free_upgrade(slotd_upgrade_t *r) {
    (void)r;
}

/* read_file: path, offset, limit, max_bytes */
#define SLOTD_OP_READ_FILE 'R'
typedef struct {
    char *path; /* may hold NUL bytes */
    size_t path_len;
    long long offset;
    long long limit;
    long long max_bytes;
} slotd_read_file_t;

static void slotd_parse_read_file(fields_t *f, slotd_read_file_t *r) {
    memset(r, 0, sizeof *r);
    r->path = slotd_str(f, &r->path_len, 0LL, 67108864LL, 1);
    r->offset = slotd_int(f, 0LL, 9223372036854775807LL, 0);
    r->limit = slotd_int(f, 0LL, 9223372036854775807LL, 0);
    r->max_bytes = slotd_int(f, 0LL, 1099511627776LL, 0);
}

static void slotd_free_read_file(slotd_read_file_t *r) {
    free(r->path);
}

/* write_file: path, content, append */
#define SLOTD_OP_WRITE_FILE 'W'
typedef struct {
    char *path; /* may hold NUL bytes */
    size_t path_len;
    char *content; /* may hold NUL bytes */
    size_t content_len;
    int append;
} slotd_write_file_t;

static void slotd_parse_write_file(fields_t *f, slotd_write_file_t *r) {
    memset(r, 0, sizeof *r);
    r->path = slotd_str(f, &r->path_len, 0LL, 67108864LL, 1);
    r->content = slotd_str(f, &r->content_len, 0LL, 67108864LL, 1);
    r->append = slotd_bool(f, 0);
}

static void slotd_free_write_file(slotd_write_file_t *r) {
    free(r->path);
    free(r->content);
}

/* edit_file: path, old_string, new_string, replace_all, max_bytes */
#define SLOTD_OP_EDIT_FILE 'D'
typedef struct {
    char *path; /* may hold NUL bytes */
    size_t path_len;
    char *old_string; /* may hold NUL bytes */
    size_t old_string_len;
    char *new_string; /* may hold NUL bytes */
    size_t new_string_len;
    int replace_all;
    long long max_bytes;
} slotd_edit_file_t;

static void slotd_parse_edit_file(fields_t *f, slotd_edit_file_t *r) {
    memset(r, 0, sizeof *r);
    r->path = slotd_str(f, &r->path_len, 0LL, 67108864LL, 1);
    r->old_string = slotd_str(f, &r->old_string_len, 1LL, 67108864LL, 1);
    r->new_string = slotd_str(f, &r->new_string_len, 0LL, 67108864LL, 1);
    r->replace_all = slotd_bool(f, 0);
    r->max_bytes = slotd_int(f, 0LL, 1099511627776LL, 0);
}

static void slotd_free_edit_file(slotd_edit_file_t *r) {
    free(r->path);
    free(r->old_string);
    free(r->new_string);
}

/* list_dir: path */
#define SLOTD_OP_LIST_DIR 'L'
typedef struct {
    char *path; /* may hold NUL bytes */
    size_t path_len;
} slotd_list_dir_t;

static void slotd_parse_list_dir(fields_t *f, slotd_list_dir_t *r) {
    memset(r, 0, sizeof *r);
    r->path = slotd_str(f, &r->path_len, 0LL, 67108864LL, 1);
}

static void slotd_free_list_dir(slotd_list_dir_t *r) {
    free(r->path);
}

/* stat: path */
#define SLOTD_OP_STAT 'S'
typedef struct {
    char *path; /* may hold NUL bytes */
    size_t path_len;
} slotd_stat_t;

static void slotd_parse_stat(fields_t *f, slotd_stat_t *r) {
    memset(r, 0, sizeof *r);
    r->path = slotd_str(f, &r->path_len, 0LL, 67108864LL, 1);
}

static void slotd_free_stat(slotd_stat_t *r) {
    free(r->path);
}

/* the configuration (the first frame): mode, limits, env, warm, workspace, argv, run_dir, term_dir, tmux, shell, files_workspace, files_cwd */
#define SLOTD_MAX_WARM 2
/* a configuration's limits by name: setrlimit(2)'s resource of each */
static const struct { const char *name; int resource; } slotd_rlimits[] = {{"nproc", RLIMIT_NPROC}, {"as", RLIMIT_AS}, {"fsize", RLIMIT_FSIZE}, {"nofile", RLIMIT_NOFILE}, {"core", RLIMIT_CORE}};
typedef struct {
    char *mode;
    size_t mode_len;
    long long limits_n;
    char **limits; /* 2*limits_n strings: name, value, ... then NULL */
    long long env_n;
    char **env; /* 2*env_n strings: name, value, ... then NULL */
    long long warm_n;
    char **warm; /* 2*warm_n strings: name, value, ... then NULL */
    char *workspace;
    size_t workspace_len;
    long long argv_n;
    char **argv; /* argv_n strings, then NULL */
    char *run_dir;
    size_t run_dir_len;
    char *term_dir;
    size_t term_dir_len;
    long long tmux_n;
    char **tmux; /* tmux_n strings, then NULL */
    long long shell_n;
    char **shell; /* shell_n strings, then NULL */
    char *files_workspace;
    size_t files_workspace_len;
    char *files_cwd; /* empty when absent */
    size_t files_cwd_len;
} slotd_config_t;

static const char *const slotd_config_mode_choices[] = {"serve", "exec", NULL};
static const char *const slotd_config_limits_choices[] = {"nproc", "as", "fsize", "nofile", "core", NULL};
static void slotd_parse_config(fields_t *f, slotd_config_t *r) {
    memset(r, 0, sizeof *r);
    r->mode = slotd_str(f, &r->mode_len, 0, 1LL << 62, 0);
    slotd_choices(f, &r->mode, 1, 1, slotd_config_mode_choices);
    r->limits = slotd_strs(f, &r->limits_n, 0LL, 5LL, 2);
    slotd_choices(f, r->limits, r->limits_n, 2, slotd_config_limits_choices);
    r->env = slotd_strs(f, &r->env_n, 0LL, 4096LL, 2);
    r->warm = slotd_strs(f, &r->warm_n, 0LL, 2LL, 2);
    r->workspace = slotd_str(f, &r->workspace_len, 0LL, 67108864LL, 0);
    r->argv = slotd_strs(f, &r->argv_n, 1LL, 4096LL, 1);
    r->run_dir = slotd_str(f, &r->run_dir_len, 1LL, 67108864LL, 0);
    r->term_dir = slotd_str(f, &r->term_dir_len, 1LL, 67108864LL, 0);
    r->tmux = slotd_strs(f, &r->tmux_n, 1LL, 64LL, 1);
    r->shell = slotd_strs(f, &r->shell_n, 0LL, 64LL, 1);
    r->files_workspace = slotd_str(f, &r->files_workspace_len, 1LL, 67108864LL, 0);
    r->files_cwd = slotd_str(f, &r->files_cwd_len, 0, 67108864LL, 0);
}

static void slotd_free_config(slotd_config_t *r) {
    free(r->mode);
    slotd_free_strs(r->limits);
    slotd_free_strs(r->env);
    slotd_free_strs(r->warm);
    free(r->workspace);
    slotd_free_strs(r->argv);
    free(r->run_dir);
    free(r->term_dir);
    slotd_free_strs(r->tmux);
    slotd_free_strs(r->shell);
    free(r->files_workspace);
    free(r->files_cwd);
}

#endif
