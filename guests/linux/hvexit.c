/* hvexit: ends a test run by writing one byte to I/O port 0xf4.
 *
 * The hypervisor traps the port and stops the VM (QEMU's isa-debug-exit device at iobase 0xf4
 * exits with status (VALUE << 1) | 1). The write needs ioperm(), so root.
 *
 * Usage: hvexit [VALUE]   (0..255, default 0)
 * Build: gcc -static -no-pie -O2 -o hvexit hvexit.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/io.h>

#define EXIT_PORT 0xf4

int main(int argc, char **argv)
{
    long value = argc > 1 ? strtol(argv[1], NULL, 0) : 0;
    if (value < 0 || value > 255) {
        fprintf(stderr, "hvexit: VALUE must be 0..255, not \"%s\"\n", argv[1]);
        return 2;
    }
    if (ioperm(EXIT_PORT, 1, 1) != 0) {
        perror("hvexit: ioperm(0xf4)");
        return 1;
    }
    outb((unsigned char)value, EXIT_PORT);
    /* Still running: nothing trapped the port. */
    fprintf(stderr, "hvexit: wrote %ld to port 0xf4, but the machine did not stop\n", value);
    return 1;
}
