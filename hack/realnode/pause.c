/*
 * pause - the sandbox ("infra") container of the dev cluster's real node, image
 * kvgpu.local/pause:1 (operator/kvgpu/devcluster/images.py builds it with gcc -static).
 * It holds the pod's namespaces: sleeps until SIGTERM/SIGINT, and reaps zombies, since it is
 * PID 1 of the pod when the pod shares its PID namespace.
 */
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig)
{
    (void)sig;
    _exit(0);
}

static void on_chld(int sig)
{
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0)
        ;
}

int main(int argc, char **argv)
{
    struct sigaction sa;
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        static const char v[] = "kvgpu pause 1\n";
        return write(1, v, sizeof v - 1) == (ssize_t)(sizeof v - 1) ? 0 : 1;
    }
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_term;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = on_chld;
    sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    sigaction(SIGCHLD, &sa, NULL);
    for (;;)
        pause();
}
