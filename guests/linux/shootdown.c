/* shootdown: one thread changes its process's page tables while a sibling thread of the same
 * process runs on the other CPU. Each change (a page made read-only) needs a TLB shootdown: an
 * IPI to the other CPU, which the kernel waits for, spinning at CPL 0 with PAUSE (the
 * csd_lock_wait loop inlined in smp_call_function_many_cond) until the other CPU has flushed.
 *
 * On two vCPUs that share one pCPU, the IPI's target is a vCPU that lost its pCPU: the sender
 * spins until the target runs again. Without pause-loop exiting that is the rest of its slice;
 * with it (ple=on), a PLE window, after which the hypervisor runs another vCPU; with a directed
 * yield (ple=directed), the target itself.
 *
 * Thread 0 (CPU 0), CHANGES times: makes the page read-only (the shootdown), makes it writable
 * again and writes it (so that the next change has a writable entry to take away), then
 * change_work (WORK loop steps), once thread 1 runs on CPU SIBLING (sibling_work, until thread 0
 * is done). With BUSY, a child process (another address space: no shootdown reaches it) runs
 * busy_work on CPU BUSY meanwhile: on one pCPU, the vCPU a plain yield gives the pCPU to first
 * when BUSY is between 0 and SIBLING in the vCPUs' order.
 *
 * Usage: shootdown [CHANGES [WORK [SIBLING [BUSY]]]]   (defaults 40, 20000, 1, none; a loop step
 *        is 5 instructions)
 * Build: gcc -static -no-pie -O2 -g -pthread -o shootdown shootdown.c
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

static unsigned long changes = 40, work = 20000, sibling_cpu = 1;
static volatile int done, started;
static volatile unsigned char *page;

static inline __attribute__((always_inline)) unsigned long step(unsigned long x, unsigned long n)
{
    for (unsigned long i = 0; i < n; i++) {
        x = x * 6364136223846793005UL + 1442695040888963407UL;
        __asm__ volatile("" : "+r"(x));
    }
    return x;
}

/* Thread 0's work between two changes. */
__attribute__((noinline)) unsigned long change_work(unsigned long x)
{
    return step(x, work);
}

/* The child's work, until it is killed. */
__attribute__((noinline, noreturn)) void busy_work(void)
{
    unsigned long x = 3;
    for (;;)
        x = step(x, 1000);
}

/* Thread 1's work, in short rounds until thread 0 is done. */
__attribute__((noinline)) unsigned long sibling_work(unsigned long x)
{
    while (!done)
        x = step(x, 1000);
    return x;
}

static int bind(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set)) {
        perror("shootdown: sched_setaffinity");
        return -1;
    }
    return 0;
}

struct result {
    unsigned long checksum;
    int error;
};

static void *sibling(void *arg)
{
    struct result *r = arg;
    r->error = bind((int)sibling_cpu);
    started = 1;
    if (!r->error)
        r->checksum = sibling_work(2);
    return NULL;
}

static unsigned long number(const char *s, const char *what, unsigned long least)
{
    char *end;
    unsigned long n = strtoul(s, &end, 10);
    if (*s == '\0' || *end != '\0' || n < least) {
        fprintf(stderr, "shootdown: %s must be a number from %lu, not \"%s\"\n", what, least, s);
        exit(2);
    }
    return n;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        changes = number(argv[1], "CHANGES", 1);
    if (argc > 2)
        work = number(argv[2], "WORK", 1);
    if (argc > 3)
        sibling_cpu = number(argv[3], "SIBLING", 1);
    pid_t busy = 0;
    if (argc > 4) {
        int cpu = (int)number(argv[4], "BUSY", 1);
        busy = fork();
        if (busy < 0) {
            perror("shootdown: fork");
            return 1;
        }
        if (busy == 0) {
            if (bind(cpu))
                _exit(1);
            busy_work();
        }
    }
    if (bind(0))
        return 1;
    page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (page == MAP_FAILED) {
        perror("shootdown: mmap");
        return 1;
    }
    page[0] = 1;
    struct result other = {0};
    pthread_t thread;
    int e = pthread_create(&thread, NULL, sibling, &other);
    if (e) {
        fprintf(stderr, "shootdown: pthread_create: %s\n", strerror(e));
        return 1;
    }
    /* The sibling runs on CPU 1 first: only a CPU that runs the process takes its shootdowns. */
    while (!started)
        __builtin_ia32_pause();
    unsigned long x = 1;
    for (unsigned long i = 0; i < changes; i++) {
        if (mprotect((void *)page, 4096, PROT_READ) || mprotect((void *)page, 4096, PROT_READ | PROT_WRITE)) {
            perror("shootdown: mprotect");
            done = 1;
            pthread_join(thread, NULL);
            if (busy > 0)
                kill(busy, SIGKILL);
            return 1;
        }
        page[0]++;
        x = change_work(x);
    }
    done = 1;
    pthread_join(thread, NULL);
    if (busy > 0) {
        kill(busy, SIGKILL);
        waitpid(busy, NULL, 0);
    }
    if (other.error)
        return 1;
    printf("shootdown: %lu changes of %lu steps, page %u, checksums %016lx %016lx\n", changes, work,
           page[0], x, other.checksum);
    return 0;
}
