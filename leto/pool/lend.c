/* Lends retained device regions to PyTorch's caching allocator (leto/pool/lend.py).
 *
 * A CUDAPluggableAllocator behind one torch.cuda.MemPool: requests of at least
 * `min_bytes` are placed first-fit in the lent arenas (the RMU's undo buffer, pool memory
 * mapped into this process); everything else, and whatever does not fit, comes from
 * cuMemAlloc in the current context. The caching allocator keeps what it gets as cached
 * segments, so the arenas stay "allocated" here for the life of the pool: the Python
 * side checks that no block in them is live before the buffers are used again.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define MAX_ARENAS 8
#define MAX_LENT 4096
#define ALIGN ((size_t)2 << 20)

typedef int (*cu_alloc_fn)(unsigned long long *, size_t);
typedef int (*cu_free_fn)(unsigned long long);

static struct { uintptr_t base; size_t bytes; } arenas[MAX_ARENAS];
static struct { uintptr_t ptr; size_t bytes; } lent[MAX_LENT];
static int n_arenas, n_lent;
static size_t min_bytes = (size_t)2 << 20;
static size_t fallback_bytes;
static cu_alloc_fn cu_alloc;
static cu_free_fn cu_free;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

int leto_lend_add(void *base, size_t bytes) {
    pthread_mutex_lock(&mu);
    int ok = n_arenas < MAX_ARENAS;
    if (ok) {
        arenas[n_arenas].base = (uintptr_t)base;
        arenas[n_arenas].bytes = bytes;
        n_arenas++;
    }
    pthread_mutex_unlock(&mu);
    return ok ? 0 : -1;
}

void leto_lend_set_min_bytes(size_t bytes) { min_bytes = bytes; }

/* Bytes of the arenas the caching allocator holds now (cached or live). */
size_t leto_lend_lent_bytes(void) {
    size_t total = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n_lent; i++) total += lent[i].bytes;
    pthread_mutex_unlock(&mu);
    return total;
}

/* Bytes that had to come from cuMemAlloc (requests the arenas could not take). */
size_t leto_lend_fallback_bytes(void) { return fallback_bytes; }

/* The segment that holds byte `i` of the lent list, for the Python side's check. */
int leto_lend_segment(int i, uintptr_t *ptr, size_t *bytes) {
    pthread_mutex_lock(&mu);
    int ok = i >= 0 && i < n_lent;
    if (ok) {
        *ptr = lent[i].ptr;
        *bytes = lent[i].bytes;
    }
    pthread_mutex_unlock(&mu);
    return ok ? 0 : -1;
}

static uintptr_t place(size_t size) {
    for (int a = 0; a < n_arenas; a++) {
        uintptr_t lo = arenas[a].base, hi = arenas[a].base + arenas[a].bytes;
        uintptr_t pos = (lo + ALIGN - 1) & ~(ALIGN - 1);
        int moved = 1;
        while (moved && pos + size <= hi) { /* first fit: step past every block in the way */
            moved = 0;
            for (int i = 0; i < n_lent; i++) {
                if (lent[i].ptr < pos + size && pos < lent[i].ptr + lent[i].bytes) {
                    pos = (lent[i].ptr + lent[i].bytes + ALIGN - 1) & ~(ALIGN - 1);
                    moved = 1;
                }
            }
        }
        if (pos + size <= hi) return pos;
    }
    return 0;
}

static void *fallback(size_t size) {
    if (!cu_alloc) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!lib) return NULL;
        cu_alloc = (cu_alloc_fn)dlsym(lib, "cuMemAlloc_v2");
        cu_free = (cu_free_fn)dlsym(lib, "cuMemFree_v2");
        if (!cu_alloc || !cu_free) return NULL;
    }
    unsigned long long ptr = 0;
    if (cu_alloc(&ptr, size) != 0) return NULL;
    __atomic_add_fetch(&fallback_bytes, size, __ATOMIC_RELAXED);
    return (void *)(uintptr_t)ptr;
}

void *leto_lend_alloc(ssize_t size, int device, void *stream) {
    (void)device;
    (void)stream;
    if (size <= 0) return NULL;
    if ((size_t)size >= min_bytes) {
        pthread_mutex_lock(&mu);
        uintptr_t pos = n_lent < MAX_LENT ? place((size_t)size) : 0;
        if (pos) {
            lent[n_lent].ptr = pos;
            lent[n_lent].bytes = (size_t)size;
            n_lent++;
        }
        pthread_mutex_unlock(&mu);
        if (pos) return (void *)pos;
    }
    return fallback((size_t)size);
}

void leto_lend_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)device;
    (void)stream;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n_lent; i++) {
        if (lent[i].ptr == (uintptr_t)ptr) {
            lent[i] = lent[--n_lent];
            pthread_mutex_unlock(&mu);
            return;
        }
    }
    pthread_mutex_unlock(&mu);
    if (cu_free) {
        cu_free((unsigned long long)(uintptr_t)ptr);
        __atomic_sub_fetch(&fallback_bytes, (size_t)size, __ATOMIC_RELAXED);
    }
}
