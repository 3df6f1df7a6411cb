/* A file system whose locks fail, for the rehearsal (benchmarks/rehearsal.py) and the lock tests:
 * LD_PRELOAD=noflock.so NOFLOCK_UNDER=/abs/dir NOFLOCK_ERRNO=38 makes flock() and fcntl()'s lock
 * commands fail with that errno (default ENOSYS, as Lustre mounted without -o flock; 37 ENOLCK
 * as NFSv3 without lockd) on every file under the directory, and leaves every other file alone.
 * Build: gcc -shared -fPIC -O2 -o noflock.so noflock.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

static int on_failing_fs(int fd) {
    const char *under = getenv("NOFLOCK_UNDER");
    char link[64], path[4096];
    if (!under || !*under) return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0) return 0;
    path[n] = 0;
    return strncmp(path, under, strlen(under)) == 0;
}

static int failure(void) {
    const char *e = getenv("NOFLOCK_ERRNO");
    return e ? atoi(e) : ENOSYS;
}

int flock(int fd, int op) {
    static int (*real)(int, int);
    if (!real) real = (int (*)(int, int))dlsym(RTLD_NEXT, "flock");
    if (on_failing_fs(fd)) { errno = failure(); return -1; }
    return real(fd, op);
}

static int is_lock(int cmd) {
    return cmd == F_SETLK || cmd == F_SETLKW || cmd == F_GETLK
        || cmd == F_OFD_SETLK || cmd == F_OFD_SETLKW || cmd == F_OFD_GETLK;
}

#define FCNTL(name)                                                           \
int name(int fd, int cmd, ...) {                                              \
    static int (*real)(int, int, ...);                                        \
    va_list ap; va_start(ap, cmd); void *arg = va_arg(ap, void *); va_end(ap); \
    if (!real) real = (int (*)(int, int, ...))dlsym(RTLD_NEXT, #name);        \
    if (is_lock(cmd) && on_failing_fs(fd)) { errno = failure(); return -1; }  \
    return real(fd, cmd, arg);                                                \
}
FCNTL(fcntl)
FCNTL(fcntl64)
