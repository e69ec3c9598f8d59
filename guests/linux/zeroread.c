/* zeroread: a system-call-heavy workload whose kernel path is known, for kernel call chains.
 *
 * main -> read_rounds -> read_chunk -> read(2) of 64 KiB from /dev/zero, over and over: most of
 * its time is in the kernel, in entry_SYSCALL_64 -> do_syscall_64 -> __x64_sys_read ->
 * ksys_read -> vfs_read -> read_iter_zero (which clears the user's buffer), and the rest in the
 * system call's way in and out. Built with frame pointers (like w41-fp), so a kernel chain goes
 * on into its user callers. glibc's read() wrapper keeps no frame record: a frame-pointer walk
 * from it goes from read() to read_rounds, without read_chunk.
 *
 * Usage: zeroread [ROUNDS]   (default 2000)
 * Build: gcc -static -no-pie -O2 -g -fno-omit-frame-pointer -o zeroread zeroread.c
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define CHUNK 65536

static char buf[CHUNK];

__attribute__((noinline)) long read_chunk(int fd)
{
    long n = read(fd, buf, CHUNK);
    /* Not a sibling call (a jump to read() that would leave no frame of read_chunk's). */
    __asm__ volatile("" ::: "memory");
    return n;
}

__attribute__((noinline)) long read_rounds(int fd, unsigned long rounds)
{
    long total = 0;
    for (unsigned long r = 0; r < rounds; r++) {
        long n = read_chunk(fd);
        if (n != CHUNK) {
            return -1;
        }
        total += n + buf[r % CHUNK];
    }
    return total;
}

int main(int argc, char **argv)
{
    unsigned long rounds = 2000;
    if (argc > 1) {
        char *end;
        rounds = strtoul(argv[1], &end, 10);
        if (*argv[1] == '\0' || *end != '\0' || rounds == 0) {
            fprintf(stderr, "zeroread: ROUNDS must be a positive number, not \"%s\"\n", argv[1]);
            return 2;
        }
    }
    int fd = open("/dev/zero", O_RDONLY);
    if (fd < 0) {
        perror("zeroread: /dev/zero");
        return 1;
    }
    long total = read_rounds(fd, rounds);
    if (total < 0) {
        fprintf(stderr, "zeroread: a short read\n");
        return 1;
    }
    printf("zeroread: %lu rounds, %ld bytes\n", rounds, total);
    return 0;
}
