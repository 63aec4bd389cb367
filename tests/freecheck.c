// freecheck: an LD_PRELOAD shim that finds writes into freed small heap blocks.
//
// Built and used by tests/titan_hunt.py --freecheck (docs/testing.md, "The torchtitan
// crash"). glibc's "malloc(): unaligned fastbin chunk detected" means the first bytes of
// a freed block of at most 120 usable bytes were overwritten. This shim keeps every such
// block out of glibc's hands for a while: free() fills it with POISON and puts it in a
// ring of RING blocks, and only the block it pushes out of the ring goes back to glibc.
// A block whose poison changed before it leaves the ring (or by the process's exit) was
// written after it was freed; the report on stderr gives its address, bytes and the
// stack of its free(). Larger blocks are freed at once.
//
// The exit line "freecheck pid P: done, N report(s), F frees, S small" says the shim ran.
// RING is 2^22 blocks (96 MiB per process): about 30 steps of the hunt's life, whose
// ranks free ~125k small blocks a step.
#define _GNU_SOURCE
#include <execinfo.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

extern void __libc_free(void *);

enum { RING = 1 << 22, SMALL = 120, FRAMES = 10, POISON = 0xA5, MAX_REPORTS = 20 };

typedef struct {
  unsigned char *block;
  size_t size;
  int frames;
  void *stack[FRAMES];
} Held;

static Held *ring;
static unsigned next;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int busy;  // backtrace() and mmap() may free: those frees go to glibc
static int reports;
static unsigned long frees, small_frees;

static void say(const char *text) { (void)!write(2, text, strlen(text)); }

// Reports `held` if its poison changed. Called with `lock` held.
static void check(const Held *held) {
  if (held->block == NULL) return;
  size_t i = 0;
  while (i < held->size && held->block[i] == POISON) i++;
  if (i == held->size || reports++ >= MAX_REPORTS) return;
  char line[256];
  snprintf(line, sizeof line,
           "\n=== freecheck pid %d: write after free into %p (usable %zu), first changed "
           "byte at +%zu; bytes:",
           getpid(), (void *)held->block, held->size, i);
  say(line);
  for (size_t j = 0; j < held->size; j++) {
    if (j % 32 == 0) say("\n  ");
    snprintf(line, sizeof line, "%02x ", held->block[j]);
    say(line);
  }
  say("\n  freed at:\n");
  backtrace_symbols_fd(held->stack, held->frames, 2);
  say("=== end\n");
}

void free(void *ptr) {
  if (ptr == NULL) return;
  size_t size = malloc_usable_size(ptr);
  __atomic_fetch_add(&frees, 1, __ATOMIC_RELAXED);
  if (busy || size > SMALL) {
    __libc_free(ptr);
    return;
  }
  busy = 1;
  __atomic_fetch_add(&small_frees, 1, __ATOMIC_RELAXED);
  Held held = {.block = ptr, .size = size};
  held.frames = backtrace(held.stack, FRAMES);
  memset(ptr, POISON, size);
  pthread_mutex_lock(&lock);
  if (ring == NULL) {
    void *mem = mmap(NULL, sizeof(Held) * RING, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ring = mem == MAP_FAILED ? NULL : mem;
  }
  void *out = ptr;  // without a ring, nothing is held
  if (ring != NULL) {
    Held *slot = &ring[next++ % RING];
    check(slot);
    out = slot->block;
    *slot = held;
  }
  pthread_mutex_unlock(&lock);
  if (out != NULL) __libc_free(out);
  busy = 0;
}

__attribute__((destructor)) static void check_all(void) {
  pthread_mutex_lock(&lock);
  for (unsigned i = 0; ring != NULL && i < RING; i++) check(&ring[i]);
  pthread_mutex_unlock(&lock);
  char line[160];
  snprintf(line, sizeof line, "freecheck pid %d: done, %d report(s), %lu frees, %lu small\n",
           getpid(), reports, frees, small_frees);
  say(line);
}

// backtrace() loads libgcc on its first call, which allocates: do it before any free().
__attribute__((constructor)) static void load_unwinder(void) {
  void *stack[2];
  busy = 1;
  backtrace(stack, 2);
  busy = 0;
}
