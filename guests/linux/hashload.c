/* hashload: hashes N KiB through the kernel's crypto API (AF_ALG) with an algorithm that a
 * loadable module provides (wp512 by default), so that the work runs in that module's code.
 *
 *   hashload KIB [ALGORITHM] [ROUNDS]
 *
 * Prints the digest of each round's KIB KiB of a fixed pattern (the same every run).
 * The kernel side needs af_alg.ko, algif_hash.ko and the algorithm's module (wp512.ko).
 */
#include <linux/if_alg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    long kib = argc > 1 ? atol(argv[1]) : 256;
    const char *alg = argc > 2 ? argv[2] : "wp512";
    long rounds = argc > 3 ? atol(argv[3]) : 1;
    struct sockaddr_alg sa = { .salg_family = AF_ALG, .salg_type = "hash" };
    static unsigned char chunk[4096];
    unsigned char digest[64];

    if (kib <= 0 || rounds <= 0 || strlen(alg) >= sizeof(sa.salg_name)) {
        fprintf(stderr, "usage: hashload KIB [ALGORITHM] [ROUNDS]\n");
        return 2;
    }
    strcpy((char *)sa.salg_name, alg);
    for (size_t i = 0; i < sizeof(chunk); i++)
        chunk[i] = (unsigned char)(i * 131 + 7);

    int tfm = socket(AF_ALG, SOCK_SEQPACKET, 0);
    if (tfm < 0) {
        perror("socket(AF_ALG) (is af_alg.ko loaded?)");
        return 1;
    }
    if (bind(tfm, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        fprintf(stderr, "bind hash %s: ", alg);
        perror("(are algif_hash.ko and the algorithm's module loaded?)");
        return 1;
    }
    for (long r = 0; r < rounds; r++) {
        int op = accept(tfm, NULL, 0);
        if (op < 0) {
            perror("accept");
            return 1;
        }
        for (long k = 0; k < kib; k += 4) {
            if (send(op, chunk, sizeof(chunk), MSG_MORE) != (ssize_t)sizeof(chunk)) {
                perror("send");
                return 1;
            }
        }
        ssize_t n = read(op, digest, sizeof(digest));
        if (n <= 0) {
            perror("read digest");
            return 1;
        }
        printf("%s %ld KiB:", alg, kib);
        for (ssize_t i = 0; i < n; i++)
            printf("%02x", digest[i]);
        printf("\n");
        close(op);
    }
    close(tfm);
    return 0;
}
