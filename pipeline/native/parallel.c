/* A parallel-for for TVM-compiled CPU kernels that degrades gracefully when cores are shared.
 *
 * Why: TVM's runtime pool (src/runtime/thread_pool.cc) hands task i of a parallel loop to worker i, so every
 * parallel loop ends with a barrier that waits for the slowest worker; when another process holds a core,
 * one descheduled worker stalls the whole loop for a scheduler time slice (milliseconds per kernel).
 * onnxruntime's pool instead lets the calling thread claim work that workers have not started (Eigen's
 * ThreadPool with dynamic work distribution), so a loaded machine costs it parallelism, not whole slices.
 *
 * This launcher does the same for TVM kernels.  The compiled code calls the launcher through the
 * ``__TVMBackendParallelLaunch`` pointer that every TVM library exports (TVM's c_backend_api.h documents the
 * contract: ``flambda(task_id, penv, cdata)`` runs chunk ``task_id`` of ``penv->num_task`` equal chunks of
 * the loop); the loader points it here.  A loop is cut into ``chunks x threads`` chunks that the caller and
 * the workers claim from one atomic counter, so whoever runs does the work.  Workers spin briefly for the
 * next loop, then sleep on a futex (they never pin themselves to a core).  Nested loops run inline.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
  void* sync_handle;
  int32_t num_task;
} TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv* penv, void* cdata);

/* One parallel loop is cut into ``g_chunks`` chunks per thread; thread t owns the contiguous chunks
 * [t * g_chunks, (t + 1) * g_chunks) and claims them in order (on a quiet machine each thread runs the
 * contiguous share TVM's static partition would give it), then takes unclaimed chunks of the others.
 * Each owner's cursor is one word: the loop's generation (32 bits) | the end of its range (16) | its next
 * chunk (16), so a thread that wakes late can never claim a chunk of a later loop with an earlier loop's
 * closure: its compare-and-swap fails once the generation moved on. */
#define MAX_THREADS 256
static _Atomic uint64_t g_cursor[MAX_THREADS];
static _Atomic uint32_t g_generation; /* futex word: bumped once per loop */
static _Atomic int32_t g_done;        /* chunks finished in the current loop */
static _Atomic int32_t g_failed;      /* a chunk returned nonzero */
static _Atomic int32_t g_sleepers;
static FTVMParallelLambda g_lambda;
static void* g_cdata;
static int32_t g_total; /* chunks of the current loop */

static int g_threads = 1;   /* the caller + (g_threads - 1) workers */
static int g_chunks = 4;    /* chunks per thread of every loop */
static int64_t g_spin_ns = 200000; /* how long a worker waits for the next loop before it sleeps */
static int g_started = 0;   /* workers running (in this process: reset in a forked child) */
static pthread_mutex_t g_start_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int t_in_loop = 0;
static atomic_flag g_busy = ATOMIC_FLAG_INIT; /* one loop at a time: a second caller runs its loop inline */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts); /* the vDSO: no system call */
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static long futex(_Atomic uint32_t* addr, int op, uint32_t val) {
  return syscall(SYS_futex, (uint32_t*)addr, op, val, NULL, NULL, 0);
}

/* Claim one chunk from owner ``t``'s cursor for the loop of ``generation``; -1 when none is left. */
static int claim(int t, uint32_t generation) {
  uint64_t cur = atomic_load_explicit(&g_cursor[t], memory_order_acquire);
  for (;;) {
    uint32_t gen = (uint32_t)(cur >> 32);
    uint32_t end = (uint32_t)((cur >> 16) & 0xffff), next = (uint32_t)(cur & 0xffff);
    if (gen != generation || next >= end) return -1;
    if (atomic_compare_exchange_weak_explicit(&g_cursor[t], &cur, cur + 1, memory_order_acq_rel,
                                              memory_order_acquire))
      return (int)next;
  }
}

/* Run thread ``self``'s chunks of the loop of ``generation``, then the others' unclaimed ones. */
static void run_chunks(int self, uint32_t generation) {
  int n = g_threads;
  for (int k = 0; k < n; ++k) {
    int owner = (self + k) % n;
    int chunk;
    while ((chunk = claim(owner, generation)) >= 0) {
      TVMParallelGroupEnv env = {NULL, g_total};
      if (g_lambda(chunk, &env, g_cdata) != 0) atomic_store(&g_failed, 1);
      atomic_fetch_add_explicit(&g_done, 1, memory_order_acq_rel);
    }
  }
}

