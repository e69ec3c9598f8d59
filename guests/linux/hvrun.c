/* hvrun: runs the command `cargo xtask profile` put in the initramfs, exactly as given.
 *
 * The host writes the command into the initramfs overlay it appends to the guest's
 * (xtask/src/profile.rs), as files under /hvprof/run/:
 *
 *   argv   the arguments, each ending in a NUL byte (any bytes but NUL: spaces, quotes,
 *          commas, '=', empty arguments, non-ASCII)
 *   env    KEY=VALUE entries, each ending in a NUL byte, set on top of /init's environment
 *   cwd    the working directory (its bytes, no NUL)
 *   copies how many copies to run at once (default 1); copy i is bound to CPU i modulo the
 *          CPUs online, and each of its lines starts with "[copy i] "
 *
 * The command's stdout and stderr go to /dev/kmsg as they come, one record per line:
 * "hvprof-guest: out LINE" and "hvprof-guest: err LINE" (a line longer than LINE_MAX bytes is
 * cut into records of that size, each but the last marked "out+" / "err+"), so the host can
 * show them live and tell them apart. Then one line says how it ended:
 *
 *   hvprof-guest: exit N                    it exited with status N
 *   hvprof-guest: signal N NAME             a signal ended it (status 128 + N)
 *   hvprof-guest: error: cannot run ...     it could not be started (status 127): not found,
 *                                           not executable, or not a program this CPU runs
 *
 * With several copies each one's end is said ("copy I ended with status N"), and the status is
 * the first copy's that is not 0.
 *
 * When the VM has an output store (`output=` in its module line: docs/GUEST-ABI.md, "Output";
 * `cargo xtask profile` gives it one), every byte the command writes also goes to the
 * hypervisor's output leaf, CPUID 0x40000002, a read's worth per CPUID, and the hypervisor keeps
 * it whole in the sample log (`hvprof-analyze output`). The console then shows only the first LIVE_LINES lines of each
 * stream, and says once that the rest is in the capture: a megabyte through the console would
 * take a trapped OUT per byte and the line's 87 us a byte, and flood the terminal.
 * Without the store every line goes to the console, which drops what is over its rate.
 *
 * hvrun exits with that status, which /init passes on to the hypervisor's exit port.
 *
 * Build: gcc -static -no-pie -O2 -o hvrun hvrun.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define RUN_DIR "/hvprof/run"
/* The kernel keeps at most about 1,000 bytes of one /dev/kmsg record; the prefix comes first. */
#define LINE_MAX_BYTES 900

static int kmsg = -1;

/* The hypervisor's output leaf (docs/GUEST-ABI.md, "Output"), when the VM has a store. */
#define OUTPUT_LEAF 0x40000002u
#define OUTPUT_MAX (64 * 1024)
/* Lines of each stream shown on the console when the output leaf keeps them all. */
#define LIVE_LINES 100
static int output_leaf;

static void cpuid4(unsigned leaf, unsigned sub, unsigned long rsi, unsigned long rdi,
                   unsigned *a, unsigned *b)
{
    unsigned c = sub, d;
    *a = leaf;
    __asm__ volatile("cpuid"
                     : "+a"(*a), "=b"(*b), "+c"(c), "=d"(d)
                     : "S"(rsi), "D"(rdi)
                     : "memory");
}

/* Whether the VM has an output store: hvprof's signature at 0x40000000, the leaf within its
 * range, and EBX = 1 from the leaf's query (ECX = 0). */
static int probe_output_leaf(void)
{
    unsigned a, b;
    cpuid4(0x40000000u, 0, 0, 0, &a, &b);
    if (a < OUTPUT_LEAF || b != 0x72707668u /* "hvpr" */)
        return 0;
    cpuid4(OUTPUT_LEAF, 0, 0, 0, &a, &b);
    return b == 1;
}

/* Hands `len` bytes of stream 1 (stdout) or 2 (stderr) to the hypervisor: CPUID with the stream
 * in ECX, the address in RSI and the count in RDI (EAX comes back as the bytes kept; what is not
 * kept, the hypervisor counts as lost). */
static void output_write(int stream, const char *data, size_t len)
{
    while (len > 0) {
        size_t n = len > OUTPUT_MAX ? OUTPUT_MAX : len;
        unsigned kept, b;
        cpuid4(OUTPUT_LEAF, (unsigned)stream, (unsigned long)data, n, &kept, &b);
        data += n;
        len -= n;
    }
}

