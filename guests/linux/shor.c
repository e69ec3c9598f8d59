/* shor: Shor's factoring with libquantum 1.1.1 (Debian libquantum-dev), the paper's libquantum
 * workload. The steps of libquantum's own shor demo, made repeatable: a fixed base x and a fixed
 * seed for the measurements (libquantum draws them with rand()).
 *
 * libquantum-dev is built with OpenMP: the gates' loops are outlined into local functions
 * (quantum_toffoli._omp_fn.0, quantum_cnot._omp_fn.0, quantum_sigma_x._omp_fn.0, ...). Linked
 * statically with libgomp it runs them on OMP_NUM_THREADS threads: set OMP_NUM_THREADS=1 for
 * one thread (the /init does).
 *
 * Usage: shor [N [X [SEED [REPEAT]]]]   (default N=35, X=2, SEED=1, REPEAT=1)
 *
 * N=35 is about 260 M instructions (valgrind --tool=callgrind), N=221 several G: too long under
 * an instruction-counting emulator. REPEAT runs the same factoring again (native ground truth).
 * Build: gcc -static -no-pie -O2 -g -I<libquantum>/usr/include -o shor shor.c \
 *            <libquantum>/usr/lib/x86_64-linux-gnu/libquantum.a -fopenmp -lm
 */
#include <stdio.h>
#include <stdlib.h>
#include <quantum.h>

/* One run of the algorithm; prints what it found. */
static void factor(int n, int x)
{
    int width = quantum_getwidth(n * n);
    int swidth = quantum_getwidth(n);

    quantum_reg qr = quantum_new_qureg(0, width);
    for (int i = 0; i < width; i++)
        quantum_hadamard(i, &qr);
    quantum_addscratch(3 * swidth + 2, &qr);
    quantum_exp_mod_n(n, x, width, swidth, &qr);
    for (int i = 0; i < 3 * swidth + 2; i++)
        quantum_bmeasure(0, &qr);
    quantum_qft(width, &qr);
    for (int i = 0; i < width / 2; i++) {
        quantum_cnot(i, width - i - 1, &qr);
        quantum_cnot(width - i - 1, i, &qr);
        quantum_cnot(i, width - i - 1, &qr);
    }
    int c = (int)quantum_measure(qr);
    quantum_delete_qureg(&qr);
    if (c <= 0) {
        printf("shor: measured %d, no period this time\n", c);
        return;
    }
    int q = 1 << width;
    quantum_frac_approx(&c, &q, width);
    if (q % 2 == 1 && 2 * q < (1 << width))
        q *= 2;
    if (q % 2 == 1) {
        printf("shor: odd period %d, no factors this time\n", q);
        return;
    }
    int a = quantum_gcd(n, quantum_ipow(x, q / 2) + 1);
    int b = quantum_gcd(n, quantum_ipow(x, q / 2) - 1);
    int f = a > b ? a : b;
    if (f > 1 && f < n)
        printf("shor: period %d, %d = %d * %d\n", q, n, f, n / f);
    else
        printf("shor: period %d, no factors this time\n", q);
}

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 35;
    int x = argc > 2 ? atoi(argv[2]) : 2;
    unsigned seed = argc > 3 ? (unsigned)atoi(argv[3]) : 1;
    int repeat = argc > 4 ? atoi(argv[4]) : 1;
    if (n < 15 || n > 255) {
        fprintf(stderr, "shor: N must be 15..255, not \"%s\"\n", argv[1]);
        return 2;
    }
    if (x < 2 || x >= n || quantum_gcd(n, x) != 1) {
        fprintf(stderr, "shor: X must be in 2..N-1 and coprime to N (N=%d, X=%d)\n", n, x);
        return 2;
    }
    if (repeat < 1) {
        fprintf(stderr, "shor: REPEAT must be at least 1, not \"%s\"\n", argv[4]);
        return 2;
    }
    printf("shor: N = %d, x = %d, %d qubits, %d run(s)\n", n, x,
           quantum_getwidth(n * n) + 3 * quantum_getwidth(n) + 2, repeat);
    for (int r = 0; r < repeat; r++) {
        /* The same measurements every run. */
        srand(seed);
        factor(n, x);
    }
    return 0;
}