static void* worker(void* arg) {
  int self = (int)(intptr_t)arg;
  t_in_loop = 1; /* a loop inside a chunk runs inline */
  uint32_t seen = atomic_load(&g_generation);
  for (;;) {
    uint32_t gen;
    int spins = 0;
    int64_t until = 0;
    /* spin for a time, not a count: how long a pause takes differs between CPUs (pipeline/cpu_pool.py SPIN_US) */
    while ((gen = atomic_load_explicit(&g_generation, memory_order_acquire)) == seen) {
      if (++spins % 64 != 0) {
        cpu_relax();
        continue;
      }
      int64_t t = now_ns();
      if (until == 0) until = t + g_spin_ns;
      if (t < until) continue;
      atomic_fetch_add(&g_sleepers, 1);
      futex(&g_generation, FUTEX_WAIT_PRIVATE, seen);
      atomic_fetch_sub(&g_sleepers, 1);
      spins = 0;
      until = 0;
    }
    seen = gen;
    run_chunks(self, gen);
  }
  return NULL;
}

static void forked_child(void) { g_started = 0; } /* the workers were not copied into the child */

static void start_workers(void) {
  pthread_mutex_lock(&g_start_lock);
  if (!g_started) {
    static int registered = 0;
    if (!registered) {
      pthread_atfork(NULL, NULL, forked_child);
      registered = 1;
    }
    for (int i = 1; i < g_threads; ++i) {
      pthread_t tid;
      if (pthread_create(&tid, NULL, worker, (void*)(intptr_t)i) == 0) pthread_detach(tid);
    }
    g_started = 1;
  }
  pthread_mutex_unlock(&g_start_lock);
}

/* The launcher the compiled kernels call (the signature of TVM's TVMBackendParallelLaunch). */
int optm_parallel_launch(FTVMParallelLambda flambda, void* cdata, int num_task) {
  (void)num_task; /* 0 in TVM's generated code: "as many as the pool has" */
  if (t_in_loop || g_threads <= 1 || atomic_flag_test_and_set_explicit(&g_busy, memory_order_acquire)) {
    TVMParallelGroupEnv env = {NULL, 1};
    return flambda(0, &env, cdata);
  }
  if (!g_started) start_workers();
  int n = g_threads, per = g_chunks;
  if (n * per > 0xffff) per = 0xffff / n;
  int32_t total = n * per;
  g_lambda = flambda;
  g_cdata = cdata;
  g_total = total;
  atomic_store_explicit(&g_done, 0, memory_order_relaxed);
  atomic_store_explicit(&g_failed, 0, memory_order_relaxed);
  uint32_t gen = atomic_load_explicit(&g_generation, memory_order_relaxed) + 1;
  for (int t = 0; t < n; ++t)
    atomic_store_explicit(&g_cursor[t], ((uint64_t)gen << 32) | ((uint64_t)((t + 1) * per) << 16) | (uint64_t)(t * per),
                          memory_order_release);
  atomic_store_explicit(&g_generation, gen, memory_order_release);
  if (atomic_load(&g_sleepers) > 0) futex(&g_generation, FUTEX_WAKE_PRIVATE, INT32_MAX);
  t_in_loop = 1;
  run_chunks(0, gen);
  t_in_loop = 0;
  /* A worker still runs a chunk it claimed: wait, yielding the core (it may be the one it needs). */
  for (int spins = 0; atomic_load_explicit(&g_done, memory_order_acquire) < total; ++spins) {
    if (spins < 2000) cpu_relax();
    else sched_yield();
  }
  int failed = atomic_load(&g_failed);
  atomic_flag_clear_explicit(&g_busy, memory_order_release);
  return failed ? -1 : 0;
}

/* Configure the pool: threads including the caller (before its first loop only), chunks per thread and the
 * microseconds a worker spins for the next loop (any time: read per loop). */
void optm_parallel_config(int threads, int chunks, int spin_us) {
  if (!g_started) g_threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
  g_chunks = chunks > 0 ? chunks : 1;
  g_spin_ns = spin_us >= 0 ? (int64_t)spin_us * 1000 : 0;
}
