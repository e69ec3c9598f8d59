/* hvrun: runs the command `cargo xtask profile` put in the initramfs, exactly as given.
 *
 * The host writes the command into the initramfs overlay it appends to the guest's
 * (xtask/src/profile.rs), as files under /hvprof/run/:
 *
 *   argv   the arguments, each ending in a NUL byte (any bytes but NUL: spaces, quotes,
 *          commas, '=', empty arguments, non-ASCII)
 *   env    KEY=VALUE entries, each ending in a NUL byte, set on top of /init's environment
 *   cwd    the working directory (its bytes, no NUL)
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
 * hvrun exits with that status, which /init passes on to the hypervisor's exit port.
 *
 * Build: gcc -static -no-pie -O2 -o hvrun hvrun.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
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
    char line[LINE_MAX_BYTES];
    size_t len;
};

static void feed(struct stream *s, const char *data, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (data[i] == '\n') {
            record(s->kind, s->line, s->len);
            s->len = 0;
            continue;
        }
        if (s->len == sizeof s->line) {
            record(s->cont, s->line, s->len);
            s->len = 0;
        }
        s->line[s->len++] = data[i];
    }
}

static void flush_stream(struct stream *s)
{
    if (s->len > 0)
        record(s->kind, s->line, s->len);
    s->len = 0;
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

    int out[2], err[2], status_pipe[2];
    if (pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC) || pipe2(status_pipe, O_CLOEXEC)) {
        say("error: pipe: %s", strerror(errno));
        return 126;
    }
    pid_t pid = fork();
    if (pid < 0) {
        say("error: fork: %s", strerror(errno));
        return 126;
    }
    if (pid == 0) {
        dup2(out[1], 1);
        dup2(err[1], 2);
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

    struct stream streams[2] = {
        {.fd = out[0], .kind = "out", .cont = "out+"},
        {.fd = err[0], .kind = "err", .cont = "err+"},
    };
    int open_streams = 2;
    char buf[4096];
    while (open_streams > 0) {
        struct pollfd fds[2];
        for (int i = 0; i < 2; i++) {
            fds[i].fd = streams[i].fd;
            fds[i].events = POLLIN;
        }
        if (poll(fds, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        for (int i = 0; i < 2; i++) {
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
            feed(&streams[i], buf, (size_t)r);
        }
    }

    int why[2];
    ssize_t why_len = read(status_pipe[0], why, sizeof why);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (why_len == (ssize_t)sizeof why) {
        if (why[0] == 0)
            say("error: cannot enter the working directory \"%s\": %s", cwd, strerror(why[1]));
        else
            say("error: cannot run \"%s\": %s", argv[0], strerror(why[1]));
        return 127;
    }
    if (WIFSIGNALED(status)) {
        int sig = WTERMSIG(status);
        say("signal %d %s", sig, strsignal(sig));
        return 128 + sig;
    }
    int code = WEXITSTATUS(status);
    say("exit %d", code);
    return code;
}
