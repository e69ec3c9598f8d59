/* lockholder: two threads contend for one spinlock, each bound to a CPU of its own.
 *
 * Each thread, ROUNDS times: takes a ticket, spins in spin_wait until the lock is its turn,
 * runs critical_work with the lock held (CRITICAL loop steps), releases it, runs outside_work
 * (CRITICAL / 64 steps). The lock is a ticket lock, so the two threads take turns and both
 * finish whatever the scheduling.
 *
 * On two vCPUs that share one pCPU, the hypervisor preempts a vCPU at the end of its slice,
 * most likely inside critical_work (the longest stretch): the other vCPU's thread then spins in
 * spin_wait for its whole slice, waiting for a holder that cannot run. That is lock-holder
 * preemption: a profile of the whole machine shows one vCPU's spin_wait while the other vCPU's
 * time is [steal], preempted in critical_work.
 *
 * Usage: lockholder [ROUNDS [CRITICAL]]   (defaults 12 and 600000; a loop step is 5
 *        instructions, so one critical section is 3 M instructions)
 * Build: gcc -static -no-pie -O2 -g -pthread -o lockholder lockholder.c
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct {
    unsigned next;           /* the next ticket to hand out */
    volatile unsigned owner; /* the ticket that holds the lock */
} lock;

static unsigned long rounds = 12, critical = 600000;

static inline __attribute__((always_inline)) unsigned long step(unsigned long x, unsigned long n)
{
    for (unsigned long i = 0; i < n; i++) {
        x = x * 6364136223846793005UL + 1442695040888963407UL;
        __asm__ volatile("" : "+r"(x));
    }
    return x;
}

/* Waits for the lock to be `ticket`'s turn. */
__attribute__((noinline)) void spin_wait(unsigned ticket)
{
    while (__atomic_load_n(&lock.owner, __ATOMIC_ACQUIRE) != ticket)
        __builtin_ia32_pause();
}

/* The work done with the lock held. */
__attribute__((noinline)) unsigned long critical_work(unsigned long x)
{
    return step(x, critical);
}

/* The work done without it. */
__attribute__((noinline)) unsigned long outside_work(unsigned long x)
{
    return step(x, critical / 64);
}

struct worker {
    int cpu;
    unsigned long checksum;
    int error;
};

static void *run(void *arg)
{
    struct worker *w = arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(w->cpu, &set);
    w->error = sched_setaffinity(0, sizeof set, &set);
    if (w->error) {
        perror("lockholder: sched_setaffinity");
        return NULL;
    }
    unsigned long x = (unsigned long)w->cpu + 1;
    for (unsigned long r = 0; r < rounds; r++) {
        unsigned ticket = __atomic_fetch_add(&lock.next, 1, __ATOMIC_RELAXED);
        spin_wait(ticket);
        x = critical_work(x);
        __atomic_store_n(&lock.owner, ticket + 1, __ATOMIC_RELEASE);
        x = outside_work(x);
    }
    w->checksum = x;
    return NULL;
}

static unsigned long number(const char *s, const char *what)
{
    char *end;
    unsigned long n = strtoul(s, &end, 10);
    if (*s == '\0' || *end != '\0' || n == 0) {
        fprintf(stderr, "lockholder: %s must be a positive number, not \"%s\"\n", what, s);
        exit(2);
    }
    return n;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        rounds = number(argv[1], "ROUNDS");
    if (argc > 2)
        critical = number(argv[2], "CRITICAL");
    struct worker workers[2] = {{.cpu = 0}, {.cpu = 1}};
    pthread_t threads[2];
    for (int i = 0; i < 2; i++) {
        int e = pthread_create(&threads[i], NULL, run, &workers[i]);
        if (e) {
            fprintf(stderr, "lockholder: pthread_create: %s\n", strerror(e));
            return 1;
        }
    }
    int failed = 0;
    for (int i = 0; i < 2; i++) {
        pthread_join(threads[i], NULL);
        failed |= workers[i].error != 0;
    }
    if (failed)
        return 1;
    printf("lockholder: 2 threads x %lu rounds of %lu steps, checksums %016lx %016lx\n", rounds,
           critical, workers[0].checksum, workers[1].checksum);
    return 0;
}
