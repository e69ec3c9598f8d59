/* w41: two functions doing 4:1 work, the Linux counterpart of the `mix` test guest.
 *
 * work_a and work_b run the same loop body (a 64-bit LCG step the compiler may not fold);
 * work_a runs 4 times as many iterations, so a profiler should credit about 80 % of the
 * process's samples to work_a and 20 % to work_b. Both are called alternately, in rounds,
 * so the shares hold over any long enough slice of the run.
 *
 * Usage: w41 [ROUNDS]   (default 400; one round is about 250,000 instructions)
 * Build: gcc -static -no-pie -O2 -g -o w41 w41.c
 *   (w41-fp: add -fno-omit-frame-pointer -DLEAF_FRAME)
 */
#include <stdio.h>
#include <stdlib.h>

#define CHUNK 10000UL

static inline __attribute__((always_inline)) unsigned long step(unsigned long x, unsigned long n)
{
    for (unsigned long i = 0; i < n; i++) {
        x = x * 6364136223846793005UL + 1442695040888963407UL;
        __asm__ volatile("" : "+r"(x));
    }
    return x;
}

/* Built with -DLEAF_FRAME (w41-fp, with -fno-omit-frame-pointer): gcc 12 gives a leaf function
 * that needs no stack no frame record, even with -mno-omit-leaf-frame-pointer, so a frame-pointer
 * walk from work_a would skip its caller. A volatile local makes it keep one (two instructions
 * per call, outside the loop). */
#ifdef LEAF_FRAME
#define KEEP_FRAME() do { volatile char frame = 0; (void)frame; } while (0)
#else
#define KEEP_FRAME() do { } while (0)
#endif

__attribute__((noinline)) unsigned long work_a(unsigned long x)
{
    KEEP_FRAME();
    return step(x, 4 * CHUNK);
}

__attribute__((noinline)) unsigned long work_b(unsigned long x)
{
    KEEP_FRAME();
    return step(x, CHUNK);
}

int main(int argc, char **argv)
{
    unsigned long rounds = 400;
    if (argc > 1) {
        char *end;
        rounds = strtoul(argv[1], &end, 10);
        if (*argv[1] == '\0' || *end != '\0' || rounds == 0) {
            fprintf(stderr, "w41: ROUNDS must be a positive number, not \"%s\"\n", argv[1]);
            return 2;
        }
    }
    unsigned long x = 1;
    for (unsigned long r = 0; r < rounds; r++) {
        x = work_a(x);
        x = work_b(x);
    }
    printf("w41: %lu rounds, checksum %016lx\n", rounds, x);
    return 0;
}
