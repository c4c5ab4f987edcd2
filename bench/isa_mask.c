/* Holds a process to AVX2 (x86-64-v3, no AVX-512, no VNNI, no AMX) on a CPU that has more: loaded with
 * LD_PRELOAD, it turns on Linux's CPUID faulting (arch_prctl(ARCH_SET_CPUID, 0); /proc/cpuinfo flag
 * `cpuid_fault`) and answers every CPUID instruction from a SIGSEGV handler with the machine's own answer,
 * the feature bits above AVX2 cleared.  Libraries that pick their kernels from CPUID at run time
 * (onnxruntime's MLAS, OpenVINO's oneDNN) then run their AVX2 kernels: the peers of an `-mcpu=x86-64-v3`
 * build, measured on the same cores, caches and memory.  Built and used by bench/isa_mask.py.
 *
 * Linux: arch_prctl(2) (ARCH_GET_CPUID / ARCH_SET_CPUID, since 4.12).  Bits: Intel SDM vol. 2A, CPUID
 * leaf 07H (sub-leaves 0 and 1).  The flag is per thread and inherited by threads created after it is set,
 * so it is set in a constructor, before the program starts any; glibc's own string functions chose their
 * variants before it (they stay AVX-512 where the CPU has it: a few memcpy calls, not the kernels).
 *
 * Other libraries install SIGSEGV handlers of their own (TVM's and torch's crash backtraces): this library's
 * sigaction() keeps its handler in place, records theirs, and passes them every fault that is not a CPUID. */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static void real_cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

static void mask(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    if (leaf == 7 && sub == 0) {
        /* EBX: AVX512F 16, DQ 17, IFMA 21, PF 26, ER 27, CD 28, BW 30, VL 31 */
        r[1] &= ~((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) | (1u << 28) | (1u << 30) |
                  (1u << 31));
        /* ECX: AVX512_VBMI 1, VBMI2 6, VNNI 11, BITALG 12, VPOPCNTDQ 14 */
        r[2] &= ~((1u << 1) | (1u << 6) | (1u << 11) | (1u << 12) | (1u << 14));
        /* EDX: 4VNNIW 2, 4FMAPS 3, VP2INTERSECT 8, AMX-BF16 22, AVX512_FP16 23, AMX-TILE 24, AMX-INT8 25 */
        r[3] &= ~((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | (1u << 24) | (1u << 25));
    } else if (leaf == 7 && sub == 1) {
        /* EAX: AVX-VNNI 4, AVX512_BF16 5, AMX-FP16 21, AVX-IFMA 23; EDX: AVX-VNNI-INT8 4, AVX-NE-CONVERT 5,
         * AMX-COMPLEX 8, AVX-VNNI-INT16 10, AVX10 19 */
        r[0] &= ~((1u << 4) | (1u << 5) | (1u << 21) | (1u << 23));
        r[3] &= ~((1u << 4) | (1u << 5) | (1u << 8) | (1u << 10) | (1u << 19));
    } else if (leaf == 0x1d || leaf == 0x1e || leaf == 0x24) {
        r[0] = r[1] = r[2] = r[3] = 0; /* AMX tile and TMUL descriptions, AVX10 */
    }
}

typedef int (*sigaction_fn)(int, const struct sigaction *, struct sigaction *);
static sigaction_fn real_sigaction;
static struct sigaction next_handler; /* the program's own SIGSEGV handler (SIG_DFL until it sets one) */

static void on_segv(int sig, siginfo_t *info, void *context) {
    ucontext_t *uc = (ucontext_t *)context;
    greg_t *g = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)g[REG_RIP];
    if (info->si_code > 0 && info->si_code != SI_KERNEL) ip = NULL; /* a bad address, not a faulting CPUID */
    if (ip == NULL || ip[0] != 0x0f || ip[1] != 0xa2) { /* a real fault: the program's handler, or the default */
        if (next_handler.sa_flags & SA_SIGINFO) {
            next_handler.sa_sigaction(sig, info, context);
        } else if (next_handler.sa_handler != SIG_DFL && next_handler.sa_handler != SIG_IGN) {
            next_handler.sa_handler(sig);
        } else {
            struct sigaction dfl;
            memset(&dfl, 0, sizeof dfl);
            dfl.sa_handler = SIG_DFL;
            real_sigaction(sig, &dfl, NULL); /* returning re-runs the instruction: it faults again, fatally */
        }
        return;
    }
    uint32_t leaf = (uint32_t)g[REG_RAX], sub = (uint32_t)g[REG_RCX], r[4];
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
    real_cpuid(leaf, sub, r);
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
    mask(leaf, sub, r);
    g[REG_RAX] = r[0];
    g[REG_RBX] = r[1];
    g[REG_RCX] = r[2];
    g[REG_RDX] = r[3];
    g[REG_RIP] += 2;
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (real_sigaction == NULL) real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
    if (sig != SIGSEGV) return real_sigaction(sig, act, old);
    if (old != NULL) *old = next_handler;
    if (act != NULL) next_handler = *act;
    return 0;
}

sighandler_t signal(int sig, sighandler_t handler) {
    struct sigaction act, old;
    memset(&act, 0, sizeof act);
    act.sa_handler = handler;
    act.sa_flags = SA_RESTART;
    sigemptyset(&act.sa_mask);
    return sigaction(sig, &act, &old) == 0 ? old.sa_handler : SIG_ERR;
}

__attribute__((constructor)) static void hold_to_avx2(void) {
    struct sigaction sa;
    if (real_sigaction == NULL) real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
    memset(&next_handler, 0, sizeof next_handler);
    next_handler.sa_handler = SIG_DFL;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (real_sigaction(SIGSEGV, &sa, NULL) == 0)
        syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
}
