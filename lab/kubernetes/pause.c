/* pause: the sandbox process of the labs' pods (Kubernetes lab, e2e runtime tier).
 *
 * Holds a pod's namespaces open and does nothing else: sleeps until SIGTERM or SIGINT (exit 0),
 * reaps any child that gets re-parented to it (it is PID 1 in its PID namespace).
 * Built static by lab/kubernetes/images.py (gcc -static) so the image needs no libc.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) { _exit(sig == SIGTERM || sig == SIGINT ? 0 : 1); }

static void on_child(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(int argc, char **argv) {
    struct sigaction sa;
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        puts("tabby-e2e-pause 1");
        return 0;
    }
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_stop;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = on_child;
    sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    sigaction(SIGCHLD, &sa, NULL);
    for (;;) {
        pause();
    }
}