/* One record on /dev/kmsg at level 2 (shown on the console whatever the log level). */
static void record(const char *kind, const char *data, size_t len)
{
    char buf[LINE_MAX_BYTES + 64];
    int n = kind[0] ? snprintf(buf, sizeof buf, "<2>hvprof-guest: %s ", kind)
                    : snprintf(buf, sizeof buf, "<2>hvprof-guest: ");
    if (len > LINE_MAX_BYTES)
        len = LINE_MAX_BYTES;
    memcpy(buf + n, data, len);
    n += (int)len;
    buf[n++] = '\n';
    if (kmsg >= 0 && write(kmsg, buf, (size_t)n) < 0) {
        /* The console is gone: nothing else to report to. */
    }
}

static void say(const char *fmt, ...)
{
    char buf[LINE_MAX_BYTES];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof buf)
        n = sizeof buf - 1;
    record("", buf, (size_t)n);
}

/* The whole file at `path`, NUL-terminated (its length in *len), or NULL when it is missing. */
static char *slurp(const char *path, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap + 1);
    for (;;) {
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
        ssize_t r = read(fd, buf + n, cap - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    close(fd);
    buf[n] = 0;
    *len = n;
    return buf;
}

/* The NUL-terminated strings of `buf` as a NULL-terminated array. */
static char **split(char *buf, size_t len, size_t *count)
{
    size_t n = 0;
    for (size_t i = 0; i < len; i++)
        n += buf[i] == 0;
    char **v = calloc(n + 1, sizeof *v);
    size_t k = 0;
    for (size_t i = 0; i < len && k < n; k++) {
        v[k] = buf + i;
        i += strlen(buf + i) + 1;
    }
    *count = n;
    return v;
}

/* What one of the command's pipes has sent, cut into lines. */
struct stream {
    int fd;
    const char *kind, *cont;
    /* Put before each line ("[copy N] " with several copies). */
    char prefix[24];
    char line[LINE_MAX_BYTES];
    size_t len;
    /* Lines shown on the console so far (limited to LIVE_LINES with the output leaf). */
    unsigned long shown;
};

/* One line (or piece) of a stream on the console, unless the output leaf keeps them and
 * LIVE_LINES were shown: then a note, once. */
static void show(struct stream *s, const char *kind)
{
    if (output_leaf && s->shown >= LIVE_LINES) {
        if (s->shown == LIVE_LINES)
            say("note: %s: more lines than the %d shown live; all of it is in the capture",
                s->kind, LIVE_LINES);
        s->shown = LIVE_LINES + 1;
        return;
    }
    record(kind, s->line, s->len);
    s->shown++;
}

static void feed(struct stream *s, const char *data, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (s->len == 0 && s->prefix[0]) {
            s->len = strlen(s->prefix);
            memcpy(s->line, s->prefix, s->len);
        }
        if (data[i] == '\n') {
            show(s, s->kind);
            s->len = 0;
            continue;
        }
        if (s->len == sizeof s->line) {
            show(s, s->cont);
            s->len = 0;
        }
        s->line[s->len++] = data[i];
    }
}

static void flush_stream(struct stream *s)
{
    if (s->len > 0)
        show(s, s->kind);
    s->len = 0;
}


/* At most this many copies of the command at once (`--copies`). */
#define MAX_COPIES 64

/* One running copy of the command: its pid, its stdout and stderr pipes, and the pipe that
 * says why it could not start. */
struct copy {
    pid_t pid;
    int pipes[2];
    int why;
};

/* Starts a copy (bound to CPU `cpu` unless it is -1). */
static int start(struct copy *c, long index, long cpu, char **argv, char **env, size_t envc,
                 const char *cwd, size_t cwd_len)
{
    int out[2], err[2], status_pipe[2];
    if (pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC) || pipe2(status_pipe, O_CLOEXEC)) {
        say("error: pipe: %s", strerror(errno));
        return -1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        say("error: fork: %s", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        dup2(out[1], 1);
        dup2(err[1], 2);
        if (cpu >= 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET((int)cpu, &set);
            if (sched_setaffinity(0, sizeof set, &set) != 0)
                fprintf(stderr, "hvrun: copy %ld: cannot bind to cpu %ld: %s\n", index, cpu,
                        strerror(errno));
        }
        for (size_t i = 0; i < envc; i++) {
            char *eq = strchr(env[i], '=');
            if (eq == NULL)
                continue;
            *eq = 0;
            setenv(env[i], eq + 1, 1);
        }
        /* Why it could not start goes to the parent through a pipe exec would have closed:
         * which step failed and its errno. */
        int why[2] = {0, 0};
        if (cwd != NULL && cwd_len > 0 && chdir(cwd) != 0) {
            why[1] = errno;
        } else {
            execvp(argv[0], argv);
            why[0] = 1;
            why[1] = errno;
        }
        if (write(status_pipe[1], why, sizeof why) < 0) {
            /* The parent then reports status 127 without a reason. */
        }
        _exit(127);
    }
    close(out[1]);
    close(err[1]);
    close(status_pipe[1]);
    c->pid = pid;
    c->pipes[0] = out[0];
    c->pipes[1] = err[0];
    c->why = status_pipe[0];
    return 0;
}

/* Waits for a copy; says why it could not start, if it could not; returns its status, or minus
 * the signal that ended it. */
static int finish(struct copy *c, const char *command, const char *cwd)
{
    int why[2];
    ssize_t why_len = read(c->why, why, sizeof why);
    close(c->why);
    int status = 0;
    while (waitpid(c->pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (why_len == (ssize_t)sizeof why) {
        if (why[0] == 0)
            say("error: cannot enter the working directory \"%s\": %s", cwd, strerror(why[1]));
        else
            say("error: cannot run \"%s\": %s", command, strerror(why[1]));
        return 127;
    }
    if (WIFSIGNALED(status))
        return -WTERMSIG(status);
    return WEXITSTATUS(status);
}

/* `hvrun [DIR]`: DIR instead of /hvprof/run, and the records on stdout instead of /dev/kmsg
 * (to try it on the host). */
int main(int hv_argc, char **hv_argv)
{
    const char *dir = hv_argc > 1 ? hv_argv[1] : RUN_DIR;
    kmsg = hv_argc > 1 ? dup(1) : open("/dev/kmsg", O_WRONLY | O_CLOEXEC);
    char path[4096];
    size_t argv_len = 0, env_len = 0, cwd_len = 0, argc = 0, envc = 0;
    snprintf(path, sizeof path, "%s/argv", dir);
    char *argv_buf = slurp(path, &argv_len);
    if (argv_buf == NULL) {
        say("error: no %s: nothing to run", path);
        return 126;
    }
    char **argv = split(argv_buf, argv_len, &argc);
    if (argc == 0) {
        say("error: %s holds no argument", path);
        return 126;
    }
    snprintf(path, sizeof path, "%s/env", dir);
    char *env_buf = slurp(path, &env_len);
    char **env = env_buf ? split(env_buf, env_len, &envc) : NULL;
    snprintf(path, sizeof path, "%s/cwd", dir);
    char *cwd = slurp(path, &cwd_len);

    snprintf(path, sizeof path, "%s/copies", dir);
    size_t copies_len = 0;
    char *copies_text = slurp(path, &copies_len);
    long copies = copies_text ? strtol(copies_text, NULL, 10) : 1;
    if (copies < 1 || copies > MAX_COPIES) {
        say("error: %ld copies: 1 to %d", copies, MAX_COPIES);
        return 126;
    }
    output_leaf = hv_argc == 1 && probe_output_leaf();
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (cpus < 1)
        cpus = 1;

    struct copy run[MAX_COPIES];
    struct stream streams[2 * MAX_COPIES];
    for (long c = 0; c < copies; c++) {
        if (start(&run[c], c, copies > 1 ? c % cpus : -1, argv, env, envc, cwd, cwd_len) != 0)
            return 126;
        for (int k = 0; k < 2; k++) {
            struct stream *st = &streams[2 * c + k];
            memset(st, 0, sizeof *st);
            st->fd = run[c].pipes[k];
            st->kind = k ? "err" : "out";
            st->cont = k ? "err+" : "out+";
            if (copies > 1)
                snprintf(st->prefix, sizeof st->prefix, "[copy %ld] ", c);
        }
    }

    /* Every copy's output as it comes, line by line. */
    int n = (int)(2 * copies), open_streams = n;
    char buf[4096];
    while (open_streams > 0) {
        struct pollfd fds[2 * MAX_COPIES];
        for (int i = 0; i < n; i++) {
            fds[i].fd = streams[i].fd;
            fds[i].events = POLLIN;
        }
        if (poll(fds, (nfds_t)n, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        for (int i = 0; i < n; i++) {
            if (streams[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            ssize_t r = read(streams[i].fd, buf, sizeof buf);
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0) {
                flush_stream(&streams[i]);
                close(streams[i].fd);
                streams[i].fd = -1;
                open_streams--;
                continue;
            }
            if (output_leaf)
                output_write(i % 2 ? 2 : 1, buf, (size_t)r);
            feed(&streams[i], buf, (size_t)r);
        }
    }

    /* How each copy ended; the status is the first copy's that failed (else 0). */
    int status = 0;
    for (long c = 0; c < copies; c++) {
        int code = finish(&run[c], argv[0], cwd);
        if (copies > 1)
            say("copy %ld ended with status %d", c, code < 0 ? 128 - code : code);
        if (status == 0)
            status = code;
    }
    if (status < 0) {
        say("signal %d %s", -status, strsignal(-status));
        return 128 - status;
    }
    if (status != 127)
        say("exit %d", status);
    return status;
}
